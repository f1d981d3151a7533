"""ZeRO-1 as a part of a strategy (``zero1``: the optimizer state split over data).

Against one device (loss and gradients) and against the same composition without zero1 (the
parameters after two Adam steps: splitting the update must not change it); the optimizer state's
layout; the compiled program's weight gathers and state bytes against the closed form, exactly;
their price; and the refusals. Tiny sizes: llama tiny with 4 layers, batch 8, seq 32.
"""

from __future__ import annotations

from functools import cache

import jax
import numpy as np
import optax
import pytest
from closeness import assert_close
from flax import nnx

import models
from partition_rules import AxisMap, CompositionError, composition
from sharding import (
    StepConfigError,
    Workload,
    build_program,
    compare,
    compile_train_step,
    explain,
    make_mesh,
    planning,
)
from sharding.costmodel import (
    CollectiveWork,
    NoFittingStrategyError,
    StepWork,
    layouts,
    predict,
    step_time,
    work_from_prediction,
)

BATCH, SEQ, LAYERS = 8, 32, 4
CASES = {  # composition with zero1 -> (its mesh, the pipeline schedule or None)
    "zero1": ("data=8", None),
    "zero1+tp": ("data=2,tensor=4", None),
    "zero1+tp+pp": ("stage=2,data=2,tensor=2", "gpipe"),
}


def cfg():
    return models.llama.config("tiny", n_layers=LAYERS)


@cache
def batch() -> dict:
    made = models.llama.make_batch(cfg(), BATCH, SEQ, key=jax.random.key(7))
    return {k: np.asarray(v) for k, v in made.items()}


@cache
def program(strategy: str, mesh: str, schedule: str | None):
    work = Workload.from_family(models.llama, cfg())
    return build_program(work, strategy, mesh, batch=BATCH, seq=SEQ, schedule=schedule,
                         microbatches=2 if schedule else None)  # fmt: skip


@cache
def one_device() -> tuple[float, dict, dict]:
    """One device's loss and gradients, and its seed-0 parameters on the host."""
    one = build_program(Workload.from_family(models.llama, cfg()), "dp",
                        make_mesh("data=1", jax.devices()[:1]), batch=BATCH, seq=SEQ)  # fmt: skip
    params = jax.device_get(one.init(seed=0)["params"])
    loss, grads = one.loss_and_grads(params, batch())
    return float(loss), jax.tree.map(np.asarray, grads), params


def trained(prog) -> tuple[dict, dict]:
    """(parameters, optimizer state) on the host after two steps from seed 0."""
    state = prog.init(seed=0)
    for _ in range(2):
        state, _ = prog.step(state, batch())
    return jax.device_get(state["params"]), state["opt_state"]


@pytest.mark.parametrize("name", CASES)
def test_zero1_trains_as_the_composition_without_it(name):
    mesh, schedule = CASES[name]
    want_loss, want_grads, params = one_device()
    prog = program(name, mesh, schedule)
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch())
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert_close(jax.tree.map(np.asarray, grads), want_grads)

    without = composition(name.replace("zero1+", "").replace("zero1", "dp")).name
    got, opt_state = trained(prog)
    want, _ = trained(program(without, mesh, schedule))
    assert_close(got, want)
    # Every moment array is split over data on top of its parameter's layout; the count is whole.
    for leaf in jax.tree.leaves(opt_state):
        axes = {a for e in leaf.sharding.spec for a in ((e,) if isinstance(e, str) else e or ())}
        assert ("data" in axes) == (leaf.ndim > 0), (leaf.shape, leaf.sharding.spec)


@pytest.mark.parametrize("name", CASES)
def test_the_weight_gathers_and_state_bytes_are_the_closed_forms(name):
    mesh, schedule = CASES[name]
    prog = program(name, mesh, schedule)
    gathers = [c for c in prog.report().collectives
               if c.kind == "all-gather" and c.axes == ("data",)]  # fmt: skip
    sizes = dict(prog.mesh.shape)
    pred = predict(models.llama, cfg(), name, sizes, BATCH, SEQ,
                   pipeline=(schedule, 2, 1) if schedule else None)  # fmt: skip
    modelled = [t for t in pred.traffic if t.kind == "all-gather" and t.axes == ("data",)]
    assert [t.what for t in modelled] == ["updated weights gathered after the optimizer "
                                          "update (zero1)"] * len(modelled)  # fmt: skip
    assert sum(c.bytes * c.multiplicity for c in gathers) == sum(t.bytes for t in modelled)
    assert sum(c.multiplicity for c in gathers) == sum(t.count for t in modelled) == 12
    # Float32 weights, gathered whole over data: each device's share of every parameter.
    params = prog.init(seed=0)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params["params"]))
    assert sum(t.bytes for t in modelled) == held
    state = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params["opt_state"]))
    assert pred.optimizer_bytes == state
    # Every array splits here (12 gathers): 1/data of the moments without zero1, the count whole.
    dp = predict(models.llama, cfg(), name.replace("zero1", "dp"), sizes, BATCH, SEQ,
                 pipeline=(schedule, 2, 1) if schedule else None)  # fmt: skip
    assert sizes["data"] * (pred.optimizer_bytes - 4) == dp.optimizer_bytes - 4


def test_the_weight_gathers_are_priced_after_the_update():
    gather = CollectiveWork(
        "all-gather",
        ("data",),
        4e9,
        12,
        "updated weights gathered after the optimizer update (zero1)",
    )
    work = StepWork({"data": 8}, 6e13, [gather], tokens=8 * 4096, dtype="bfloat16")
    st = step_time(work, "h100:1x8")
    assert st.collectives[0].overlap == "exposed: after the optimizer update"
    assert st.exposed_comm_s == pytest.approx(st.collectives[0].time_s)
    work.reduction_overlap = True  # Megatron's --overlap-param-gather: behind the first forward
    hidden = step_time(work, "h100:1x8")
    assert hidden.collectives[0].overlap == "micro"
    assert hidden.exposed_comm_s < st.exposed_comm_s


def test_zero1_with_fsdp_is_refused():
    with pytest.raises(
        CompositionError,
        match=r"zero1 with fsdp: fsdp splits the optimizer "
        r"state with the weights already; write fsdp\+tp",
    ):
        composition("zero1+fsdp+tp")


def test_a_state_that_data_cannot_split_is_refused_before_compiling():
    # data=6 divides no dimension of llama tiny (64 wide, 256 words, 8 per head, 4 layers).
    match = (r"zero1 splits the optimizer state over data=6, and 6 divides no dimension of any "
             r"of its arrays \(e\.g\. \S+, \[.*\] per device under its parameter's layout\); "
             r"use a mesh whose data size divides one of")  # fmt: skip
    with pytest.raises(StepConfigError, match=match):
        build_program(Workload.from_family(models.llama, cfg()), "zero1",
                      make_mesh("data=6", jax.devices()[:6]), batch=6, seq=SEQ)  # fmt: skip
    with pytest.raises(StepConfigError, match=match):
        predict(models.llama, cfg(), "zero1", {"data": 6}, 6, SEQ)


def test_arrays_no_dimension_of_which_divides_stay_whole_and_are_counted_whole():
    # data=128 divides the 256-long dimensions (the table's words, the MLP's hidden) only: those
    # arrays' moments split and their weights are gathered, every other array's stays whole.
    dp = predict(models.llama, cfg(), "dp", {"data": 128}, 128, SEQ)
    z1 = predict(models.llama, cfg(), "zero1", {"data": 128}, 128, SEQ)
    gathered = [t.bytes for t in z1.traffic if t.kind == "all-gather"]
    assert 0 < len(gathered) < 12
    assert dp.optimizer_bytes - z1.optimizer_bytes == sum(2 * (b - b // 128) for b in gathered)


def test_compare_offers_zero1_compositions_their_shapes():
    got = [(x.label, x.mesh) for x in layouts(8, 4, strategies="zero1,zero1+tp,zero1+tp+pp")]
    assert got == [("zero1", "data=8"), ("zero1+tp", "data=4,tensor=2"),
                   ("zero1+tp+pp gpipe m=4", "stage=2,data=2,tensor=2")]  # fmt: skip
    assert layouts(2, 4, strategies="zero1+tp") == []  # data would be 1: zero1 would split nothing


def test_plan_finds_zero1_where_dp_does_not_fit():
    # llama 7b on one node of 8 h100s: dp's replicated Adam state (16 bytes a parameter) fits no
    # remat policy; zero1 on data=8 keeps 1/8 of the moments per device and fits.
    with pytest.raises(NoFittingStrategyError, match=r"fits no strategy on h100:1x8"):
        planning.plan(models.llama, size="7b", target="h100:1x8", batch=32, seq=4096,
                      strategies="dp", aot=0)  # fmt: skip
    found = planning.plan(models.llama, size="7b", target="h100:1x8", batch=32, seq=4096,
                          strategies="dp,zero1", aot=0)  # fmt: skip
    best = found.ranked[0]
    assert (best.layout.strategy, best.layout.mesh, best.fits) == ("zero1", "data=8", True)


def test_explain_counts_the_optimizer_state_split_over_data():
    work = Workload.from_family(models.llama, cfg())
    tp, z1 = (explain(work.rules, work.axis_map(s), lambda: work.model(nnx.Rngs(0)),
                      "data=2,tensor=4") for s in ("tp", "zero1+tp"))  # fmt: skip
    assert z1.totals["param_bytes_per_device"] == tp.totals["param_bytes_per_device"]
    assert 2 * z1.totals["adam_bytes_per_device"] == tp.totals["adam_bytes_per_device"]
    # And the program holds what explain says.
    state = program("zero1+tp", "data=2,tensor=4", None).init(seed=0)["opt_state"]
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state) if x.ndim)
    assert held == z1.totals["adam_bytes_per_device"]


def test_compare_prices_the_compiled_gathers_after_the_update_and_no_other_gather():
    def rules(strategy: str, mesh: str | None = None) -> set:
        result = compare(models.llama, size="tiny", batch=BATCH, seq=SEQ, strategies=strategy,
                         mesh=mesh, dtype="float32")  # fmt: skip
        return {(x.kind, x.axes, x.overlap) for x in result.candidates[0].predicted.collectives}

    assert ("all-gather", ("data",), "exposed: after the optimizer update") in rules("zero1")
    after = "exposed: after the optimizer update"
    assert not [r for r in rules("fsdp_tp", "data=2,fsdp=2,tensor=2") if r[2] == after]
    # Its closed form gathers the token table over data alone: not zero1's, prefetched.
    pred = predict(models.llama, cfg(), "fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, BATCH, SEQ)
    st = step_time(work_from_prediction(pred), "h100:1x8")
    assert ("all-gather", ("data",), "gather") in {(x.kind, x.axes, x.overlap)
                                                   for x in st.collectives}  # fmt: skip


def test_the_gathers_run_once_per_step_and_only_with_optimizer_state():
    one = predict(models.llama, cfg(), "zero1", {"data": 8}, BATCH, SEQ)
    four = predict(models.llama, cfg(), "zero1", {"data": 8}, 4 * BATCH, SEQ, accum=4)
    gathers = [[(t.bytes, t.count) for t in p.traffic if t.kind == "all-gather"]
               for p in (one, four)]  # fmt: skip
    assert gathers[0] == gathers[1] and len(gathers[0]) == 12
    sgd = predict(models.llama, cfg(), "zero1", {"data": 6}, 6, SEQ, optimizer="sgd")
    assert not [t for t in sgd.traffic if t.kind == "all-gather"]  # nothing to split: no refusal


def test_an_optimizer_axis_the_parameters_already_use_is_refused():
    work = Workload.from_family(models.llama, cfg())
    axis_map = AxisMap({**work.axis_map("fsdp"), "optimizer": "fsdp"})
    with pytest.raises(
        StepConfigError,
        match=r"the optimizer state is to be split over fsdp on "
        r"top of its parameter's layout, and \S+'s layout "
        r"P\(.*\) splits over fsdp already",
    ):
        compile_train_step(lambda rngs: models.llama.Model(cfg(), rngs=rngs), models.llama.loss,
                           optax.adamw(1e-3), work.rules, axis_map, make_mesh("fsdp=8"),
                           models.llama.batch_shapes(cfg(), BATCH, SEQ), stack="layers")  # fmt: skip


def test_a_compiled_zero1_keeps_whole_the_arrays_data_cannot_split():
    # d_model 36: the norms' scales ([36] and [4, 36] per device) have no dimension data=8
    # divides, so their moments stay whole and their weights are not gathered; the other nine
    # arrays split. The program still trains as dp does, and says which arrays it kept whole.
    narrow = models.llama.config("tiny", n_layers=LAYERS, d_model=36, n_heads=6, n_kv_heads=2)
    work = Workload.from_family(models.llama, narrow)
    prog = build_program(work, "zero1", "data=8", batch=BATCH, seq=SEQ)
    norms = ("final_norm/scale", "layers/attn_norm/scale", "layers/mlp_norm/scale")
    assert sorted(p.split("/", 2)[2] for p in prog.optimizer_whole) == sorted(norms * 2)
    assert {p.split("/")[1] for p in prog.optimizer_whole} == {"mu", "nu"}
    kept = prog.report().extra["optimizer state kept whole over data (zero1: no dimension divides)"]
    assert kept == ", ".join(prog.optimizer_whole)

    got, opt_state = trained(prog)
    want, _ = trained(build_program(work, "dp", "data=8", batch=BATCH, seq=SEQ))
    assert_close(got, want)
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        axes = {a for e in leaf.sharding.spec for a in ((e,) if isinstance(e, str) else e or ())}
        whole = leaf.ndim == 0 or jax.tree_util.keystr(path).split("'")[-2] == "scale"
        assert ("data" in axes) != whole, (jax.tree_util.keystr(path), leaf.sharding.spec)

    gathers = [c for c in prog.report().collectives
               if c.kind == "all-gather" and c.axes == ("data",)]  # fmt: skip
    pred = predict(models.llama, narrow, "zero1", {"data": 8}, BATCH, SEQ)
    dp = predict(models.llama, narrow, "dp", {"data": 8}, BATCH, SEQ)
    modelled = [t.bytes for t in pred.traffic if t.kind == "all-gather"]
    assert sum(c.multiplicity for c in gathers) == len(modelled) == 9
    assert sum(c.bytes * c.multiplicity for c in gathers) == sum(modelled)
    state = prog.init(seed=0)["opt_state"]
    assert pred.optimizer_bytes == sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state)
    )
    assert dp.optimizer_bytes - pred.optimizer_bytes == sum(2 * (b - b // 8) for b in modelled)

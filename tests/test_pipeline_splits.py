"""Pipelines combined with the sequence splits: context parallelism (pp_cp) and Megatron sequence
parallelism (pp_tp_sp) inside each stage.

Each schedule and attention method against the single-device step (loss and every gradient,
float32); the bytes attention moves over context against `context_traffic` per tick; SP's
gathers and its saving in temporaries against pp_tp; and what is refused, before compiling.
Tiny sizes (llama tiny with 4 layers, batch 8, seq 32, 2 micro-batches); each program is
compiled once per module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from functools import cache

import jax
import numpy as np
import pytest
from closeness import assert_close

import models
from models.kernels import use as use_kernels
from sharding import MeshSpec, StrategyMeshError, Workload, build_program, make_mesh
from sharding.context import ContextParallelError, context_traffic
from sharding.costmodel import predict

BATCH, SEQ, LAYERS, MICRO = 8, 32, 4, 2
PP_CP, PP_TP_SP = "stage=2,data=2,context=2", "stage=2,data=2,tensor=2"


def workload(family: str = "llama") -> Workload:
    fam = models.get_family(family)
    return Workload.from_family(fam, fam.config("tiny", n_layers=LAYERS))


@cache
def program(family: str, strategy: str, mesh: str, schedule: str, method: str | None = None):
    return build_program(workload(family), strategy, mesh, batch=BATCH, seq=SEQ,
                         schedule=schedule, microbatches=MICRO, context_method=method)  # fmt: skip


@cache
def batch(family: str) -> dict:
    fam = models.get_family(family)
    cfg = fam.config("tiny", n_layers=LAYERS)
    return {k: np.asarray(v) for k, v in fam.make_batch(cfg, BATCH, SEQ, key=jax.random.key(7)).items()}  # fmt: skip


@cache
def one_device(family: str):
    """The reference program on one device and its seed-0 parameters (on the host)."""
    prog = build_program(workload(family), "dp", make_mesh("data=1", jax.devices()[:1]),
                         batch=BATCH, seq=SEQ)  # fmt: skip
    return prog, jax.device_get(prog.init(seed=0)["params"])


@cache
def loss_and_grads(family: str, strategy: str, mesh: str, schedule: str | None, method=None):
    """One device's numbers (``schedule=None``) or the program's, from the same parameters (the
    reference's, placed in the program's shardings; born-sharded init is tested elsewhere)."""
    ref, params = one_device(family)
    prog = ref if schedule is None else program(family, strategy, mesh, schedule, method)
    params = jax.device_put(params, prog.param_shardings)
    loss, grads = prog.loss_and_grads(params, batch(family))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


# pp_cp under 1f1b and interleaved with allgather: inside fsdp+tp+sp+cp+pp and dp+tp+sp+cp+pp,
# tests/test_compositions.py (16 devices).
CASES = [
    ("llama", "pp_cp", PP_CP, "gpipe", "ring"),
    ("llama", "pp_cp", PP_CP, "circular", "allgather"),
    ("llama", "pp_cp", PP_CP, "gpipe", "ulysses"),
    # Ring attention's ppermute inside the stage body: the lanes run in lock-step.
    ("llama", "pp_cp", PP_CP, "1f1b", "ring"),
    ("llama", "pp_cp", PP_CP, "zb-h1", "ring"),
    ("llama", "pp_cp", PP_CP, "zb-h1", "ulysses"),
    ("gpt2", "pp_cp", PP_CP, "gpipe", "ring"),  # a learned position table, through the seam
    ("llama", "pp_tp_sp", PP_TP_SP, "gpipe", None),
    ("llama", "pp_tp_sp", PP_TP_SP, "1f1b", None),
    ("llama", "pp_tp_sp", PP_TP_SP, "zb-h1", None),
]


@pytest.mark.parametrize(("family", "strategy", "mesh", "schedule", "method"), CASES,
                         ids=["-".join(filter(None, c)) for c in CASES])  # fmt: skip
def test_pipeline_with_a_sequence_split_matches_one_device(family, strategy, mesh, schedule,
                                                           method):  # fmt: skip
    loss, grads = loss_and_grads(family, strategy, mesh, schedule, method)
    ref_loss, ref_grads = loss_and_grads(family, "dp", "one device", None)
    assert_close(float(loss), ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_rematerialised_backward_with_ring_attention(schedule):
    """The explicit schedules replay each chunk's rematerialised forward on residuals the lane
    made varying over the manual axes; zb-h1 also splits that backward into B and W by
    evaluating its jaxpr. Each once raised jax's ValueError on a pvary (zb-h1 on jax 0.10, both
    on 0.12, from the positions table sliced by the context index). Same numbers as one device."""
    prog = build_program(workload(), "pp_cp", PP_CP, batch=BATCH, seq=SEQ, schedule=schedule,
                         microbatches=MICRO, context_method="ring", remat="full")  # fmt: skip
    _, params = one_device("llama")
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings),
                                      batch("llama"))  # fmt: skip
    ref_loss, ref_grads = loss_and_grads("llama", "dp", "one device", None)
    assert_close(float(loss), ref_loss)
    assert_close([np.asarray(g) for g in jax.tree.leaves(grads)], ref_grads)


def collective_bytes(prog, axes: tuple[str, ...]) -> dict[str, int]:
    got: dict[str, int] = defaultdict(int)
    for op in prog.report().collectives:
        if op.axes == axes:
            got[op.kind] += op.bytes * op.multiplicity
    return dict(got)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_attention_moves_its_closed_form_over_context_on_every_tick(method):
    """gpipe runs every stage's layers on every tick (m + p - 1 of them, bubbles on zeros), each
    on one micro-batch: attention's bytes over context are exactly that many times those of
    the stage's layers on one micro-batch."""
    got = collective_bytes(program("llama", "pp_cp", PP_CP, "gpipe", method), ("context",))
    cfg, sizes = workload().config, dict(make_mesh(PP_CP).shape)
    ticks = MICRO + sizes["stage"] - 1
    want: dict[str, int] = defaultdict(int)
    for t in context_traffic(method, batch=BATCH // MICRO, seq=SEQ, heads=cfg.n_heads,
                             kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                             layers=LAYERS // sizes["stage"], context=sizes["context"],
                             batch_shards=sizes["data"], batch_over_context=False):  # fmt: skip
        want[t.kind] += t.bytes * ticks
    # Besides these, only the gradients of what is outside the stack are reduced over context.
    assert {k: v for k, v in got.items() if k != "all-reduce"} == dict(want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequence_parallel_stages_gather_and_save_temporaries(schedule):
    """Inside the stages, SP all-gathers the sequence before each column-parallel matmul (pp_tp
    gathers over tensor only what crosses between stages, one micro-batch's activations per
    shift) and holds less: norms and residuals on S/t."""
    sp, tp = program("llama", "pp_tp_sp", PP_TP_SP, schedule), program("llama", "pp_tp",
                                                                       PP_TP_SP, schedule)  # fmt: skip
    shifts = sum(op.multiplicity for op in tp.report().collectives
                 if op.kind == "collective-permute" and op.axes == ("stage",))  # fmt: skip
    micro = BATCH // MICRO // 2 * SEQ * workload().config.d_model * 4  # [b/data, S, D] float32
    assert collective_bytes(tp, ("tensor",))["all-gather"] == shifts * micro
    assert collective_bytes(sp, ("tensor",))["all-gather"] > 2 * shifts * micro
    assert sp.report().memory.temp < 0.95 * tp.report().memory.temp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tensor_ranks_send_their_share_between_stages(schedule):
    """pp_tp, Megatron's scatter/gather: every shift between stages moves 1/t of a micro-batch's
    activations (or cotangents) per device, [b/data, S/t, D], and the receiving stage gathers
    them whole over tensor; under SP they cross split already, and nothing is gathered for it.
    The numbers stay the single device's (tests/test_pipeline.py, tensor-parallel stages)."""
    micro = BATCH // MICRO // 2 * SEQ * workload().config.d_model * 4  # [b/data, S, D] float32
    for strategy in ("pp_tp", "pp_tp_sp"):
        prog = program("llama", strategy, PP_TP_SP, schedule)
        ops = prog.report().collectives
        shifts = [op for op in ops if op.kind == "collective-permute" and op.axes == ("stage",)]
        assert shifts and {op.bytes for op in shifts} == {micro // 2}, strategy
        # the closed form's gathers over tensor, the shifts' (pp_tp) or SP's alone, to the byte
        # (1f1b's compiled count charges SP's gathers, inside its lanes, on every tick; they are
        # priced as they run in tests/test_pipeline_split_costs.py)
        if schedule == "1f1b" and strategy == "pp_tp_sp":
            continue
        pred = predict(models.llama, workload().config, strategy, MeshSpec.parse(PP_TP_SP).sizes,
                       BATCH, SEQ, pipeline=(schedule, MICRO, 1))  # fmt: skip
        assert collective_bytes(prog, ("tensor",))["all-gather"] == pred.collective_bytes(
            "all-gather", "tensor"), strategy  # fmt: skip


def test_positions_outside_the_seam_are_refused_inside_a_pipeline():
    """A stage sees its own slice of the sequence: positions computed by the model would be
    the slice's, so the model must take them from the positions kernel."""

    def attention_only(**kernels):
        kernels.pop("positions", None)
        return use_kernels(**kernels) if kernels else contextlib.nullcontext()

    work = dataclasses.replace(workload(), kernels=attention_only)
    with pytest.raises(ContextParallelError, match=r"slice of the sequence.*positions kernel"):
        build_program(work, "pp_cp", PP_CP, batch=BATCH, seq=SEQ, schedule="gpipe",
                      microbatches=MICRO, context_method="ulysses")  # fmt: skip


def test_a_mesh_axis_the_pipelines_parts_do_not_use_is_refused():
    with pytest.raises(StrategyMeshError, match=r"'pp_cp' \(cp\+pp\) splits nothing over mesh "
                       r"axis tensor=2.*use --strategy tp\+cp\+pp"):  # fmt: skip
        build_program(workload(), "pp_cp", "stage=2,context=2,tensor=2", batch=BATCH, seq=SEQ,
                      schedule="gpipe", microbatches=MICRO)  # fmt: skip

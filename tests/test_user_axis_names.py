"""A model of the user's own, with its own logical axis names, under renamed shipped strategies.

The model, its parameter paths and its rule table are written here (nothing from `models/`): a
2-block MLP whose rules name ``pixels``, ``hidden``, ``ffn``, ``gate_ffn`` and ``labels``. The
strategies come from `partition_rules.strategy` with the shipped names renamed to those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_close
from flax import nnx
from jax.sharding import PartitionSpec as P

from partition_rules import (
    LOGICAL_AXES,
    STRATEGIES,
    AxisMap,
    AxisRenameError,
    PartitionRulesError,
    Rules,
    UnknownPresetError,
    strategy,
)
from sharding import compile_train_step, make_mesh, path_str

PIXELS, HIDDEN, FFN, LABELS, BATCH = 12, 16, 32, 8, 16


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(HIDDEN, FFN, rngs=rngs)
        self.gate = nnx.Linear(HIDDEN, FFN, rngs=rngs)
        self.down = nnx.Linear(FFN, HIDDEN, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.gelu(self.up(h)) * self.gate(h))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj_in = nnx.Linear(PIXELS, HIDDEN, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.readout = nnx.Linear(HIDDEN, LABELS, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.readout(h)


RULES = Rules(
    [
        (r"proj_in/kernel", ("pixels", "hidden")),
        (r"proj_in/bias", ("hidden",)),
        (r"blocks/\d+/up/kernel", ("hidden", "ffn")),
        (r"blocks/\d+/gate/kernel", ("hidden", "gate_ffn")),
        (r"blocks/\d+/(up|gate)/bias", (None,)),
        (r"blocks/\d+/down/kernel", ("ffn", "hidden")),
        (r"blocks/\d+/down/bias", ("hidden",)),
        (r"readout/kernel", ("hidden", "labels")),
        (r"readout/bias", ("labels",)),
    ]
)
NAMES = {"input": "pixels", "embed": "hidden", "mlp": ("ffn", "gate_ffn"), "classes": "labels"}


def plain_loss(model: Net, batch: dict) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def remat_loss(model: Net, batch: dict, *, remat=None) -> jax.Array:
    return plain_loss(
        model, batch
    )  # a model with no layer stack to wrap takes remat= and ignores it


def make_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(BATCH, PIXELS)).astype(np.float32),
        "y": rng.integers(0, LABELS, size=(BATCH,)).astype(np.int32),
    }


BATCH_SHAPES = {
    "x": jax.ShapeDtypeStruct((BATCH, PIXELS), jnp.float32),
    "y": jax.ShapeDtypeStruct((BATCH,), jnp.int32),
}

_F, _T = "fsdp", "tensor"
CASES = {
    # strategy, mesh, loss, expected spec per parameter path (blocks/0 stands for both blocks)
    "fsdp": ("fsdp", "fsdp=8", plain_loss, {
        "proj_in/kernel": P(None, _F), "proj_in/bias": P(_F),
        "blocks/0/up/kernel": P(_F, None), "blocks/0/gate/kernel": P(_F, None),
        "blocks/0/up/bias": P(None), "blocks/0/down/kernel": P(None, _F),
        "blocks/0/down/bias": P(_F), "readout/kernel": P(_F, None), "readout/bias": P(None),
    }),
    "dp_tp": ("dp_tp", "data=4,tensor=2", remat_loss, {
        "proj_in/kernel": P(None, None), "proj_in/bias": P(None),
        "blocks/0/up/kernel": P(None, _T), "blocks/0/gate/kernel": P(None, _T),
        "blocks/0/up/bias": P(None), "blocks/0/down/kernel": P(_T, None),
        "blocks/0/down/bias": P(None), "readout/kernel": P(None, _T), "readout/bias": P(_T),
    }),
    "fsdp_tp": ("fsdp_tp", "data=2,fsdp=2,tensor=2", plain_loss, {
        "blocks/0/up/kernel": P(_F, _T), "blocks/0/down/kernel": P(_T, _F),
        "readout/kernel": P(_F, _T), "proj_in/kernel": P(None, _F),
    }),
}  # fmt: skip


def _by_path(tree) -> dict:
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _compile(name: str, mesh: str, loss, rules: Rules = RULES):
    return compile_train_step(
        Net, loss, optax.sgd(0.1), rules, strategy(name, **NAMES), make_mesh(mesh), BATCH_SHAPES
    )


@pytest.mark.parametrize("case", list(CASES))
def test_user_model_matches_one_device(case):
    name, mesh, loss, expected = CASES[case]
    program = _compile(name, mesh, loss)
    assert program.unused_rules == []

    specs = {p: s.spec for p, s in _by_path(program.param_shardings).items()}
    for path, spec in expected.items():
        for p in {path, path.replace("blocks/0", "blocks/1")}:
            assert specs[p] == spec, f"{p}: {specs[p]} != {spec}"

    params = program.init(seed=0)["params"]
    batch = make_batch()
    loss_sharded, grads_sharded = program.loss_and_grads(params, batch)

    host = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)
    graphdef = program.graphdef
    loss_ref, grads_ref = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), batch))(host)

    assert_close(float(loss_sharded), float(loss_ref))
    got, want = _by_path(grads_sharded), _by_path(grads_ref)
    assert got.keys() == want.keys() and len(got) == 2 + 2 * 6 + 2
    assert_close({p: got[p] for p in want}, want)


def test_renamed_map_keys_are_the_users_names():
    m = strategy("fsdp_tp", embed="hidden", heads="n_heads", mlp="ffn", layers="blocks")
    assert (m["hidden"], m["n_heads"], m["ffn"], m["blocks"]) == ("fsdp", "tensor", "tensor", None)
    for renamed in ("embed", "heads", "mlp", "layers"):
        assert renamed not in m
    kept = set(LOGICAL_AXES) - {"embed", "heads", "mlp", "layers"}
    assert all(m[k] == STRATEGIES["fsdp_tp"][k] for k in kept)
    assert len(m) == len(LOGICAL_AXES)


def test_several_names_for_one_shipped_name_and_the_one_argument_form():
    m = strategy("dp_tp", mlp=("ffn", "expert_hidden"))
    assert m["ffn"] == m["expert_hidden"] == "tensor" and "mlp" not in m
    assert strategy("fsdp_tp") is STRATEGIES["fsdp_tp"]
    assert strategy("fsdp", embed="embed") == STRATEGIES["fsdp"]
    assert isinstance(m, AxisMap)


def test_a_user_name_equal_to_a_kept_shipped_name_wins():
    # Your d_model is called "mlp": your entry replaces the shipped "mlp" you did not rename.
    assert strategy("fsdp", embed="mlp")["mlp"] == "fsdp"
    # Swapping two shipped names is two renames, not a clash.
    swapped = strategy("tp", embed="mlp", mlp="embed")
    assert (swapped["mlp"], swapped["embed"]) == (None, "tensor")


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: strategy("fsdp", hidden="embed"), AxisRenameError,
         r"'hidden' is not a shipped logical axis; .*\(classes, conv_in, .*, vocab\).* "
         r"embed='hidden' \(swapped\?\)"),
        (lambda: strategy("fsdp", hiden="x"), AxisRenameError,
         r"'hiden' is not a shipped logical axis.*e\.g\. strategy\('fsdp', embed='hidden'"),
        (lambda: strategy("fsdp", embed="h", mlp="h"), AxisRenameError,
         r"your name 'h' is given for both 'embed' and 'mlp'"),
        (lambda: strategy("fsdp", embed="h", mlp=("ffn", "h")), AxisRenameError,
         r"'h' is given for both"),
        (lambda: strategy("zero1+tp", optimizer="opt"), AxisRenameError,
         r"strategy\('zero1\+tp', optimizer='opt'\): 'optimizer' names no parameter dimension "
         r"\(it says which mesh axis splits the optimizer state\) and cannot be renamed"),
        (lambda: strategy("fsdp", embed=3), AxisRenameError, r"3 is not a logical axis name"),
        (lambda: strategy("fsdp", embed=""), AxisRenameError, r"'' is not a logical axis name"),
        (lambda: strategy("fsdp", embed=("a", None)), AxisRenameError,
         r"None is not a logical axis name"),
        (lambda: strategy("fsdp", embed=()), AxisRenameError, r"no name is not a logical axis"),
        (lambda: strategy("zero3", embed="hidden"), UnknownPresetError,
         r"unknown strategy 'zero3'; strategies that exist: dp, fsdp"),
    ],
)  # fmt: skip
def test_builder_errors(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, PartitionRulesError)


def test_a_typo_in_a_rule_shows_in_the_compiled_program():
    # "upp" matches nothing, so the catch-all silently replicates the up projections: the rule
    # is reported. The catch-all itself matched parameters, so it is not.
    typo = r"blocks/\d+/upp/kernel"
    table = [(r.pattern, r.axes) for r in RULES]
    assert table[2][0] == r"blocks/\d+/up/kernel"
    table[2] = (typo, ("hidden", "ffn"))
    program = _compile("dp_tp", "data=4,tensor=2", plain_loss, Rules([*table, (r".*", None)]))
    assert program.unused_rules == [{"index": 2, "pattern": typo, "reason": "matched no parameter"}]
    assert _by_path(program.param_shardings)["blocks/0/up/kernel"].spec == P(None, None)
    extra = program.report().extra
    assert extra == {"rules that matched no parameter (check the regex)": f"rule 2 {typo!r}"}

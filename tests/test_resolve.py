"""Binding rules to a mesh: resolve/place/explain results, every error kind, and a tiling property."""

import functools
import io
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from partition_rules import AxisMap, Rules, direct_rules, preset
from sharding import (
    DuplicateMeshAxisError,
    IndivisibleDimensionError,
    MeshSpec,
    MeshSpecError,
    RankMismatchError,
    RuleError,
    UnknownLogicalAxisError,
    UnknownMeshAxisError,
    UnmatchedParameterError,
    explain,
    make_mesh,
    place,
    resolve,
    shard_abstract,
)

SPEC = MeshSpec(data=2, fsdp=2, tensor=2)
SIZES = {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}


def names_all(*parts: str) -> str:
    """A regex that matches a message containing every part, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(p)})" for p in parts)


def sds(*shape: int, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@functools.cache
def mesh_222():
    return make_mesh("data=2,fsdp=2,tensor=2")


def _explain_on_spec(rules, axis_map, tree):
    return explain(rules, axis_map, tree, SPEC)


def _resolve_on_mesh(rules, axis_map, tree):
    return resolve(rules, axis_map, tree, mesh_222())


# Every error test runs through both entry points: explain on a MeshSpec and resolve on a Mesh.
ENTRY_POINTS = pytest.mark.parametrize(
    "place", [_explain_on_spec, _resolve_on_mesh], ids=["explain", "resolve"]
)


# --- a small logical table and its placement ------------------------------------------------------

TREE = {
    "embed": {"embedding": sds(16, 8)},
    "layers": {
        "attn": {"q": {"kernel": sds(2, 8, 4, 2)}},
        "mlp": {"kernel": sds(2, 8, 6)},
        "norm": {"scale": sds(2, 8)},
    },
    "final_norm": {"scale": sds(8)},
    "lm_head": {"kernel": sds(8, 16)},
}

RULES = Rules(
    [
        (r"embed/embedding", ("vocab", "embed")),  # 0
        (r"layers/attn/q/kernel", ("layers", "embed", "heads", "head_dim")),  # 1
        (r"layers/attn/.*", ("layers", "embed", "heads", "head_dim")),  # 2: shadowed by 1
        (r"layers/mlp/kernel", ("layers", "wide", "mlp")),  # 3
        (r"layers/.*/scale", ("layers", "norm")),  # 4
        (r"lm_head/kernel", ("embed", "vocab")),  # 5
        (r"encoder/.*", None),  # 6: matches nothing
        (r".*", None),  # 7: catch-all
    ]
)

AXIS_MAP = AxisMap(
    {
        "vocab": "tensor",
        "embed": "fsdp",
        "heads": "tensor",
        "head_dim": None,
        "layers": None,
        "norm": None,
        "wide": ("data", "fsdp"),
        "mlp": "tensor",
    }
)

# path -> (rule index, spec, per-device shape), in tree (sorted key) order.
EXPECTED = {
    "embed/embedding": (0, ("tensor", "fsdp"), (8, 4)),
    "final_norm/scale": (7, (None,), (8,)),
    "layers/attn/q/kernel": (1, (None, "fsdp", "tensor", None), (2, 4, 2, 2)),
    "layers/mlp/kernel": (3, (None, ("data", "fsdp"), "tensor"), (2, 2, 3)),
    "layers/norm/scale": (4, (None, None), (2, 8)),
    "lm_head/kernel": (5, ("fsdp", "tensor"), (4, 8)),
}


def test_explain_rows():
    ex = explain(RULES, AXIS_MAP, TREE, SPEC, title="toy")
    assert ex.mesh == SIZES
    assert [r.path for r in ex.rows] == list(EXPECTED)
    for row in ex.rows:
        index, spec, local = EXPECTED[row.path]
        assert row.rule_index == index
        assert row.pattern == RULES[index].pattern
        assert row.logical == RULES[index].axes
        assert row.spec == spec
        assert row.partition_spec() == P(*spec)
        assert row.per_device_shape == local
        assert row.dtype == "float32"
        assert row.bytes_per_device == 4 * math.prod(local)
        assert row.bytes_total == 4 * math.prod(row.shape)


def test_explain_totals():
    totals = explain(RULES, AXIS_MAP, TREE, SPEC).totals
    # Per-device elements: 32 + 8 + 32 + 12 + 16 + 32 = 132; all elements: 504.
    assert totals["parameters"] == 504
    assert totals["param_bytes"] == 504 * 4
    assert totals["param_bytes_per_device"] == 132 * 4
    assert totals["grad_bytes_per_device"] == 132 * 4
    assert totals["adam_bytes_per_device"] == 2 * 4 * 132
    assert totals["state_bytes_per_device"] == 132 * 4 * 2 + 2 * 4 * 132
    assert totals["devices"] == 8
    assert totals["replication"] == pytest.approx(132 * 8 / 504, abs=1e-4)


def test_adam_state_is_float32_whatever_the_param_dtype():
    tree = {"w": sds(8, 8, dtype=jnp.bfloat16)}
    rules, axis_map = direct_rules([("w", ("fsdp", "tensor"))])
    ex = explain(rules, axis_map, tree, SPEC)
    assert ex.rows[0].dtype == "bfloat16"
    assert ex.rows[0].bytes_per_device == 16 * 2
    assert ex.totals["param_bytes_per_device"] == 32
    assert ex.totals["adam_bytes_per_device"] == 16 * 2 * 4


def test_unused_rules():
    ex = explain(RULES, AXIS_MAP, TREE, SPEC)
    assert ex.unused_rules == [
        {"index": 2, "pattern": "layers/attn/.*", "reason": "shadowed by rule 1"},
        {"index": 6, "pattern": "encoder/.*", "reason": "matched no parameter"},
    ]


def test_unused_rules_after_catch_all():
    rules = Rules([(r".*", None), (r"w", ("fsdp",)), (r"nothing", None)])
    ex = explain(rules, AxisMap.identity(), {"w": sds(4)}, SPEC)
    assert ex.unused_rules == [
        {"index": 1, "pattern": "w", "reason": "shadowed by rule 0"},
        {"index": 2, "pattern": "nothing", "reason": "matched no parameter"},
    ]


def test_to_dict_is_json_serialisable():
    ex = explain(RULES, AXIS_MAP, TREE, SPEC, title="toy")
    d = json.loads(json.dumps(ex.to_dict()))
    assert d["title"] == "toy"
    assert d["mesh"] == SIZES
    assert [p["path"] for p in d["parameters"]] == list(EXPECTED)
    mlp = d["parameters"][3]
    assert mlp["spec"] == [None, ["data", "fsdp"], "tensor"]
    assert mlp["per_device_shape"] == [2, 2, 3]
    assert mlp["logical"] == ["layers", "wide", "mlp"]
    assert d["parameters"][1]["logical"] is None
    assert d["totals"] == ex.totals
    assert d["unused_rules"] == ex.unused_rules
    assert json.loads(ex.to_json()) == d


def test_rich_rendering_names_every_path():
    ex = explain(RULES, AXIS_MAP, TREE, SPEC, title="toy")
    buf = io.StringIO()
    Console(file=buf, width=200).print(ex)
    out = buf.getvalue()
    for path in EXPECTED:
        assert path in out
    assert "stage=1,data=2,fsdp=2,expert=1,context=1,tensor=2" in out
    assert "shadowed by rule 1" in out
    assert "matched no parameter" in out


def test_resolve_named_shardings():
    mesh = mesh_222()
    shardings = resolve(RULES, AXIS_MAP, TREE, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(TREE)
    flat = dict(
        ("/".join(k.key for k in path), s)
        for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]
    )
    assert list(flat) == list(EXPECTED)
    for path, s in flat.items():
        _, spec, local = EXPECTED[path]
        assert isinstance(s, NamedSharding)
        assert s.mesh == mesh
        ndim = len(spec)
        assert s.is_equivalent_to(NamedSharding(mesh, P(*spec)), ndim)
        shape = next(leaf.shape for p, leaf in _leaves(TREE) if p == path)
        assert s.shard_shape(shape) == local


def _leaves(tree):
    return [
        ("/".join(k.key for k in path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def test_resolve_places_real_arrays():
    shardings = resolve(RULES, AXIS_MAP, TREE, mesh_222())
    ex = explain(RULES, AXIS_MAP, TREE, SPEC)
    arrays = jax.tree.map(
        lambda a, s: jax.device_put(np.zeros(a.shape, a.dtype), s), TREE, shardings
    )
    for (path, arr), row in zip(_leaves(arrays), ex.rows, strict=True):
        assert path == row.path
        assert len(arr.addressable_shards) == 8
        assert {s.data.shape for s in arr.addressable_shards} == {row.per_device_shape}


def test_shard_abstract():
    shardings = resolve(RULES, AXIS_MAP, TREE, mesh_222())
    out = shard_abstract(TREE, shardings)
    for (_, a), (_, b), (_, s) in zip(_leaves(TREE), _leaves(out), _leaves(shardings), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert b.sharding == s


def test_resolve_rejects_mesh_spec():
    with pytest.raises(TypeError, match=names_all("make_mesh", "explain")):
        resolve(RULES, AXIS_MAP, TREE, SPEC)


def test_explain_rejects_unresolved_spec():
    with pytest.raises(MeshSpecError, match=re.escape("fsdp=-1")):
        explain(RULES, AXIS_MAP, TREE, MeshSpec(fsdp=-1))


def test_plan_on_mesh_and_spec_agree():
    a = place(RULES, AXIS_MAP, TREE, SPEC)
    b = place(RULES, AXIS_MAP, TREE, mesh_222())
    assert a.sizes == b.sizes == SIZES
    assert a.placements == b.placements
    assert a.unused_rules == b.unused_rules


# --- catch-all and size-1 axes ----------------------------------------------------------------


def test_catch_all_replicates_any_rank():
    tree = {f"r{n}": sds(*([3] * n)) for n in range(5)}
    rules = Rules([(r".*", None)])
    ex = explain(rules, AxisMap.identity(), tree, SPEC)
    for row in ex.rows:
        assert row.per_device_shape == row.shape
        assert row.spec == (None,) * len(row.shape)
        assert row.logical is None
    assert ex.totals["replication"] == 8
    for s in jax.tree.leaves(resolve(rules, AxisMap.identity(), tree, mesh_222())):
        assert s.is_fully_replicated


LLAMA_TREE = {
    "embed": {"embedding": sds(7, 6)},
    "layers": {
        "attn_norm": {"scale": sds(2, 6)},
        "mlp_norm": {"scale": sds(2, 6)},
        "attn": {
            "q": {"kernel": sds(2, 6, 3, 2)},
            "k": {"kernel": sds(2, 6, 1, 2)},
            "v": {"kernel": sds(2, 6, 1, 2)},
            "o": {"kernel": sds(2, 3, 2, 6)},
        },
        "mlp": {
            "gate": {"kernel": sds(2, 6, 9)},
            "up": {"kernel": sds(2, 6, 9)},
            "down": {"kernel": sds(2, 9, 6)},
        },
    },
    "final_norm": {"scale": sds(6)},
    "lm_head": {"kernel": sds(6, 7)},
}


@pytest.mark.parametrize("strategy_name", ["fsdp_tp", "pp_tp", "tp", "pp_fsdp"])
def test_size_one_axes_always_allowed(strategy_name):
    # 3 heads, 1 kv head, mlp 9, vocab 7: nothing divides by 2, but on data=8 every axis the
    # preset uses (stage, fsdp, tensor) has size 1.
    rules, axis_map = preset("llama", strategy_name)
    ex = explain(rules, axis_map, LLAMA_TREE, MeshSpec(data=8))
    assert len(ex.rows) == 12
    assert ex.unused_rules == []
    for row in ex.rows:
        assert row.per_device_shape == row.shape
    lm_head = next(r for r in ex.rows if r.path == "lm_head/kernel")
    assert lm_head.spec == (
        "fsdp" if "fsdp" in strategy_name else None,
        "tensor" if "tp" in strategy_name else None,
    )
    for s in jax.tree.leaves(resolve(rules, axis_map, LLAMA_TREE, make_mesh("data=8"))):
        assert s.is_fully_replicated


def test_same_preset_indivisible_when_tensor_is_two():
    with pytest.raises(
        IndivisibleDimensionError,
        match=names_all(
            "cannot place 9 of 12 parameters",
            "layers/attn/q/kernel shape=(2, 6, 3, 2)",
            "dim 2 ('heads') has size 3, not divisible by tensor=2",
            "layers/attn/k/kernel shape=(2, 6, 1, 2)",
            "dim 2 ('kv_heads') has size 1",
            "layers/mlp/down/kernel shape=(2, 9, 6)",
            "dim 1 ('mlp') has size 9",
            "embed/embedding shape=(7, 6)",
            "lm_head/kernel shape=(6, 7)",
        ),
    ) as excinfo:
        explain(*preset("llama", "fsdp_tp"), LLAMA_TREE, SPEC)
    assert len(excinfo.value.problems) == 9


# --- each error kind ---------------------------------------------------------------------------


@ENTRY_POINTS
def test_unmatched_lists_every_path(place):
    tree = {
        "encoder": {"kernel": sds(4, 8)},
        "decoder": {"kernel": sds(8, 4), "bias": sds(3)},
        "step": sds(),
    }
    rules = Rules([(r"encoder/kernel", ("embed", "mlp"))])
    axis_map = AxisMap({"embed": "fsdp", "mlp": "tensor"})
    with pytest.raises(
        UnmatchedParameterError,
        match=names_all(
            "cannot place 3 of 4 parameters on mesh stage=1,data=2,fsdp=2,expert=1,context=1,tensor=2",
            "decoder/bias shape=(3,)",
            "decoder/kernel shape=(8, 4)",
            "step shape=()",
            "Rule(r'.*', None)",
        ),
    ) as excinfo:
        place(rules, axis_map, tree)
    problems = excinfo.value.problems
    assert [p.path for p in problems] == ["decoder/bias", "decoder/kernel", "step"]
    assert {p.kind for p in problems} == {UnmatchedParameterError}
    assert "encoder/kernel" not in str(excinfo.value)


@ENTRY_POINTS
def test_indivisible_names_dim_size_axes_and_divisors(place):
    tree = {"w": sds(6, 6), "ok": sds(8, 4)}
    rules, axis_map = direct_rules([("w", (None, ("fsdp", "tensor"))), ("ok", ("data", "tensor"))])
    with pytest.raises(
        IndivisibleDimensionError,
        match=names_all(
            "cannot place 1 of 2 parameters",
            "w shape=(6, 6) (rule 0 'w')",
            "dim 1",
            "has size 6",
            "fsdp=2xtensor=2 (product 4)",
            "split sizes that divide it: [1, 2, 3, 6]",
            "fix:",
        ),
    ) as excinfo:
        place(rules, axis_map, tree)
    assert [(p.kind, p.path) for p in excinfo.value.problems] == [(IndivisibleDimensionError, "w")]


@ENTRY_POINTS
def test_indivisible_logical_names_logical_axis(place):
    tree = {"attn": {"q": sds(8, 3, 4)}}
    rules = Rules([(r"attn/q", ("embed", "heads", "head_dim"))])
    axis_map = AxisMap({"embed": "fsdp", "heads": "tensor", "head_dim": None})
    with pytest.raises(
        IndivisibleDimensionError,
        match=names_all(
            "attn/q shape=(8, 3, 4)",
            "dim 1 ('heads') has size 3, not divisible by tensor=2 (product 2)",
        ),
    ):
        place(rules, axis_map, tree)


@ENTRY_POINTS
def test_unknown_logical_axis(place):
    tree = {"attn": {"q": sds(8, 4)}}
    rules = Rules([(r"attn/q", ("embed", "hedas"))])
    axis_map = AxisMap({"embed": "fsdp", "heads": "tensor"})
    with pytest.raises(
        UnknownLogicalAxisError,
        match=names_all("attn/q shape=(8, 4)", "rule 0 'attn/q'", "dim 1", "'hedas'", "fix:"),
    ) as excinfo:
        place(rules, axis_map, tree)
    assert [p.kind for p in excinfo.value.problems] == [UnknownLogicalAxisError]


@ENTRY_POINTS
def test_unknown_mesh_axis_direct(place):
    tree = {"w": sds(8, 4)}
    rules, axis_map = direct_rules([("w", ("fsdp", "tensr"))])
    with pytest.raises(
        UnknownMeshAxisError,
        match=names_all(
            "w shape=(8, 4)",
            "dim 1",
            "mesh axis 'tensr'",
            "stage=1, data=2, fsdp=2, expert=1, context=1, tensor=2",
        ),
    ):
        place(rules, axis_map, tree)


def test_unknown_mesh_axis_user_mesh_without_stage():
    user_mesh = jax.make_mesh(
        (2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    tree = {"layers": {"mlp": {"down": {"kernel": sds(4, 8, 8)}}}}
    with pytest.raises(
        UnknownMeshAxisError,
        match=names_all(
            "mesh data=2,tensor=4",
            "layers/mlp/down/kernel shape=(4, 8, 8)",
            "dim 0 ('layers') maps to mesh axis 'stage'",
            "mesh axes are data=2, tensor=4",
        ),
    ):
        resolve(*preset("llama", "pp_tp"), tree, user_mesh)


@ENTRY_POINTS
def test_duplicate_mesh_axis(place):
    tree = {"w": sds(8, 8)}
    rules = Rules([("w", ("embed", "heads"))])
    axis_map = AxisMap({"embed": "tensor", "heads": "tensor"})
    with pytest.raises(
        DuplicateMeshAxisError,
        match=names_all(
            "w shape=(8, 8)",
            "mesh axis 'tensor' splits dim 0 and dim 1",
            "'embed' and 'heads'",
        ),
    ):
        place(rules, axis_map, tree)


@ENTRY_POINTS
def test_duplicate_mesh_axis_through_tuple(place):
    # batch -> (data, fsdp) and embed -> fsdp collide on fsdp.
    tree = {"x": sds(8, 8)}
    rules = Rules([("x", ("batch", "embed"))])
    axis_map = AxisMap({"batch": ("data", "fsdp"), "embed": "fsdp"})
    with pytest.raises(
        DuplicateMeshAxisError, match=names_all("x shape=(8, 8)", "'fsdp' splits dim 0 and dim 1")
    ):
        place(rules, axis_map, tree)


@ENTRY_POINTS
def test_rank_mismatch(place):
    tree = {"mlp": {"kernel": sds(2, 4, 4)}}
    rules = Rules([(r"mlp/kernel", ("embed", "mlp"))])
    axis_map = AxisMap({"embed": "fsdp", "mlp": "tensor"})
    with pytest.raises(
        RankMismatchError,
        match=names_all(
            "mlp/kernel shape=(2, 4, 4)",
            "rule 0 'mlp/kernel'",
            "2 axes ('embed', 'mlp')",
            "rank-3",
        ),
    ):
        place(rules, axis_map, tree)


@ENTRY_POINTS
def test_mixed_problems_raise_base_error_with_all_sections(place):
    tree = {"a": sds(6, 5), "b": sds(2, 4, 4), "c": sds(4, 4), "d": sds(3, 3, 3)}
    rules, axis_map = direct_rules(
        [
            ("a", ("fsdp", "tensor")),  # dim 1 (5) indivisible
            ("b", ("fsdp", "tensor")),  # rank 2 for rank 3
            ("c", ("data", "tensor")),  # fine
            ("d", ("data", None)),  # rank 2 for rank 3
        ]
    )
    with pytest.raises(
        RuleError,
        match=names_all(
            "cannot place 3 of 4 parameters",
            "IndivisibleDimensionError (",
            "RankMismatchError (",
            "a shape=(6, 5)",
            "has size 5",
            "b shape=(2, 4, 4)",
            "d shape=(3, 3, 3)",
        ),
    ) as excinfo:
        place(rules, axis_map, tree)
    err = excinfo.value
    assert type(err) is RuleError
    assert [(p.kind, p.path) for p in err.problems] == [
        (IndivisibleDimensionError, "a"),
        (RankMismatchError, "b"),
        (RankMismatchError, "d"),
    ]
    assert str(err).count("fix:") == 2


@ENTRY_POINTS
def test_every_problem_of_one_parameter_is_reported(place):
    # One parameter, three problems: an unknown logical axis, a duplicate and an indivisible dim.
    tree = {"w": sds(3, 8, 8)}
    rules = Rules([("w", ("heads", "embed", ("mlp", "nope")))])
    axis_map = AxisMap({"heads": "tensor", "embed": "tensor", "mlp": "fsdp"})
    with pytest.raises(RuleError) as excinfo:
        place(rules, axis_map, tree)
    kinds = {p.kind for p in excinfo.value.problems}
    assert kinds == {IndivisibleDimensionError, DuplicateMeshAxisError, UnknownLogicalAxisError}
    assert type(excinfo.value) is RuleError
    assert "cannot place 1 of 1 parameters" in str(excinfo.value)


def test_error_kinds_are_rule_errors():
    for cls in (
        UnmatchedParameterError,
        RankMismatchError,
        UnknownLogicalAxisError,
        UnknownMeshAxisError,
        DuplicateMeshAxisError,
        IndivisibleDimensionError,
    ):
        assert issubclass(cls, RuleError)
        assert issubclass(cls, ValueError)


# --- property: placements tile exactly, or a typed error ---------------------------------------

MESH_AXES = ("stage", "data", "fsdp", "tensor")
DIMS = (1, 2, 3, 4, 6, 8, 12, 16)
AXIS_SUBSETS = st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=3, unique=True).map(tuple)


@st.composite
def cases(draw):
    """1-3 parameters, each with its own rule, written directly or through logical names."""
    logical = draw(st.booleans())
    unknown_kind = UnknownLogicalAxisError if logical else UnknownMeshAxisError
    params = []
    rule_rows = []
    mapping = {}
    for i in range(draw(st.integers(1, 3))):
        path = f"p{i}"
        shape = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=4)))
        mesh_entries = [draw(st.none() | AXIS_SUBSETS) for _ in shape]
        unknown_dim = None
        mutation = draw(st.sampled_from(["none"] * 6 + ["rank", "unknown"]))
        if mutation == "rank":
            if mesh_entries and draw(st.booleans()):
                mesh_entries.pop()
            else:
                mesh_entries.append(draw(st.none() | AXIS_SUBSETS))
        elif mutation == "unknown" and shape:
            unknown_dim = draw(st.integers(0, len(shape) - 1))
        entries = []
        for d, axes in enumerate(mesh_entries):
            bogus = "nope" if logical else "tensr"
            if not logical:
                entry = axes
                if d == unknown_dim:
                    entry = (*(axes or ()), bogus)
            else:
                name = f"{path}_d{d}"
                if axes is not None and len(axes) > 1 and draw(st.booleans()):
                    # Split over two logical names, each carrying part of the mesh axes.
                    mapping[name + "a"], mapping[name + "b"] = axes[:1], axes[1:]
                    entry = (name + "a", name + "b")
                else:
                    mapping[name] = axes
                    entry = name
                if d == unknown_dim:
                    entry = (*((entry,) if isinstance(entry, str) else entry), bogus)
            entries.append(entry)
        params.append((path, shape, mesh_entries, unknown_dim))
        rule_rows.append((path, tuple(entries)))
    axis_map = AxisMap(mapping) if logical else AxisMap.identity()
    return params, Rules(rule_rows), axis_map, unknown_kind, draw(st.booleans())


def _expected_kinds(shape, mesh_entries, unknown_dim, unknown_kind):
    """(kinds that must be reported, kinds that may be) for one parameter."""
    if len(mesh_entries) != len(shape):
        return {RankMismatchError}, {RankMismatchError}
    must, may = set(), set()
    if unknown_dim is not None:
        must.add(unknown_kind)
        # What else is checked in a dimension that names an unknown axis is left open.
        may |= {unknown_kind, DuplicateMeshAxisError, IndivisibleDimensionError}
    seen_clean, seen_any = set(), set()
    for d, axes in enumerate(mesh_entries):
        axes = set(axes or ())
        if d != unknown_dim:
            if shape[d] % math.prod(SIZES[a] for a in axes):
                must.add(IndivisibleDimensionError)
            if seen_clean & axes:
                must.add(DuplicateMeshAxisError)
            seen_clean |= axes
        if seen_any & axes:
            may.add(DuplicateMeshAxisError)
        seen_any |= axes
    return must, may | must


@settings(deadline=None, max_examples=200, database=None)
@given(cases())
def test_placement_tiles_exactly_or_raises_typed_error(case):
    params, rules, axis_map, unknown_kind, check_devices = case
    tree = {path: sds(*shape) for path, shape, _, _ in params}
    must, may, bad_paths = set(), set(), set()
    for path, shape, mesh_entries, unknown_dim in params:
        m, y = _expected_kinds(shape, mesh_entries, unknown_dim, unknown_kind)
        must |= m
        may |= y
        if m:
            bad_paths.add(path)

    try:
        ex = explain(rules, axis_map, tree, SPEC)
    except RuleError as err:
        kinds = {p.kind for p in err.problems}
        event("raised " + " + ".join(sorted(k.__name__ for k in kinds)))
        assert must <= kinds <= may, (must, kinds, may)
        assert bad_paths <= {p.path for p in err.problems}
        assert type(err) is (next(iter(kinds)) if len(kinds) == 1 else RuleError)
        for kind in kinds:
            assert f"{kind.__name__} (" in str(err)
        for p in err.problems:
            assert f"{p.path} shape={tree[p.path].shape}" in str(err)
        # resolve on a real mesh reports the same thing.
        with pytest.raises(type(err)) as again:
            resolve(rules, axis_map, tree, mesh_222())
        assert str(again.value) == str(err)
        return

    assert not must, f"expected {must} for {params}"
    event("placed")
    assert [r.path for r in ex.rows] == sorted(tree)
    shardings = resolve(rules, axis_map, tree, mesh_222())
    for row, (path, shape, mesh_entries, _) in zip(
        ex.rows, sorted(params, key=lambda p: p[0]), strict=True
    ):
        assert row.path == path
        assert row.shape == shape
        for d, axes in enumerate(mesh_entries):
            axes = axes or ()
            assert row.per_device_shape[d] * math.prod(SIZES[a] for a in axes) == shape[d]
            assert row.spec[d] == (None if not axes else axes[0] if len(axes) == 1 else axes)
        assert row.bytes_per_device == 4 * math.prod(row.per_device_shape)
        sharding = shardings[path]
        assert sharding.shard_shape(shape) == row.per_device_shape
        if check_devices:
            arr = jax.device_put(np.zeros(shape, np.float32), sharding)
            assert {s.data.shape for s in arr.addressable_shards} == {row.per_device_shape}

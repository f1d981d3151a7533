"""Rule tables, axis maps, strategies and presets: pure data, no devices."""

import re

import pytest
from jax.sharding import PartitionSpec as P

from partition_rules import (
    FAMILY_RULES,
    STRATEGIES,
    AxisMap,
    Rule,
    RuleConflictError,
    Rules,
    direct_rules,
    family_rules,
    preset,
    strategy,
)
from partition_rules.strategies import LOGICAL_AXES, PIPELINE_STRATEGIES


def names_all(*parts: str) -> str:
    """A regex that matches a message containing every part, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(p)})" for p in parts)


# --- Rule and Rules ----------------------------------------------------------------------------


def test_first_match_wins():
    rules = Rules(
        [
            (r"layers/attn/q/kernel", ("layers", "embed", "heads")),
            (r"layers/attn/.*/kernel", ("layers", "embed", "kv_heads")),
            (r".*", None),
        ]
    )
    index, rule = rules.match("layers/attn/q/kernel")
    assert index == 0
    assert rule.axes == ("layers", "embed", "heads")
    assert rules.match("layers/attn/k/kernel")[0] == 1
    assert rules.match("final_norm/scale")[0] == 2
    assert rules.match("final_norm/scale")[1].axes is None


def test_fullmatch_semantics():
    rule = Rule(r"attn/q/kernel", ("embed", "heads"))
    assert rule.matches("attn/q/kernel")
    assert not rule.matches("layers/attn/q/kernel")
    assert not rule.matches("attn/q/kernel/extra")
    assert not rule.matches("attn/q/kern")
    rules = Rules([rule])
    assert rules.match("layers/attn/q/kernel") is None
    # An alternation is matched as a whole, not per branch.
    assert Rule(r"a|b/c", None).matches("b/c")
    assert not Rule(r"a|b/c", None).matches("a/c")


def test_no_match_is_none():
    assert Rules([("x", None)]).match("y") is None
    assert Rules().match("anything") is None


def test_rules_accept_rule_objects_and_pairs():
    a = Rules([Rule("x", ("embed",)), ("y", ["vocab", None])])
    assert len(a) == 2
    assert a[1] == Rule("y", ("vocab", None))
    assert [r.pattern for r in a] == ["x", "y"]


def test_rule_normalises_entries():
    rule = Rule("x", [("data",), ["data", "fsdp"], None, "tensor"])
    assert rule.axes == ("data", ("data", "fsdp"), None, "tensor")
    assert list(rule.names()) == ["data", "data", "fsdp", "tensor"]
    assert list(Rule("x", None).names()) == []


def test_rules_add_precedence():
    a = Rules([("layers/.*", ("layers", None)), ("shared", ("embed",))])
    b = Rules([("layers/mlp", ("layers", "mlp")), ("shared", ("embed",)), (".*", None)])
    combined = a + b
    assert [r.pattern for r in combined] == ["layers/.*", "shared", "layers/mlp", ".*"]
    assert combined.match("layers/mlp")[1].axes == ("layers", None)
    assert (b + a).match("layers/mlp")[1].axes == ("layers", "mlp")
    assert combined.match("other")[0] == 3


def test_rules_add_conflict_names_pattern_and_both_axes():
    a = Rules([("layers/attn/q/kernel", ("embed", "heads")), ("ok", None)])
    b = Rules([("ok", None), ("layers/attn/q/kernel", ("embed", "kv_heads"))])
    with pytest.raises(
        RuleConflictError,
        match=names_all("'layers/attn/q/kernel'", "('embed', 'heads')", "('embed', 'kv_heads')"),
    ) as excinfo:
        a + b
    assert "'ok'" not in str(excinfo.value)


def test_rules_add_lists_every_conflict():
    a = Rules([("p1", ("a",)), ("p2", ("b",))])
    b = Rules([("p1", ("c",)), ("p2", None)])
    with pytest.raises(RuleConflictError, match=names_all("'p1'", "'p2'")):
        a + b


def test_invalid_regex_names_pattern():
    with pytest.raises(ValueError, match=names_all("'layers/(attn'", "not a valid regex")):
        Rule("layers/(attn", ("layers",))
    with pytest.raises(ValueError, match=re.escape("'[unclosed'")):
        Rules([("[unclosed", None)])


@pytest.mark.parametrize("axes", ["embed", 3, {"embed": 1}])
def test_axes_not_a_tuple_is_type_error(axes):
    with pytest.raises(TypeError, match=names_all("'my/kernel'", repr(axes))):
        Rule("my/kernel", axes)


@pytest.mark.parametrize("entry", [3, ("data", 4), {"data"}, b"data"])
def test_bad_axis_entry_is_type_error(entry):
    with pytest.raises(TypeError, match=names_all("'my/kernel'", repr(entry))):
        Rule("my/kernel", ("embed", entry))


def test_rule_catch_all_any_rank():
    rule = Rule(r".*", None)
    assert rule.axes is None
    assert rule.matches("")
    assert rule.matches("a/b/c")


# --- AxisMap -----------------------------------------------------------------------------------


def test_axis_map_merge():
    merged = AxisMap({"embed": "fsdp"}) | AxisMap({"heads": "tensor", "embed": "fsdp"})
    assert dict(merged) == {"embed": "fsdp", "heads": "tensor"}
    assert merged == AxisMap({"heads": "tensor", "embed": "fsdp"})


def test_axis_map_merge_conflict_names_axis_and_both_targets():
    with pytest.raises(
        RuleConflictError, match=names_all("'embed'", "'fsdp'", "'tensor'")
    ) as excinfo:
        AxisMap({"embed": "fsdp", "vocab": None}) | AxisMap({"embed": "tensor", "vocab": None})
    assert "'vocab'" not in str(excinfo.value)


def test_axis_map_merge_conflict_tuple_vs_none():
    with pytest.raises(RuleConflictError, match=names_all("'batch'", "('data', 'fsdp')", "None")):
        AxisMap({"batch": ("data", "fsdp")}) | AxisMap({"batch": None})


def test_axis_map_identity():
    ident = AxisMap.identity()
    assert ident["tensor"] == "tensor"
    assert "anything" in ident
    assert ident.mesh_axes("fsdp") == ("fsdp",)
    assert ident.mesh_axes(("data", "fsdp")) == ("data", "fsdp")
    assert ident.mesh_axes(None) == ()
    with pytest.raises(RuleConflictError, match="identity"):
        ident | AxisMap({"embed": "fsdp"})
    with pytest.raises(RuleConflictError, match="identity"):
        AxisMap({"embed": "fsdp"}) | ident


def test_axis_map_mesh_axes():
    m = AxisMap(
        {"batch": ("data", "fsdp"), "embed": "fsdp", "heads": ["tensor"], "norm": None, "x": ()}
    )
    assert m["heads"] == "tensor"  # 1-tuples are normalised to the name
    assert m.mesh_axes("embed") == ("fsdp",)
    assert m.mesh_axes("batch") == ("data", "fsdp")
    assert m.mesh_axes("norm") == ()
    assert m.mesh_axes("x") == ()
    assert m.mesh_axes(None) == ()
    assert m.mesh_axes(("embed", "heads")) == ("fsdp", "tensor")
    assert m.mesh_axes(("norm", "heads")) == ("tensor",)
    assert "embed" in m
    assert "vocab" not in m


def test_axis_map_bad_entry_is_type_error():
    with pytest.raises(TypeError, match=names_all("'embed'", "3")):
        AxisMap({"embed": 3})


def test_axis_map_replace_overrides_without_conflict():
    m = AxisMap({"embed": "fsdp"}).replace(embed="tensor", vocab=None)
    assert dict(m) == {"embed": "tensor", "vocab": None}


# --- direct rules ------------------------------------------------------------------------------


def test_direct_rules_with_tuples():
    rules, axis_map = direct_rules([(r".*kernel", ("fsdp", ("data", "tensor"))), (r".*", None)])
    assert axis_map == AxisMap.identity()
    assert rules.match("a/kernel")[1].axes == ("fsdp", ("data", "tensor"))
    assert [axis_map.mesh_axes(e) for e in rules[0].axes] == [("fsdp",), ("data", "tensor")]


def test_direct_rules_accept_partition_spec():
    # Rules written as regex -> PartitionSpec (big_vision / MaxText style) are documented as
    # accepted as they are.
    rules, axis_map = direct_rules([(r".*kernel", P("fsdp", ("data", "tensor"), None))])
    assert rules[0].axes == ("fsdp", ("data", "tensor"), None)
    assert Rule(r".*bias", P("tensor")).axes == ("tensor",)
    assert axis_map.mesh_axes(rules[0].axes[1]) == ("data", "tensor")


# --- strategies and presets ----------------------------------------------------------------------

TP_STRATEGIES = ("tp", "fsdp_tp", "dp_tp", "pp_tp", "tp_sp", "fsdp_tp_sp", "cp_tp_sp", "ep_tp",
                 "pp_tp_sp")  # fmt: skip
# Where each strategy puts the sequence of the stack's activations (None: whole on every device).
SEQUENCE = {"tp_sp": "tensor", "fsdp_tp_sp": "tensor", "cp": "context", "fsdp_cp": "context",
            "cp_tp_sp": ("context", "tensor"), "pp_cp": "context", "pp_tp_sp": "tensor"}  # fmt: skip
SEQUENCE_BASE = {"tp_sp": "tp", "fsdp_tp_sp": "fsdp_tp", "cp": "dp", "fsdp_cp": "fsdp",
                 "cp_tp_sp": "tp", "pp_cp": "pp", "pp_tp_sp": "pp_tp"}  # fmt: skip


def test_strategy_names():
    assert set(STRATEGIES) == {"dp", "fsdp", "tp", "fsdp_tp", "dp_tp", "pp", "pp_tp", "pp_fsdp",
                               "tp_sp", "fsdp_tp_sp", "cp", "fsdp_cp", "cp_tp_sp", "ep", "fsdp_ep",
                               "ep_tp", "pp_cp", "pp_tp_sp", "pp_ep"}  # fmt: skip
    assert {"pp", "pp_tp", "pp_fsdp", "pp_cp", "pp_tp_sp", "pp_ep"} == PIPELINE_STRATEGIES


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_sequence_axis(name):
    # "sequence" names no parameter dimension: only the step compiler reads it, for activations.
    assert "sequence" in LOGICAL_AXES
    assert STRATEGIES[name]["sequence"] == SEQUENCE.get(name)
    if name in SEQUENCE:
        base = SEQUENCE_BASE[name]
        # Apart from the sequence, sp/cp place parameters exactly as their base strategy does.
        others = {k: v for k, v in STRATEGIES[name].items() if k != "sequence"}
        assert others == {k: v for k, v in STRATEGIES[base].items() if k != "sequence"}


def test_sequence_keeps_its_name_when_the_parameter_axes_are_renamed():
    m = strategy("cp", embed="hidden")
    assert m["sequence"] == "context" and m["hidden"] is None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_maps_every_logical_axis(name):
    m = STRATEGIES[name]
    assert set(m) == set(LOGICAL_AXES)
    for axis in LOGICAL_AXES:
        assert axis in m
        for mesh_axis in m.mesh_axes(axis):
            assert mesh_axis in ("stage", "data", "fsdp", "expert", "context", "tensor")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_batch_and_layers(name):
    m = STRATEGIES[name]
    # Strategies place parameters; the batch axes are the step compiler's, one for all strategies.
    from sharding import BATCH_AXES

    assert "batch" not in m
    assert BATCH_AXES == ("data", "fsdp", "expert")
    if name.startswith("pp"):
        assert m["layers"] == "stage"
    else:
        assert m["layers"] is None
    # Norm scales are sharded under ZeRO-3 (fsdp) and replicated otherwise.
    assert m["norm"] == ("fsdp" if "fsdp" in name else None)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_tensor_axes(name):
    m = STRATEGIES[name]
    for axis in ("vocab", "heads", "mlp"):
        assert m[axis] == ("tensor" if name in TP_STRATEGIES else None)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_fsdp_axes(name):
    m = STRATEGIES[name]
    assert m["embed"] == ("fsdp" if "fsdp" in name else None)


def test_strategy_lookup():
    assert strategy("fsdp_tp") == STRATEGIES["fsdp_tp"] == strategy("tp+fsdp")
    with pytest.raises(
        ValueError, match=names_all("'nope'", ", ".join(STRATEGIES), "strategies that exist")
    ):
        strategy("nope")


@pytest.mark.parametrize("family", sorted(FAMILY_RULES))
def test_preset(family):
    rules, axis_map = preset(family, "fsdp_tp")
    assert rules is FAMILY_RULES[family]
    assert axis_map == STRATEGIES["fsdp_tp"]


def test_preset_unknown_strategy_lists_strategies():
    with pytest.raises(ValueError, match=names_all("'nope'", *STRATEGIES)):
        preset("llama", "nope")


def test_preset_unknown_family_lists_families():
    with pytest.raises(ValueError, match=names_all("'nope'", "cnn, gpt2, llama, llama-moe, mlp")):
        preset("nope", "dp")
    with pytest.raises(ValueError, match=names_all("'nope'", "cnn, gpt2, llama, llama-moe, mlp")):
        family_rules("nope")


@pytest.mark.parametrize("family", sorted(FAMILY_RULES))
def test_family_rules_use_only_logical_axes(family):
    rules = family_rules(family)
    assert len(rules) > 0
    for rule in rules:
        for name in rule.names():
            assert name in LOGICAL_AXES, f"{family} rule {rule.pattern!r} uses {name!r}"


@pytest.mark.parametrize("family", sorted(FAMILY_RULES))
def test_family_patterns_are_distinct(family):
    patterns = [r.pattern for r in family_rules(family)]
    assert len(patterns) == len(set(patterns))


def test_llama_preset_lm_head():
    rules, axis_map = preset("llama", "fsdp_tp")
    _, rule = rules.match("lm_head/kernel")
    assert [axis_map.mesh_axes(e) for e in rule.axes] == [("fsdp",), ("tensor",)]
    _, rule = rules.match("layers/attn/q/kernel")
    assert [axis_map.mesh_axes(e) for e in rule.axes] == [(), ("fsdp",), ("tensor",), ()]
    rules, axis_map = preset("llama", "pp_tp")
    assert axis_map.mesh_axes(rules.match("layers/mlp/down/kernel")[1].axes[0]) == ("stage",)


def test_doc_examples(doctests):
    import partition_rules

    assert doctests(partition_rules) > 5

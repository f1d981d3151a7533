"""MeshSpec parsing and validation, make_mesh layout, simulate_cpu_devices."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import sharding
from sharding import (
    AXES,
    MalformedMeshSpecError,
    MeshSizeMismatchError,
    MeshSpec,
    MeshSpecError,
    MultipleFillAxesError,
    UnknownMeshAxisNameError,
    make_mesh,
    mesh_sizes,
)


def names_all(*parts: str) -> str:
    """A regex that matches a message containing every part, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(p)})" for p in parts)


# --- parsing and canonical form ------------------------------------------------------------------


def test_parse_matches_keyword_construction():
    spec = MeshSpec.parse("data=2,fsdp=-1,tensor=2,stage=1")
    assert spec == MeshSpec(data=2, fsdp=-1, tensor=2, stage=1)
    assert spec == MeshSpec(data=2, fsdp=-1, tensor=2)
    assert (spec.stage, spec.data, spec.fsdp, spec.tensor) == (1, 2, -1, 2)


def test_parse_allows_spaces():
    assert MeshSpec.parse(" data = 2 , tensor=4 ") == MeshSpec(data=2, tensor=4)


@pytest.mark.parametrize(
    "text",
    [
        "data=2,fsdp=-1,tensor=2,stage=1",
        "stage=1,tensor=2,fsdp=-1,data=2",
        "tensor=2,data=2,fsdp=-1",
        "fsdp=-1,stage=1,data=2,tensor=2",
    ],
)
def test_canonical_order_regardless_of_written_order(text):
    spec = MeshSpec.parse(text)
    assert list(spec.sizes) == ["stage", "data", "fsdp", "expert", "context", "tensor"]
    assert list(spec.sizes) == list(AXES)
    assert spec.sizes == {"stage": 1, "data": 2, "fsdp": -1, "expert": 1, "context": 1, "tensor": 2}
    assert str(spec) == "data=2,fsdp=-1,tensor=2"


@pytest.mark.parametrize(
    "spec",
    [
        MeshSpec(),
        MeshSpec(data=8),
        MeshSpec(stage=2, data=2, fsdp=1, tensor=2),
        MeshSpec(fsdp=-1, tensor=4),
        MeshSpec(stage=-1),
        MeshSpec(stage=3, data=5, fsdp=7, tensor=11),
    ],
)
def test_str_round_trip(spec):
    assert MeshSpec.parse(str(spec)) == spec


def test_str_of_all_ones_is_parseable():
    assert str(MeshSpec()) == "data=1"
    assert MeshSpec.parse("data=1") == MeshSpec()


def test_str_orders_axes_canonically():
    assert str(MeshSpec.parse("tensor=2,stage=2,data=2")) == "stage=2,data=2,tensor=2"


def test_resolve_fills_minus_one():
    spec = MeshSpec.parse("data=2,fsdp=-1,tensor=2,stage=1")
    resolved = spec.resolve(8)
    assert resolved == MeshSpec(data=2, fsdp=2, tensor=2)
    assert resolved.sizes == {
        "stage": 1,
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
        "tensor": 2,
    }
    assert resolved.size == 8
    assert spec.fsdp == -1  # resolve returns a new spec


@pytest.mark.parametrize(
    ("text", "n", "expected"),
    [
        ("stage=-1", 8, {"stage": 8, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}),
        (
            "tensor=-1,data=4",
            8,
            {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2},
        ),
        (
            "data=8,fsdp=-1",
            8,
            {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1},
        ),
        (
            "stage=2,data=-1,tensor=4",
            64,
            {"stage": 2, "data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4},
        ),
    ],
)
def test_resolve_fill_sizes(text, n, expected):
    assert MeshSpec.parse(text).resolve(n).sizes == expected


def test_resolve_without_fill_is_identity_when_sizes_match():
    spec = MeshSpec(data=2, fsdp=2, tensor=2)
    assert spec.resolve(8) == spec


def test_size_of_unresolved_spec_raises():
    with pytest.raises(MeshSpecError, match=re.escape("data=-1")):
        _ = MeshSpec(data=-1).size


def test_mesh_sizes_of_spec_and_mesh():
    assert mesh_sizes(MeshSpec(fsdp=4, tensor=2)) == {
        "stage": 1,
        "data": 1,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "tensor": 2,
    }
    with pytest.raises(MeshSpecError, match=re.escape("fsdp=-1")):
        mesh_sizes(MeshSpec(fsdp=-1))


def test_of_accepts_none_str_dict_and_spec():
    spec = MeshSpec(data=2, tensor=4)
    assert MeshSpec.of(None) == MeshSpec(data=-1)
    assert MeshSpec.of(None).resolve(8).sizes == {
        "stage": 1,
        "data": 8,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }
    assert MeshSpec.of("tensor=4,data=2") == spec
    assert MeshSpec.of({"tensor": 4, "data": 2}) == spec
    assert MeshSpec.of(spec) is spec


def test_of_dict_with_unknown_axis():
    with pytest.raises(UnknownMeshAxisNameError, match=names_all("'model'", "stage, data, fsdp")):
        MeshSpec.of({"data": 2, "model": 4})


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        ("data=2,tensor=2", "data=-1,tensor=2"),
        ("data=3", "data=-1"),
        ("data=16", "data=-1"),
        ("stage=2,data=3,tensor=2", "stage=2,data=-1,tensor=2"),
    ],
)
def test_size_mismatch_names_spec_device_count_and_fix(text, suggestion):
    spec = MeshSpec.parse(text)
    with pytest.raises(
        MeshSizeMismatchError,
        match=names_all(f"mesh spec {spec}", "8 are available", f"e.g. '{suggestion}'"),
    ):
        spec.resolve(8)
    # The suggested fix is itself a spec that fits.
    assert MeshSpec.parse(suggestion).resolve(8).size == 8


def test_make_mesh_size_mismatch():
    with pytest.raises(MeshSizeMismatchError, match=names_all("data=2,tensor=2", "8")):
        make_mesh("data=2,tensor=2")


@pytest.mark.parametrize(("text", "fixed"), [("data=3,fsdp=-1", 3), ("data=16,tensor=-1", 16)])
def test_fill_axis_that_cannot_be_filled(text, fixed):
    with pytest.raises(
        MeshSizeMismatchError,
        match=names_all(text, f"multiply to {fixed}", "does not divide 8", "=-1 cannot be filled"),
    ):
        MeshSpec.parse(text).resolve(8)


def test_two_fill_axes_parse():
    with pytest.raises(MultipleFillAxesError, match=names_all("data, tensor", "got 2")):
        MeshSpec.parse("tensor=-1,data=-1")


def test_two_fill_axes_keyword():
    with pytest.raises(MultipleFillAxesError, match=names_all("stage, fsdp", "at most one")):
        MeshSpec(stage=-1, fsdp=-1)


def test_three_fill_axes():
    with pytest.raises(MultipleFillAxesError, match=re.escape("got 3 (data, fsdp, tensor)")):
        MeshSpec.parse("data=-1,fsdp=-1,tensor=-1")


def test_unknown_axis_name():
    with pytest.raises(
        UnknownMeshAxisNameError,
        match=names_all(
            "'data=2,model=4'", "'model'", "stage, data, fsdp, expert, context, tensor"
        ),
    ):
        MeshSpec.parse("data=2,model=4")


@pytest.mark.parametrize(
    ("text", "offending"),
    [
        ("data:2", "'data:2'"),
        ("data=two", "'data=two'"),
        ("data=2,,tensor=4", "''"),
        ("data=2,", "''"),
        ("data=2.5", "'data=2.5'"),
        ("=2", "'=2'"),
    ],
)
def test_malformed_items(text, offending):
    with pytest.raises(
        MalformedMeshSpecError, match=names_all(f"mesh spec {text!r}", f"cannot read {offending}")
    ):
        MeshSpec.parse(text)


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_spec(text):
    with pytest.raises(MalformedMeshSpecError, match=names_all(repr(text), "empty")):
        MeshSpec.parse(text)


def test_axis_given_twice():
    with pytest.raises(
        MalformedMeshSpecError, match=names_all("'data=2,data=4'", "'data'", "data=2", "data=4")
    ):
        MeshSpec.parse("data=2,data=4")


@pytest.mark.parametrize(
    ("text", "bad"),
    [("data=0", "data=0"), ("tensor=4,data=-2", "data=-2"), ("stage=-3", "stage=-3")],
)
def test_zero_or_negative_sizes_parse(text, bad):
    with pytest.raises(MalformedMeshSpecError, match=names_all(bad, "positive integers or -1")):
        MeshSpec.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"tensor": 0}, "tensor=0"),
        ({"data": -2}, "data=-2"),
        ({"fsdp": 2.0}, "fsdp=2.0"),
        ({"data": "2"}, "data='2'"),
    ],
)
def test_bad_sizes_keyword(kwargs, bad):
    with pytest.raises(MalformedMeshSpecError, match=names_all(bad, "positive integers or -1")):
        MeshSpec(**kwargs)


def test_mesh_spec_errors_are_value_errors():
    for cls in (
        MalformedMeshSpecError,
        MeshSizeMismatchError,
        MultipleFillAxesError,
        UnknownMeshAxisNameError,
    ):
        assert issubclass(cls, MeshSpecError)
        assert issubclass(cls, ValueError)


# --- make_mesh ---------------------------------------------------------------------------------


def _ids(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def test_make_mesh_layout():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == {
        "stage": 1,
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
        "tensor": 2,
    }
    assert mesh.devices.shape == (1, 2, 2, 1, 1, 2)
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 6
    ids = _ids(mesh)[:, :, :, 0, 0, :]  # expert and context have size 1
    assert sorted(ids.ravel().tolist()) == list(range(8))
    # tensor innermost: devices along `tensor` are neighbours.
    assert ids[0, 0, 0, 1] - ids[0, 0, 0, 0] == 1
    for d in range(2):
        for f in range(2):
            assert np.all(np.diff(ids[0, d, f, :]) == 1)


def test_make_mesh_written_order_does_not_matter():
    a = make_mesh("tensor=2,fsdp=2,data=2")
    b = make_mesh("data=2,fsdp=2,tensor=2")
    assert a.axis_names == b.axis_names
    assert np.array_equal(_ids(a), _ids(b))


def test_make_mesh_default_is_all_data():
    mesh = make_mesh()
    assert dict(mesh.shape) == {
        "stage": 1,
        "data": 8,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 6


def test_make_mesh_with_fill_and_dict():
    assert dict(make_mesh("stage=2,tensor=-1").shape) == {
        "stage": 2,
        "data": 1,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 4,
    }
    assert dict(make_mesh({"fsdp": 4, "data": 2}).shape) == {
        "stage": 1,
        "data": 2,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }


def test_make_mesh_on_device_subset():
    devices = jax.devices()[:4]
    mesh = make_mesh("data=2,tensor=-1", devices=devices)
    assert dict(mesh.shape) == {
        "stage": 1,
        "data": 2,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 2,
    }
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 6
    assert set(mesh.devices.ravel().tolist()) == set(devices)
    with pytest.raises(MeshSizeMismatchError, match=names_all("data=8", "4 are available")):
        make_mesh("data=8", devices=devices)


# --- simulate_cpu_devices ----------------------------------------------------------------------


def test_simulate_cpu_devices_after_init_same_count_is_noop():
    jax.devices()  # make sure the backend is up, so this test can never change the device count
    sharding.simulate_cpu_devices(8)
    assert jax.device_count() == 8
    assert jax.default_backend() == "cpu"


def test_simulate_cpu_devices_after_init_other_count_raises():
    jax.devices()
    with pytest.raises(
        RuntimeError,
        match=names_all("simulate_cpu_devices(4)", "already initialised", "with 8 cpu device"),
    ):
        sharding.simulate_cpu_devices(4)
    assert jax.device_count() == 8


def test_simulate_cpu_devices_before_init_in_fresh_process():
    code = (
        "import sharding\n"
        "sharding.simulate_cpu_devices(4)\n"
        "import jax\n"
        "print(jax.device_count(), jax.default_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "cpu"]

"""Targets: the shipped device profiles, target parsing, TOML profiles, and meshes laid on nodes.

Topology facts are hand-derived from the device order `make_mesh` uses: ids row-major over
(stage, data, fsdp, expert, context, tensor), node k holding ids k * per_node .. (k + 1) * per_node - 1.
"""

from __future__ import annotations

import json

import pytest

from sharding.inspection import device_peak
from sharding.targets import (
    PROFILES,
    DeviceSpec,
    MalformedTargetError,
    TargetError,
    TargetProfileError,
    TargetSizeError,
    TopologyError,
    UnknownTargetError,
    capped_h100_peaks,
    load_profile,
    target,
)

GIB = 2**30
KINDS = {"h100": "H100", "h200": "H200", "b200": "B200", "a100": "A100",
         "v5e": "TPU v5 lite", "v5p": "TPU v5p", "v6e": "TPU v6 lite"}  # fmt: skip


@pytest.mark.parametrize("name", list(KINDS))
def test_shipped_profiles_take_the_peak_table_and_cite_a_source(name):
    spec = PROFILES[name]
    assert spec.peak("bfloat16") == device_peak(KINDS[name], "bfloat16")
    assert spec.peak("float32") == device_peak(KINDS[name], "float32")
    assert spec.source
    assert spec.intra_bw > spec.inter_bw > 0
    assert 0 < spec.matmul_fraction <= 1 and 0 < spec.link_fraction <= 1


def test_datasheet_figures():
    h100, v5e = PROFILES["h100"], PROFILES["v5e"]
    assert (h100.peak_bf16, h100.peak_f32) == (989.4e12, 494.7e12)
    assert (h100.hbm_bytes, h100.hbm_bw) == (80 * GIB, 3.35e12)
    assert (h100.intra_bw, h100.inter_bw, h100.devices_per_node) == (450e9, 50e9, 8)
    assert PROFILES["a100"].inter_bw == 25e9  # 200 Gb/s HDR per GPU
    assert v5e.peak_f32 == v5e.peak_bf16 == 197e12  # float32 runs one bf16 pass on TPU
    assert (v5e.hbm_bytes, v5e.devices_per_node, v5e.default_devices) == (16 * GIB, 256, 8)


def test_a_power_capped_h100_interpolates_between_two_datasheets():
    """torchtitan's H100 96GB HBM2e at 500 W: the peak between the NVL's 400 W and the SXM5's
    700 W points; a cap outside them is refused."""
    assert capped_h100_peaks(700) == {"bfloat16": 989.4e12, "float32": 494.7e12}
    assert capped_h100_peaks(400) == {"bfloat16": 835.5e12, "float32": 417.5e12}
    spec = PROFILES["h100-96gb-500w"]
    assert spec.peak_bf16 == pytest.approx(835.5e12 + (989.4e12 - 835.5e12) / 3)
    assert (spec.hbm_bytes, spec.hbm_bw, spec.inter_bw) == (96 * GIB, 2.4e12, 50e9)
    assert "500 W" in spec.source and target("h100-96gb-500w:16x8").devices == 128
    with pytest.raises(TargetError, match=r"watts=300: an H100's cap interpolates between 400"):
        capped_h100_peaks(300)


@pytest.mark.parametrize(
    ("text", "name", "nodes", "per_node"),
    [
        ("h100:2x8", "h100:2x8", 2, 8),
        ("h100", "h100:1x8", 1, 8),
        ("h100:4", "h100:1x4", 1, 4),
        (" H100-SXM:2x8 ", "h100:2x8", 2, 8),
        ("v5e", "v5e:1x8", 1, 8),
        ("v5e:64", "v5e:1x64", 1, 64),
        ("v5p:2x256", "v5p:2x256", 2, 256),
        ("trillium:4x256", "v6e:4x256", 4, 256),
    ],
)
def test_target_forms(text, name, nodes, per_node):
    t = target(text)
    assert (t.name, t.nodes, t.per_node, t.devices) == (name, nodes, per_node, nodes * per_node)
    assert target(t) is t


def test_describe_is_one_line_and_to_dict_is_json():
    t = target("h100:2x8")
    line = t.describe()
    assert "\n" not in line
    assert line.startswith("h100:2x8: 16 x h100 on 2 nodes of 8; 989.4 TFLOP/s bf16")
    assert "NVLink 450 GB/s within a node, InfiniBand 50 GB/s between nodes" in line
    data = json.loads(json.dumps(t.to_dict()))
    assert (data["devices"], data["nodes"], data["per_node"]) == (16, 2, 8)
    assert data["device"]["hbm_bytes"] == 80 * GIB


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        ("h10", UnknownTargetError, r"unknown target 'h10' \(did you mean 'h100'\?\); known "
                                    r"devices: h100, h200, b200, a100, h100-96gb-500w, v5e, "
                                    r"v5p, v6e"),
        ("mi300x:8", UnknownTargetError, r"unknown target 'mi300x'.*\.toml device profile"),
        ("h100:16", TargetSizeError, r"16 devices do not fit one h100 node \(8 per node\); "
                                     r"write the nodes out, e.g. 'h100:2x8'"),
        ("h100:12", TargetSizeError, r"e.g. 'h100:NODESx8'"),
        ("h100:2x16", TargetSizeError, r"holds at most 8 devices, not 16; write e.g. 'h100:4x8'"),
        ("h100:0", TargetSizeError, r"counts must be at least 1"),
        ("h100:0x8", TargetSizeError, r"counts must be at least 1"),
        ("h100:two", MalformedTargetError, r"cannot read the size 'two'; write NAME, NAME:COUNT"),
        ("h100:2x", MalformedTargetError, r"cannot read the size '2x'"),
        ("", MalformedTargetError, r"target '': write NAME"),
        (8, MalformedTargetError, r"target 8: write NAME"),
    ],
)  # fmt: skip
def test_bad_targets_are_refused(text, error, match):
    with pytest.raises(error, match=match):
        target(text)
    assert issubclass(error, TargetError)


def test_toml_profile_round_trip(tmp_path):
    for spec in PROFILES.values():
        path = tmp_path / f"{spec.name}.toml"
        path.write_text(spec.to_toml())
        assert load_profile(path) == spec
    t = target(f"{tmp_path / 'v5p.toml'}:2x8")
    assert (t.device, t.nodes, t.per_node) == (PROFILES["v5p"], 2, 8)
    assert t.name == f"{tmp_path / 'v5p.toml'}:2x8"


MINIMAL = """
peak_tflops_bf16 = 400
peak_tflops_f32 = 200
hbm_gib = 64
hbm_gb_per_s = 2000
devices_per_node = 4
intra_node_gb_per_s = 100
intra_node_latency_us = 3
inter_node_gb_per_s = 25
inter_node_latency_us = 8
"""


def test_minimal_toml_profile_takes_the_stated_defaults(tmp_path):
    path = tmp_path / "lab-gpu.toml"
    path.write_text(MINIMAL)
    t = target(str(path))
    d = t.device
    assert (t.nodes, t.per_node) == (1, 4)  # default_devices = devices_per_node
    assert d == DeviceSpec(name="lab-gpu", peak_bf16=400e12, peak_f32=200e12,
                           hbm_bytes=64 * GIB, hbm_bw=2000e9, devices_per_node=4,
                           intra_bw=100e9, intra_latency=3e-6, inter_bw=25e9,
                           inter_latency=8e-6, source=str(path))  # fmt: skip
    assert (d.matmul_fraction, d.hbm_fraction, d.link_fraction) == (0.6, 0.8, 0.8)
    assert target(f"{path}:3x4").devices == 12


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (MINIMAL.replace("hbm_gib = 64\n", ""), r"lacks hbm_gib; e.g. hbm_gib = 80"),
        (MINIMAL + "hbm_gb = 3\n", r"unknown keys 'hbm_gb' \(did you mean 'hbm_gib'\?\)"),
        (MINIMAL.replace("= 400", "= -400"),
         r"bad.toml': bad values: peak_tflops_bf16=-400 \(a positive number\)"),
        (MINIMAL + "matmul_fraction = 1.5\n", r"matmul_fraction=1.5 \(a fraction in \(0, 1\]\)"),
        (MINIMAL.replace("= 4\n", '= "four"\n'), r"devices_per_node='four' \(a positive integer"),
        (MINIMAL + "default_devices = 8\n", r"default_devices=8 exceeds devices_per_node=4"),
        ("peak_tflops_bf16 = = 3", r"is not valid TOML"),
    ],
)  # fmt: skip
def test_bad_toml_profiles_are_refused(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TargetProfileError, match=match):
        target(str(path))


def test_missing_toml_profile_is_refused(tmp_path):
    with pytest.raises(TargetProfileError, match=r"does not exist; write a TOML file with"):
        target(str(tmp_path / "nope.toml"))


def test_unknown_dtype_peak_is_refused():
    with pytest.raises(TargetError, match=r"no peak for dtype 'float16'; the profiles know"):
        PROFILES["h100"].peak("float16")


def test_tensor_inside_data_across_nodes():
    # data=2,tensor=8: device id = 8 * data + tensor, node = id // 8 = data.
    topo = target("h100:2x8").topology("data=2,tensor=8")
    tensor, data = topo.group("tensor"), topo.group(("data",))
    assert (tensor.size, tensor.nodes, tensor.link.name) == (8, 1, "NVLink")
    assert (data.size, data.nodes, data.link.name) == (2, 2, "InfiniBand")
    assert (data.link.bandwidth, data.link.latency) == (50e9, 5e-6)
    assert topo.group(("data", "tensor")).size == 16 and not topo.group("data").inside_node
    assert topo.warnings == []


def test_small_tensor_group_stays_inside_a_node():
    # tensor=2,data=8: id = 2 * data + tensor; a tensor pair {2k, 2k+1} shares node k // 4,
    # a data group {t, t+2, ..., t+14} spans both nodes.
    topo = target("h100:2x8").topology("tensor=2,data=8")
    assert topo.group("tensor").inside_node and topo.group("tensor").size == 2
    assert topo.group("data").nodes == 2 and topo.group("data").size == 8
    assert topo.warnings == []


def test_tensor_and_fsdp_across_nodes_are_flagged():
    topo = target("h100:2x8").topology("tensor=16")
    assert topo.group("tensor").nodes == 2
    (warning,) = topo.warnings
    assert warning.startswith("tensor=16 spans 2 nodes: tensor-parallel collectives run inside")
    # its rings leave each node over 8 NICs: 400 GB/s, but 8.33x NVLink's latency per hop
    assert (
        "InfiniBand over 8 rails at 400 GB/s instead of NVLink at 450 GB/s per direction, "
        "8.33x the latency per hop" in warning
    )
    # h100:4x4 with data=2,fsdp=2,tensor=4: id = 8 data + 4 fsdp + tensor, node = id // 4, so
    # an fsdp pair {t, t+4} spans 2 nodes while a tensor group fills one.
    topo = target("h100:4x4").topology("data=2,fsdp=2,tensor=4")
    assert topo.group("tensor").inside_node and topo.group("fsdp").nodes == 2
    (warning,) = topo.warnings
    assert warning.startswith("fsdp=2 spans 2 nodes: every layer's weights are gathered")
    assert "through InfiniBand at 50 GB/s instead of NVLink" in warning  # one NIC: no rails
    assert target("h100:2x8").topology("data=2,fsdp=8").warnings == []  # HSDP: fsdp in a node


def test_stage_outermost_crosses_nodes_and_fill_axis_resolves():
    topo = target("h100:2x8").topology("stage=2,tensor=-1")
    assert topo.sizes == {"stage": 2, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 8}
    assert topo.group("stage").nodes == 2 and topo.group("tensor").inside_node
    assert topo.group(()).size == 1 and topo.group(()).inside_node
    data = json.loads(json.dumps(topo.to_dict()))
    assert data["groups"] == {"stage": {"size": 2, "nodes": 2, "link": "InfiniBand"},
                              "tensor": {"size": 8, "nodes": 1, "link": "NVLink"}}  # fmt: skip


def test_tpu_slices_keep_ici_inside_the_pod():
    topo = target("v5e:2x256").topology("data=2,fsdp=256")
    assert topo.group("fsdp").link.name == "ICI" and topo.group("data").link.name == "DCN"


def test_bad_meshes_are_refused():
    t = target("h100:2x8")
    with pytest.raises(TopologyError, match=r"on target h100:2x8 \(16 devices\): .*multiplies "
                                             r"to 8 devices but 16 are available"):  # fmt: skip
        t.topology("data=8")
    with pytest.raises(TopologyError, match=r"unknown axis 'model'"):
        t.topology({"model": 16})
    with pytest.raises(TopologyError, match=r"collective axes \('model',\): unknown axis"):
        t.topology("data=16").group("model")

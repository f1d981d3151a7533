"""What one accelerator can do, for pricing a training step on it: `DeviceSpec` and the profiles.

A `DeviceSpec` holds datasheet figures in SI units (FLOP/s, bytes, bytes/s, seconds) plus the
achievable fractions the step-time model (`sharding.costmodel.step_time`) applies to them. The
shipped `PROFILES` cite their sources next to each figure; a user profile is a TOML file
(`load_profile` lists its keys), every figure in the unit its key names.
"""

from __future__ import annotations

import difflib
import json
import math
import pathlib
import tomllib
from dataclasses import asdict, dataclass, fields
from typing import Any

from sharding._errors import SpmdkitError
from sharding.inspection import device_peak

# Defaults of the achievable fractions, each printed with the step times it produces beside its
# grounds (`DEFAULT_SOURCES`). Matmuls: clocks drop under power limits, and smaller per-device
# shapes, attention's kernels (priced at this rate) and kernel launches pull a step's average
# below what large GEMMs sustain. Links: XLA's ICI collectives land in NCCL's range too.
MATMUL_FRACTION = 0.6
HBM_FRACTION = 0.8
LINK_FRACTION = 0.8
DEFAULT_SOURCES = {
    "matmul_fraction": "spmdkit's default: large bf16 GEMMs sustain 65-75% of the dense peak, and "
    "MaxText and torchtitan report 40-60% MFU for Llama-class models; not yet calibrated on a "
    "GPU (python -m benchmarks.calibrate measures it)",
    "hbm_fraction": "spmdkit's default: streaming kernels reach 80-90% of the datasheet bandwidth",
    "link_fraction": "spmdkit's default: NCCL's bus bandwidth reaches about 80% of NVLink's "
    "per-direction figure and 85-90% of a 400 Gb/s NIC's",
}

GIB = 2**30
# What XLA's compiler for each platform does to a step that the step-time model prices.
# "sinks_accumulated_all_reduces": the collective-optimisation pipeline runs
# WhileLoopAllReduceCodeMotion after SPMD partitioning (xla/service/gpu/gpu_compiler.cc), which
# moves an all-reduce whose result is only added into a loop-carried buffer out of the loop:
# gradient accumulation's data-parallel all-reduces run once, after the micro-step loop, where
# no compute is left to hide them. Its reduce-scatters (fsdp; ReduceScatterCreator, earlier in
# the same pipeline, makes them from an all-reduce and its slice) move only under
# xla_gpu_enable_while_loop_reduce_scatter_code_motion, off by default and not set by spmdkit,
# so they stay in the loop, each hidden behind its micro-step's backward. XLA:CPU does not sink
# them (measured: dp's all-reduce k-fold over k micro-steps), nor is it documented for TPU, which
# keeps the count the program shows.
PLATFORMS: dict[str, dict[str, bool]] = {
    "gpu": {"sinks_accumulated_all_reduces": True},
    "tpu": {"sinks_accumulated_all_reduces": False},
}


class TargetError(SpmdkitError):
    """A target, device profile or topology that cannot be used as given."""


class TargetProfileError(TargetError):
    """A TOML device profile that cannot be read: missing, malformed, or a bad value."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peaks, memory, links, and the fractions of them a step achieves.

    Units: FLOP/s, bytes, bytes/s (per direction per device for links) and seconds (per hop).

    Example:
        >>> spec = PROFILES["h100"]
        >>> spec.peak("bfloat16") / 1e12, spec.hbm_bytes // 2**30, spec.devices_per_node
        (989.4, 80, 8)
    """

    name: str
    peak_bf16: float
    peak_f32: float
    hbm_bytes: int
    hbm_bw: float
    devices_per_node: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    intra_link: str = "intra-node link"
    inter_link: str = "inter-node link"
    default_devices: int | None = None  # devices `target(name)` means; None: devices_per_node
    matmul_fraction: float = MATMUL_FRACTION
    hbm_fraction: float = HBM_FRACTION
    link_fraction: float = LINK_FRACTION
    source: str = ""
    op_latency: float = 0.0  # seconds every collective op costs before its first hop
    platform: str = "gpu"  # whose XLA compiles for it: "gpu" or "tpu" (see `PLATFORMS`)

    def __post_init__(self) -> None:
        _check_values(self.name, {f.name: getattr(self, f.name) for f in fields(self)})
        if self.default_devices is None:
            object.__setattr__(self, "default_devices", self.devices_per_node)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of a matmul in ``dtype`` ("bfloat16" or "float32")."""
        peaks = {"bfloat16": self.peak_bf16, "float32": self.peak_f32}
        if dtype not in peaks:
            raise TargetError(
                f"{self.name}: no peak for dtype {dtype!r}; the profiles know 'bfloat16' and "
                f"'float32' (write compute dtype bfloat16 or float32)"
            )
        return peaks[dtype]

    def source_of(self, fraction: str) -> str:
        """Where a fraction (``"matmul_fraction"``, ``"hbm_fraction"``, ``"link_fraction"``)
        comes from: spmdkit's default and its grounds, or this profile's source."""
        default = {"matmul_fraction": MATMUL_FRACTION, "hbm_fraction": HBM_FRACTION,
                   "link_fraction": LINK_FRACTION}[fraction]  # fmt: skip
        if getattr(self, fraction) == default:
            return DEFAULT_SOURCES[fraction]
        return f"the profile's: {self.source or self.name}"

    def describe(self) -> str:
        """One line with the figures a step time rests on."""
        return (
            f"{self.name}: {self.peak_bf16 / 1e12:g} TFLOP/s bf16 ({self.peak_f32 / 1e12:g} "
            f"float32), {self.hbm_bytes / GIB:g} GiB HBM at {self.hbm_bw / 1e9:g} GB/s; "
            f"{self.intra_link} {self.intra_bw / 1e9:g} GB/s within a node of "
            f"{self.devices_per_node}, {self.inter_link} {self.inter_bw / 1e9:g} GB/s between "
            f"nodes (per direction per device)"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_toml(self) -> str:
        """This profile as a TOML file that `load_profile` reads back equal."""
        values = {key: getter(self) for key, (_, getter) in _TOML.items()}
        lines = []
        for key, value in values.items():
            if isinstance(value, float):
                value = round(value, 9)  # 10.000000000000002 us reads back as 1e-05 s anyway
            text = json.dumps(value) if isinstance(value, str) else repr(value)
            lines.append(f"{key} = {text}")
        return "\n".join(lines) + "\n"


def _check_values(name: str, values: dict[str, Any]) -> None:
    """Positive figures and fractions in (0, 1]; raise naming every bad one.

    Keys are `DeviceSpec` fields or TOML keys alike: strings end in "link" (or are the name and
    source), fractions in "fraction", counts are integers, every other figure a positive number.
    """
    bad = []
    for key, value in values.items():
        if key == "platform":
            if not isinstance(value, str) or value not in PLATFORMS:
                bad.append(f"{key}={value!r} (one of {', '.join(map(repr, PLATFORMS))})")
            continue
        if key in ("name", "source") or key.endswith("link"):
            if not isinstance(value, str):
                bad.append(f"{key}={value!r} (a string)")
            continue
        if value is None and key == "default_devices":
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key.endswith("fraction"):
            if not number or not 0 < value <= 1:
                bad.append(f"{key}={value!r} (a fraction in (0, 1])")
        elif key in ("devices_per_node", "default_devices", "hbm_bytes"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad.append(f"{key}={value!r} (a positive integer)")
        elif key == "op_latency":
            if not number or not math.isfinite(value) or value < 0:
                bad.append(f"{key}={value!r} (a number of seconds >= 0)")
        elif not number or not math.isfinite(value) or value <= 0:
            bad.append(f"{key}={value!r} (a positive number)")
    if bad:
        raise TargetProfileError(f"device profile {name!r}: bad values: {'; '.join(bad)}")
    default = values.get("default_devices")
    if default is not None and default > values["devices_per_node"]:
        raise TargetProfileError(
            f"device profile {name!r}: default_devices={default} exceeds devices_per_node="
            f"{values['devices_per_node']}; a default target is one node"
        )


def _nvidia(name: str, kind: str, **figures: Any) -> DeviceSpec:
    """A DGX/HGX-style node of 8 GPUs; peaks from `sharding.inspection.PEAK_FLOPS`."""
    figures["source"] += "; latencies: NCCL's tuning model (src/graph/tuning.cc)"
    return DeviceSpec(
        name=name,
        peak_bf16=device_peak(kind, "bfloat16"),
        peak_f32=device_peak(kind, "float32"),
        devices_per_node=8,
        intra_link="NVLink",
        inter_link="InfiniBand",
        # NCCL's tuning model (src/graph/tuning.cc) for the small messages where latency matters:
        # a ring op starts at ~6.8 us (baseLat, LL protocol) and each step adds ~0.6 us over
        # NVLink (hwLat NVLINK LL) or ~5 us through the network (an RDMA hop, one switch tier).
        op_latency=6.8e-6,
        intra_latency=0.6e-6,
        inter_latency=5e-6,
        **figures,
    )


def _tpu(name: str, kind: str, **figures: Any) -> DeviceSpec:
    """A TPU slice: "node" is the ICI domain, data-centre network (DCN) between slices."""
    figures["source"] += "; latencies: orders of magnitude (an ICI hop ~1 us, DCN tens of us)"
    peak = device_peak(kind, "bfloat16")  # float32 runs one bf16 pass at DEFAULT precision
    return DeviceSpec(
        name=name,
        peak_bf16=peak,
        peak_f32=peak,
        intra_link="ICI",
        inter_link="DCN",
        platform="tpu",
        op_latency=2e-6,  # an XLA collective on ICI: a few microseconds to start (order of)
        intra_latency=1e-6,  # a neighbour hop on the torus: order of a microsecond
        inter_latency=10e-6,  # host NICs and the data-centre fabric: tens of microseconds
        **figures,
    )


# GPUs: dense peaks (no sparsity) from the vendors' datasheets, as in PEAK_FLOPS; NVLink
# per direction = half the datasheet's bidirectional total; InfiniBand per GPU = the DGX's one
# NIC per GPU. HBM capacities are GiB in practice (an "80 GB" H100 shows 81,559 MiB).
PROFILES: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989.4 TF bf16 / 494.7 TF TF32 dense,
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s; DGX H100: 8x ConnectX-7 400 Gb/s.
    "h100": _nvidia("h100", "H100", hbm_bytes=80 * GIB, hbm_bw=3.35e12, intra_bw=450e9,
                    inter_bw=50e9, source="NVIDIA H100 datasheet (SXM5); DGX H100 user guide"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): H100's compute, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s; HGX H200 with one 400 Gb/s NIC per GPU.
    "h200": _nvidia("h200", "H200", hbm_bytes=141 * GIB, hbm_bw=4.8e12, intra_bw=450e9,
                    inter_bw=50e9, source="NVIDIA H200 datasheet (SXM)"),
    # NVIDIA DGX B200 / HGX B200 datasheets: 2.25 PF bf16 dense per GPU, 180 GB HBM3e at 8 TB/s,
    # NVLink 5 1.8 TB/s; DGX B200: 8x ConnectX-7 400 Gb/s.
    "b200": _nvidia("b200", "B200", hbm_bytes=180 * GIB, hbm_bw=8e12, intra_bw=900e9,
                    inter_bw=50e9, source="NVIDIA DGX B200 datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 TF bf16 / 156 TF TF32 dense,
    # 2,039 GB/s HBM2e, NVLink 3 600 GB/s; DGX A100: 8x ConnectX-6 200 Gb/s (HDR).
    "a100": _nvidia("a100", "A100", hbm_bytes=80 * GIB, hbm_bw=2.039e12, intra_bw=300e9,
                    inter_bw=25e9, source="NVIDIA A100 datasheet (80GB SXM); DGX A100 user guide"),
    # TPUs (Cloud TPU system architecture pages). ICI per direction: a collective over one
    # torus axis runs a bidirectional ring over the chip's 2 links on that axis, so 2 x one
    # link's one-way bandwidth (the per-chip ICI total over its ports, halved for one way).
    # DCN per chip = the host's NICs over its chips. "Node" = the ICI domain (a slice).
    # Cloud TPU v5e: 197 TF bf16, 16 GiB HBM2 at 819 GB/s, 400 GB/s bidirectional ICI over 4
    # ports, 256-chip pods of 8-chip hosts with 2 x 100 Gb/s NICs.
    "v5e": _tpu("v5e", "TPU v5 lite", hbm_bytes=16 * GIB, hbm_bw=819e9, devices_per_node=256,
                default_devices=8, intra_bw=100e9, inter_bw=3.125e9,
                source="Cloud TPU v5e system architecture"),
    # Cloud TPU v5p: 459 TF bf16, 95 GiB HBM2e at 2,765 GB/s, 1,200 GB/s bidirectional ICI over
    # 6 ports (3D torus), 50 Gb/s DCN per chip, slices up to 6,144 chips, 4-chip hosts.
    "v5p": _tpu("v5p", "TPU v5p", hbm_bytes=95 * GIB, hbm_bw=2.765e12, devices_per_node=6144,
                default_devices=4, intra_bw=200e9, inter_bw=6.25e9,
                source="Cloud TPU v5p system architecture"),
    # Cloud TPU v6e (Trillium): 918 TF bf16, 32 GB HBM at 1,600 GB/s, 3,200 Gb/s ICI one way
    # over 4 ports, 256-chip pods of 8-chip hosts with 4 x 200 Gb/s NICs.
    "v6e": _tpu("v6e", "TPU v6 lite", hbm_bytes=32 * GIB, hbm_bw=1.6e12, devices_per_node=256,
                default_devices=8, intra_bw=200e9, inter_bw=12.5e9,
                source="Cloud TPU v6e system architecture"),
}  # fmt: skip

# Other spellings users write for the same devices.
ALIASES: dict[str, str] = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "a100-80gb": "a100",
    "a100-sxm": "a100",
    "tpu-v5e": "v5e",
    "v5litepod": "v5e",
    "tpu-v5p": "v5p",
    "tpu-v6e": "v6e",
    "trillium": "v6e",
}

# TOML key -> (how to turn its value into the DeviceSpec field, how to write the field back).
_TOML: dict[str, tuple[Any, Any]] = {
    "name": (lambda v: ("name", v), lambda s: s.name),
    "source": (lambda v: ("source", v), lambda s: s.source),
    "peak_tflops_bf16": (lambda v: ("peak_bf16", _scale(v, 1e12)), lambda s: s.peak_bf16 / 1e12),
    "peak_tflops_f32": (lambda v: ("peak_f32", _scale(v, 1e12)), lambda s: s.peak_f32 / 1e12),
    "hbm_gib": (lambda v: ("hbm_bytes", _scale(v, GIB, integer=True)), lambda s: s.hbm_bytes / GIB),
    "hbm_gb_per_s": (lambda v: ("hbm_bw", _scale(v, 1e9)), lambda s: s.hbm_bw / 1e9),
    "devices_per_node": (lambda v: ("devices_per_node", v), lambda s: s.devices_per_node),
    "default_devices": (lambda v: ("default_devices", v), lambda s: s.default_devices),
    "intra_node_link": (lambda v: ("intra_link", v), lambda s: s.intra_link),
    "intra_node_gb_per_s": (lambda v: ("intra_bw", _scale(v, 1e9)), lambda s: s.intra_bw / 1e9),
    "intra_node_latency_us": (lambda v: ("intra_latency", _scale(v, 1e-6)),
                              lambda s: s.intra_latency / 1e-6),
    "inter_node_link": (lambda v: ("inter_link", v), lambda s: s.inter_link),
    "inter_node_gb_per_s": (lambda v: ("inter_bw", _scale(v, 1e9)), lambda s: s.inter_bw / 1e9),
    "inter_node_latency_us": (lambda v: ("inter_latency", _scale(v, 1e-6)),
                              lambda s: s.inter_latency / 1e-6),
    "op_latency_us": (lambda v: ("op_latency", _scale(v, 1e-6)), lambda s: s.op_latency / 1e-6),
    "matmul_fraction": (lambda v: ("matmul_fraction", v), lambda s: s.matmul_fraction),
    "hbm_fraction": (lambda v: ("hbm_fraction", v), lambda s: s.hbm_fraction),
    "link_fraction": (lambda v: ("link_fraction", v), lambda s: s.link_fraction),
    "platform": (lambda v: ("platform", v), lambda s: s.platform),
}  # fmt: skip
_REQUIRED = ("peak_tflops_bf16", "peak_tflops_f32", "hbm_gib", "hbm_gb_per_s",
             "devices_per_node", "intra_node_gb_per_s", "intra_node_latency_us",
             "inter_node_gb_per_s", "inter_node_latency_us")  # fmt: skip


def _scale(value: Any, unit: float, *, integer: bool = False) -> Any:
    """A TOML figure in SI units; non-numbers pass through for `_check_values` to name.

    Rounded so that a profile written by `DeviceSpec.to_toml` reads back equal.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    scaled = value * unit
    return round(scaled) if integer or unit >= 1 else round(scaled, 15)


def load_profile(path: str | pathlib.Path) -> DeviceSpec:
    """Read a `DeviceSpec` from a TOML file, every figure in the unit its key names.

    TOML keys (required unless a default is given)::

        name = "my-h100"              # default: the file name without .toml
        source = "DGX H100 guide"     # where the figures come from; default: the file path
        peak_tflops_bf16 = 989.4      # dense (no sparsity) bfloat16 peak, 10^12 FLOP/s
        peak_tflops_f32 = 494.7       # float32 as XLA runs it by default (TF32 on NVIDIA)
        hbm_gib = 80                  # device memory, GiB (2^30 bytes)
        hbm_gb_per_s = 3350           # device memory bandwidth, GB/s (10^9 bytes/s)
        devices_per_node = 8          # devices one intra-node link (NVLink, ICI) connects
        default_devices = 8           # devices `target("name")` means; default devices_per_node
        intra_node_link = "NVLink"    # a name for messages; default "intra-node link"
        intra_node_gb_per_s = 450     # per direction per device, GB/s
        intra_node_latency_us = 0.6   # per hop of a ring, microseconds
        op_latency_us = 6.8           # to start any collective op, microseconds; default 0
        inter_node_link = "InfiniBand"  # default "inter-node link"
        inter_node_gb_per_s = 50      # per direction per device, GB/s
        inter_node_latency_us = 5     # per hop, microseconds
        matmul_fraction = 0.6         # achievable fraction of the peak; default 0.6
        hbm_fraction = 0.8            # achievable fraction of the HBM bandwidth; default 0.8
        link_fraction = 0.8           # achievable fraction of a link's bandwidth; default 0.8
        platform = "gpu"              # whose XLA compiles for it: "gpu" or "tpu"; default "gpu"

    Raises:
        TargetProfileError: the file is missing or not TOML, a required key is missing, a key
            is unknown (a typo would otherwise fall back to a default silently), or a value is
            not positive.

    Example:
        >>> spec = load_profile("cluster/h100-ib200.toml")  # doctest: +SKIP
    """
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TargetProfileError(
            f"device profile {str(path)!r} does not exist; write a TOML file with the keys "
            f"{', '.join(_REQUIRED)} (see load_profile's docstring), or name a shipped profile: "
            f"{', '.join(PROFILES)}"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TargetProfileError(f"device profile {str(path)!r} is not valid TOML: {err}") from None
    unknown = [k for k in data if k not in _TOML]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, _TOML, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TargetProfileError(
            f"device profile {str(path)!r}: unknown keys {', '.join(hints)}; the keys are "
            f"{', '.join(_TOML)}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise TargetProfileError(
            f"device profile {str(path)!r} lacks {', '.join(missing)}; e.g. "
            + ", ".join(f"{k} = {v}" for k, v in _example(missing))
        )
    _check_values(str(path), data)  # in the file's own keys and units
    values = {"name": path.name.removesuffix(".toml"), "source": str(path)}
    values.update(dict(_TOML[key][0](value) for key, value in data.items()))
    return DeviceSpec(**values)


def _example(keys: list[str]) -> list[tuple[str, Any]]:
    """Each key with the H100's value, as an example of what to write."""
    return [(k, round(_TOML[k][1](PROFILES["h100"]), 6)) for k in keys]


__all__ = [
    "ALIASES",
    "PLATFORMS",
    "PROFILES",
    "DeviceSpec",
    "TargetError",
    "TargetProfileError",
    "load_profile",
]

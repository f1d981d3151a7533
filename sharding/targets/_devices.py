"""What one accelerator can do, for pricing a training step on it: `DeviceSpec`, and reading a
user's profile.

A `DeviceSpec` holds datasheet figures in SI units (FLOP/s, bytes, bytes/s, seconds) plus the
achievable fractions the step-time model (`sharding.costmodel.step_time`) applies to them. The
shipped `PROFILES` (`sharding.targets._profiles`) cite their sources next to each figure; a user
profile is a TOML file (`load_profile` lists its keys), every figure in the unit its key names.
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
from sharding.targets._chips import CHIPS

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
# "reassociates_all_reduces": the same pipeline runs AllReduceReassociate, which rewrites
# add(all-reduce(a), all-reduce(b)) as all-reduce(add(a, b)): the partial input gradients of the
# column-parallel kernels that read one input (q, k and v; gate and up), each all-reduced by the
# partitioner before their sum as XLA:CPU shows, take one all-reduce per input on a GPU.
# "creates_reduce_scatters": and ReduceScatterCreator, which makes an all-reduce whose result is
# only sliced by partition a reduce-scatter (Megatron SP's row-parallel outputs; XLA:CPU keeps
# the pair). TPU: neither documented, so the program's collectives are priced as it shows them.
PLATFORMS: dict[str, dict[str, bool]] = {
    "gpu": {"sinks_accumulated_all_reduces": True, "reassociates_all_reduces": True,
            "creates_reduce_scatters": True},
    "tpu": {"sinks_accumulated_all_reduces": False, "reassociates_all_reduces": False,
            "creates_reduce_scatters": False},
}  # fmt: skip


class TargetError(SpmdkitError):
    """A target, device profile or topology that cannot be used as given."""


class TargetProfileError(TargetError):
    """A TOML device profile that cannot be read: missing, malformed, or a bad value."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peaks, memory, links, and the fractions of them a step achieves.

    Units: FLOP/s, bytes, bytes/s (per direction per device for links) and seconds (per hop).

    Example:
        >>> from sharding.targets import PROFILES
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
    chip: str | None = None  # the die its compiler targets: a key of `sharding.targets.CHIPS`

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
            if value is None:  # an unset optional key (chip)
                continue
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
        if key == "chip":
            if value is not None and value not in CHIPS:
                bad.append(f"{key}={value!r} (one of {', '.join(map(repr, CHIPS))})")
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
    "chip": (lambda v: ("chip", v), lambda s: s.chip),
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
        chip = "h100"                 # the die its compiler targets (sharding.targets.CHIPS);
                                      # default none: its programs come from XLA:CPU

    Raises:
        TargetProfileError: the file is missing or not TOML, a required key is missing, a key
            is unknown (a typo would otherwise fall back to a default silently), or a value is
            not positive.

    Example:
        >>> spec = load_profile("cluster/h100-ib200.toml")  # doctest: +SKIP
    """
    from sharding.targets._profiles import PROFILES

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
    from sharding.targets._profiles import PROFILES

    return [(k, round(_TOML[k][1](PROFILES["h100"]), 6)) for k in keys]


__all__ = [
    "GIB",
    "PLATFORMS",
    "DeviceSpec",
    "TargetError",
    "TargetProfileError",
    "load_profile",
]

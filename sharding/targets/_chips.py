"""What a target's own compiler needs to know of a chip beyond its `DeviceSpec`: `CHIPS`.

XLA:GPU compiles for an NVIDIA GPU it cannot see from a ``GpuTargetConfigProto``: the die's
compute capability, streaming multiprocessors, clock, caches and shared memory (the figures its
fusion, tiling and scheduling decisions read), and the memory size and bandwidth, which come
from the profile. `GpuChip` holds the die's figures as XLA's own target descriptions state them
(openxla/xla ``xla/backends/gpu/target_config/specs/``: ``a100_sxm_80``, ``h100_sxm``,
``h200``, ``b200``, which were read off the devices), cross-checked with NVIDIA's architecture
whitepapers (A100: 108 SMs, 40 MB L2; H100 SXM5: 132 SMs, 50 MB L2, 228 KB shared memory per
SM; B200: 148 SMs). libtpu compiles for a TPU slice named by MaxText's topology spelling
(``train_compile.py``): `TpuChip` holds that name and chip configuration.

A profile names its chip (`DeviceSpec.chip`); a user's TOML profile may name one too
(``chip = "h100"``), and is then compiled as that die with its own memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuChip:
    """One NVIDIA die as XLA:GPU models it (units: bytes, GHz)."""

    description: str  # the device kind a compile-only device reports
    capability: tuple[int, int]  # CUDA compute capability
    accelerated: bool  # the architecture-specific "a" features (sm_90a, sm_100a)
    sms: int
    fp32_per_sm: int
    clock_ghz: float
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int
    cudnn: tuple[int, int, int]  # the cuDNN version the description states
    source: str
    pcie_bytes_per_s: int | None = None


@dataclass(frozen=True)
class TpuChip:
    """One TPU generation as libtpu names it: ``topology_name`` is ``f"{prefix}:{shape}"``."""

    description: str
    prefix: str  # "v5e", "v5" (v5p), "v6e"
    chip_config: str  # "default" or "megacore"
    dims: int  # 2 for a 2D torus (v5e, v6e), 3 for v5p's 3D torus
    chips_per_host: tuple[int, int, int]
    source: str


_HOPPER = dict(
    capability=(9, 0),
    accelerated=True,
    sms=132,
    fp32_per_sm=128,
    clock_ghz=1.98,
    l2_bytes=50 * 2**20,
    shared_per_sm=228 * 1024,
    shared_per_block_optin=227 * 1024,
    pcie_bytes_per_s=32 * 2**30,
)

CHIPS: dict[str, GpuChip | TpuChip] = {
    "h100": GpuChip(
        "NVIDIA H100 80GB HBM3",
        cudnn=(9, 10, 0),
        **_HOPPER,
        source="XLA specs/h100_sxm.txtpb; NVIDIA H100 Tensor Core GPU architecture",
    ),
    "h200": GpuChip(
        "NVIDIA H200 141GB HBM3e",
        cudnn=(9, 10, 0),
        **_HOPPER,
        source="XLA specs/h200.txtpb (H100's die)",
    ),
    "b200": GpuChip(
        "NVIDIA B200",
        capability=(10, 0),
        accelerated=True,
        sms=148,
        fp32_per_sm=128,
        clock_ghz=1.965,
        l2_bytes=132644864,
        shared_per_sm=228 * 1024,
        shared_per_block_optin=227 * 1024,
        cudnn=(9, 10, 0),
        pcie_bytes_per_s=64 * 2**30,
        source="XLA specs/b200.txtpb; NVIDIA Blackwell architecture",
    ),
    "a100": GpuChip(
        "NVIDIA A100-SXM4-80GB",
        capability=(8, 0),
        accelerated=False,
        sms=108,
        fp32_per_sm=64,
        clock_ghz=1.41,
        l2_bytes=40 * 2**20,
        shared_per_sm=164 * 1024,
        shared_per_block_optin=163 * 1024,
        cudnn=(9, 10, 0),
        source="XLA specs/a100_sxm_80.txtpb; NVIDIA A100 Tensor Core GPU architecture",
    ),
    "v5e": TpuChip(
        "TPU v5 lite",
        "v5e",
        "default",
        2,
        (2, 2, 1),
        source="MaxText train_compile.py's v5e topologies",
    ),
    "v5p": TpuChip(
        "TPU v5", "v5", "megacore", 3, (2, 2, 1), source="MaxText train_compile.py's v5p topologies"
    ),
    "v6e": TpuChip(
        "TPU v6 lite",
        "v6e",
        "default",
        2,
        (2, 2, 1),
        source="MaxText train_compile.py's v6e topologies",
    ),
}


def gpu_target_config(chip: GpuChip, memory_bytes: int, memory_bw: float) -> str:
    """``chip`` with ``memory_bytes`` of HBM at ``memory_bw`` bytes/s as XLA's
    ``GpuTargetConfigProto`` text (the form `jax.experimental.topologies` takes).

    Written field by field as XLA's own files are, less what jaxlib 0.10's proto lacks
    (``collective_memory_granularity``) and the per-dtype unit rates, which XLA's A100 file
    leaves out too (XLA then derives them from the clock and the units per SM).
    """
    major, minor = chip.capability
    suffix = "a" if chip.accelerated else ""
    dnn = ".".join(map(str, chip.cudnn))
    lines = [
        "gpu_device_info {",
        "  threads_per_block_limit: 1024",
        "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {chip.shared_per_sm}",
        "  threads_per_core_limit: 2048",
        f"  core_count: {chip.sms}",
        f"  fpus_per_core: {chip.fp32_per_sm}",
        "  block_dim_limit_x: 2147483647",
        "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(memory_bw)}",
        f"  l2_cache_size: {chip.l2_bytes}",
        f"  clock_rate_ghz: {chip.clock_ghz}",
        f"  device_memory_size: {memory_bytes}",
        f"  shared_memory_per_block_optin: {chip.shared_per_block_optin}",
        "  cuda_compute_capability {",
        f"    major: {major}",
        f"    minor: {minor}",
        f"    feature_extension: {'ACCELERATED_FEATURES' if chip.accelerated else 'NONE'}",
        "  }",
        "  registers_per_core_limit: 65536",
        "  registers_per_block_limit: 65536",
        "  thread_dim_limit_x: 1024",
        "  thread_dim_limit_y: 1024",
        "  thread_dim_limit_z: 64",
        '  device_vendor: "NVIDIA Corporation"',
        f'  platform_version: "Compute Capability {major}.{minor}{suffix}"',
        f'  name: "{chip.description}"',
        f'  dnn_version: "{dnn}"',
        "  device_address_bits: 64",
    ]
    if chip.pcie_bytes_per_s:
        lines.append(f"  pcie_bandwidth: {chip.pcie_bytes_per_s}")
    lines += [
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {",
        *(f"  {k}: {v}" for k, v in zip(("major", "minor", "patch"), chip.cudnn, strict=True)),
        "}",
        f'device_description_str: "{chip.description}"',
    ]
    return "\n".join(lines) + "\n"


def tpu_shape(chip: TpuChip, devices: int) -> str:
    """The slice shape libtpu names for ``devices`` chips: ``2x4`` (2D), ``2x2x2`` (3D);
    each dimension a power of two, the later ones the larger (MaxText's spellings)."""
    dims = [1] * chip.dims
    n, i = devices, chip.dims - 1
    while n > 1:
        dims[i] *= 2
        n //= 2
        i = i - 1 if i > 0 else chip.dims - 1
    return "x".join(map(str, dims))


__all__ = ["CHIPS", "GpuChip", "TpuChip", "gpu_target_config", "tpu_shape"]

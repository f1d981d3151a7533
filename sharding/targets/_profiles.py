"""The shipped device profiles (`PROFILES`), each figure beside its source, and the other
spellings of their names (`ALIASES`)."""

from __future__ import annotations

from typing import Any

from sharding.inspection import device_peak
from sharding.targets._devices import GIB, DeviceSpec, TargetError


def _nvidia(name: str, kind: str, peaks: dict[str, float] | None = None,
            **figures: Any) -> DeviceSpec:  # fmt: skip
    """A DGX/HGX-style node of 8 GPUs; peaks from `sharding.inspection.PEAK_FLOPS` unless
    given."""
    figures["source"] += "; latencies: NCCL's tuning model (src/graph/tuning.cc)"
    peaks = peaks or {dtype: device_peak(kind, dtype) for dtype in ("bfloat16", "float32")}
    figures.setdefault("chip", name)
    return DeviceSpec(
        name=name,
        peak_bf16=peaks["bfloat16"],
        peak_f32=peaks["float32"],
        devices_per_node=8,
        intra_link="NVLink",
        inter_link=figures.pop("inter_link", "InfiniBand"),
        # NCCL's tuning model (src/graph/tuning.cc) for the small messages where latency matters:
        # a ring op starts at ~6.8 us (baseLat, LL protocol) and each step adds ~0.6 us over
        # NVLink (hwLat NVLINK LL) or ~5 us through the network (an RDMA hop, one switch tier).
        op_latency=6.8e-6,
        intra_latency=0.6e-6,
        inter_latency=5e-6,
        **figures,
    )


def capped_h100_peaks(watts: float) -> dict[str, float]:
    """Dense peaks of an H100 SXM5 held to ``watts`` of board power (400-700 W).

    The clock a power cap sustains is not published, so the peak is interpolated linearly in
    board power between two datasheet points of the same 132-SM GH100 die: the H100 NVL, 1,671
    TF bf16 and 835 TF TF32 with sparsity (half that dense) at its 400 W maximum, and the H100
    SXM5, 989.4 and 494.7 TF dense at 700 W.
    """
    low, high = (400.0, 835.5e12, 417.5e12), (700.0, 989.4e12, 494.7e12)
    if not low[0] <= watts <= high[0]:
        raise TargetError(f"watts={watts!r}: an H100's cap interpolates between 400 and 700 W")
    share = (watts - low[0]) / (high[0] - low[0])
    # to the GFLOP/s, as a TOML profile writes it back
    return {"bfloat16": round(low[1] + share * (high[1] - low[1]), -9),
            "float32": round(low[2] + share * (high[2] - low[2]), -9)}  # fmt: skip


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
        chip=name,
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
    # The H100 SXM5 96GB (HBM2e, 2.4 TB/s) of Meta's Grand Teton hosts, held to its default 500 W
    # power limit (torchtitan's H100 benchmarks, docs/performance.md): NVLink within 8, a 400
    # Gb/s RDMA NIC per GPU; its peaks `capped_h100_peaks(500)`.
    "h100-96gb-500w": _nvidia("h100-96gb-500w", "H100", peaks=capped_h100_peaks(500),
                              hbm_bytes=96 * GIB, hbm_bw=2.4e12, intra_bw=450e9, inter_bw=50e9,
                              inter_link="RDMA network", chip="h100",
                              source="torchtitan docs/performance.md (Grand Teton H100 96GB "
                                     "HBM2e, 500 W); peaks interpolated in power between the "
                                     "H100 NVL (400 W) and SXM5 (700 W) datasheets"),
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


__all__ = ["ALIASES", "PROFILES", "capped_h100_peaks"]

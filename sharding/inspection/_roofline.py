"""Peak FLOP/s per device, for model FLOPs utilisation (MFU).

Accelerators: the vendor's dense (no sparsity) peak per chip, looked up by `device_kind`. For
``float32`` on NVIDIA GPUs the TF32 tensor-core peak is used, since XLA's DEFAULT matmul
precision runs float32 dots there; on TPUs DEFAULT precision is one bfloat16 pass, so float32
uses the bfloat16 peak.

CPUs have no datasheet figure that means anything for simulated devices sharing a few cores, so
the peak is *measured*: `measure_matmul_peak` times large matmuls on every device of the mesh at
once, and the host's best aggregate throughput is the roofline MFU is taken against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import sharding as jshard

from sharding.inspection._errors import InspectionError

__all__ = [
    "PEAK_FLOPS",
    "Peak",
    "UnknownDeviceKindError",
    "device_peak",
    "host_peak",
    "measure_matmul_peak",
    "mfu",
]

# Dense peak FLOP/s per chip: (substring of jax's device_kind, {dtype: FLOP/s}). First match wins,
# so more specific names come first.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("H100 PCIe", {"bfloat16": 756.0e12, "float32": 378.0e12}),
    ("H100", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("H800", {"bfloat16": 989.4e12, "float32": 494.7e12}),
    ("B200", {"bfloat16": 2250e12, "float32": 1100e12}),
    ("A100", {"bfloat16": 312e12, "float32": 156e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 183e12}),
    ("A10G", {"bfloat16": 70e12, "float32": 35e12}),
    ("TPU v6 lite", {"bfloat16": 918e12, "float32": 918e12}),
    ("TPU v5 lite", {"bfloat16": 197e12, "float32": 197e12}),
    ("TPU v5p", {"bfloat16": 459e12, "float32": 459e12}),
    ("TPU v5", {"bfloat16": 459e12, "float32": 459e12}),
    ("TPU v4", {"bfloat16": 275e12, "float32": 275e12}),
)


class UnknownDeviceKindError(InspectionError):
    """No peak FLOP/s is known for this accelerator."""


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of all ``devices`` together, and where the figure comes from."""

    flops_per_s: float
    devices: int
    device_kind: str
    source: str  # "datasheet" or "measured"

    @property
    def per_device(self) -> float:
        return self.flops_per_s / self.devices

    def to_dict(self) -> dict:
        return {
            "flops_per_s": self.flops_per_s,
            "per_device": self.per_device,
            "devices": self.devices,
            "device_kind": self.device_kind,
            "source": self.source,
        }


def device_peak(device_kind: str, dtype: str = "bfloat16") -> float:
    """Datasheet dense peak FLOP/s of one ``device_kind`` chip in ``dtype``.

    Example:
        >>> device_peak("NVIDIA H100 80GB HBM3") / 1e12
        989.4
    """
    for pattern, peaks in PEAK_FLOPS:
        if pattern.lower() in device_kind.lower():
            if dtype not in peaks:
                raise UnknownDeviceKindError(
                    f"no {dtype} peak known for {device_kind!r}; known dtypes: {sorted(peaks)}"
                )
            return peaks[dtype]
    known = ", ".join(p for p, _ in PEAK_FLOPS)
    raise UnknownDeviceKindError(
        f"no peak FLOP/s known for device kind {device_kind!r}; known kinds: {known}. "
        f"Pass the peak explicitly (spmdkit compare --peak-tflops T, T per device)"
    )


def measure_matmul_peak(
    devices: list | None = None, *, dtype: str = "float32", n: int = 512, repeats: int = 5
) -> Peak:
    """The best aggregate matmul FLOP/s of ``devices`` running square matmuls all at once.

    Each device multiplies its own ``n x n`` matrices 8 times in a loop (one dispatch), so the
    figure is compute throughput, not launch overhead; the best of ``repeats`` runs is kept.
    """
    devices = list(jax.devices() if devices is None else devices)
    mesh = jshard.Mesh(np.array(devices), ("d",))
    sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec("d"))
    chain = 8
    x = jax.device_put(jnp.ones((len(devices), n, n), dtype) / n, sharding)

    @jax.jit
    def work(a: jax.Array) -> jax.Array:
        def body(_, acc):
            return jnp.einsum("dij,djk->dik", acc, a)

        return jax.lax.fori_loop(0, chain, body, a)

    work(x).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    flops = 2 * n**3 * chain * len(devices)
    return Peak(flops / best, len(devices), devices[0].device_kind, "measured")


def host_peak(devices: list | None = None, *, dtype: str = "float32", tflops: float | None = None):
    """The `Peak` MFU is measured against: ``tflops`` per device if given, the datasheet for a
    known accelerator, the measured matmul roofline on CPU."""
    devices = list(jax.devices() if devices is None else devices)
    kind = devices[0].device_kind
    if tflops is not None:
        return Peak(tflops * 1e12 * len(devices), len(devices), kind, "given")
    if devices[0].platform == "cpu":
        return measure_matmul_peak(devices, dtype=dtype)
    return Peak(device_peak(kind, dtype) * len(devices), len(devices), kind, "datasheet")


def mfu(model_flops_per_step: float, step_time_s: float, peak: Peak) -> float:
    """Model FLOPs utilisation: useful FLOP/s over the peak of all devices together."""
    return model_flops_per_step / step_time_s / peak.flops_per_s

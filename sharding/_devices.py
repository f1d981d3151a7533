"""How many devices a run has, decided before JAX initialises: simulated CPU devices or real ones.

`cpu_only` answers without initialising JAX; `setup_devices` fixes the device count for a mesh
(simulating CPU devices on a CPU-only host) and returns the resolved `MeshSpec`. Entry points call
it first thing, before any JAX computation.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from sharding._mesh import MeshSpec, MeshSpecError, simulate_cpu_devices

# Each plugin, and the device files its accelerators show on Linux (the NVIDIA driver's, AMD's
# kernel fusion driver, a TPU VM's accel or VFIO devices).
_NVIDIA, _AMD, _TPU = (
    ("/dev/nvidiactl", "/dev/nvidia[0-9]*"),
    ("/dev/kfd",),
    ("/dev/accel*", "/dev/vfio/[0-9]*"),
)
_ACCELERATOR_PLUGINS = {
    "jax_cuda12_plugin": _NVIDIA,
    "jax_cuda13_plugin": _NVIDIA,
    "jax_rocm60_plugin": _AMD,
    "jax_rocm7_plugin": _AMD,
    "libtpu": _TPU,
}
DEFAULT_CPU_DEVICES = 8


def cpu_only() -> bool:
    """True when JAX can only run on the CPU here (decided without initialising JAX): JAX is
    told so, or no accelerator plugin has its device here. A plugin alone (``jax[cuda12]``
    installed to compile for GPUs on a CPU host) is not a device."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(
        importlib.util.find_spec(p) and any(glob.glob(d) for d in nodes)
        for p, nodes in _ACCELERATOR_PLUGINS.items()
    )


def setup_devices(mesh: MeshSpec | str | None, devices: int | None = None) -> MeshSpec:
    """Fix the device count (simulating CPU devices on a CPU-only host) and resolve the mesh.

    Must run before anything initialises JAX. On a CPU host the simulated count is ``devices``,
    or the mesh's size, or 8 when the mesh has a -1 axis or is not given. Elsewhere ``devices``
    must be None or the real device count.
    """
    spec = MeshSpec.of(mesh) if mesh else MeshSpec(data=-1)
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int)
                                or devices < 1):  # fmt: skip
        raise MeshSpecError(f"--devices {devices!r}: give a device count >= 1, e.g. --devices 8")
    import jax

    if jax.distributed.is_initialized():  # a multi-process run: `devices` is this process's share
        return spec.resolve(jax.device_count())
    fixed = -1 not in spec.sizes.values()
    if devices is not None and fixed and spec.size != devices:
        raise MeshSpecError(
            f"--mesh {spec} spans {spec.size} devices but --devices is {devices}; make them agree "
            f"(--devices {spec.size}), or write one mesh axis as -1 to take the rest"
        )
    if cpu_only():
        n = devices or (spec.size if fixed else DEFAULT_CPU_DEVICES)
        spec = spec.resolve(n)  # checked before JAX starts, so a bad mesh costs nothing
        simulate_cpu_devices(n)
    elif devices is not None and jax.device_count() != devices:
        raise MeshSpecError(
            f"--devices {devices}: this host has {jax.device_count()} "
            f"{jax.default_backend()} devices and only CPU devices can be simulated; drop "
            f"--devices or give {jax.device_count()}"
        )
    return spec.resolve(jax.device_count())

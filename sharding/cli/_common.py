"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import shutil
import sys

from rich.console import Console

import models
from partition_rules import STRATEGIES
from sharding._mesh import MeshSpec, simulate_cpu_devices


def add_model_args(p: argparse.ArgumentParser, *, size: str = "tiny") -> None:
    p.add_argument("--model", default="llama", choices=sorted(models.FAMILIES),
                   help="model family (default: %(default)s)")  # fmt: skip
    p.add_argument("--size", default=size, help="named size of the family (default: %(default)s)")


def add_strategy_args(p: argparse.ArgumentParser, *, default: str = "fsdp_tp") -> None:
    p.add_argument("--mesh", help="mesh spec, e.g. data=2,fsdp=2,tensor=2 (one axis may be -1)")
    p.add_argument("--strategy", default=default, choices=list(STRATEGIES),
                   help="partition preset (default: %(default)s)")  # fmt: skip


def console(stderr: bool = False) -> Console:
    """A rich console; wide when output goes to a file or pipe so tables are not squeezed."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else max(160, shutil.get_terminal_size((160, 24)).columns)
    return Console(file=stream, width=width)


_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")  # fmt: skip


def cpu_only() -> bool:
    """True when JAX can only run on the CPU here (decided without initialising JAX)."""
    import importlib.util
    import os

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(p) for p in _ACCELERATOR_PLUGINS)


def setup_devices(mesh_arg: str | None, devices: int | None) -> MeshSpec:
    """Fix the device count (simulating CPU devices on a CPU-only host) and resolve the mesh.

    Must run before anything initialises JAX. On a CPU host the simulated count is --devices, or
    the mesh's size, or 8 when the mesh has a -1 axis or is not given.
    """
    spec = MeshSpec.of(mesh_arg) if mesh_arg else MeshSpec(data=-1)
    if cpu_only():
        fixed = -1 not in spec.sizes.values()
        simulate_cpu_devices(devices or (spec.size if fixed else 8))
    elif devices is not None:
        raise ValueError("--devices simulates CPU devices and applies only to CPU-only hosts")
    import jax

    return spec.resolve(jax.device_count())

"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import shutil
import sys

from rich.console import Console

import models
from partition_rules import PIPELINE_STRATEGIES, STRATEGIES
from sharding._mesh import MeshSpec, simulate_cpu_devices
from sharding._schedule import SCHEDULES


def add_model_args(p: argparse.ArgumentParser, *, size: str = "tiny") -> None:
    p.add_argument("--model", default="llama", choices=sorted(models.FAMILIES),
                   help="model family (default: %(default)s)")  # fmt: skip
    p.add_argument("--size", default=size, help="named size of the family (default: %(default)s)")


def add_strategy_args(p: argparse.ArgumentParser, *, default: str = "fsdp_tp") -> None:
    p.add_argument("--mesh", help="mesh spec, e.g. data=2,fsdp=2,tensor=2 (one axis may be -1)")
    p.add_argument("--strategy", default=default, choices=list(STRATEGIES),
                   help="partition preset (default: %(default)s)")  # fmt: skip


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (strategies pp, pp_tp, pp_fsdp)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default: gpipe)")
    g.add_argument("--microbatches", type=int, help="micro-batches per step (default: 2 x stages)")
    g.add_argument("--repeats", type=int, help="circular: layer blocks per stage (default: 2)")


def pipeline_spec(args: argparse.Namespace, family, stages: int):
    """The `PipelineSpec` the arguments ask for, or None for a non-pipeline strategy."""
    from sharding._pipeline import PipelineSpec

    asked = [f"--{k}" for k in ("schedule", "microbatches", "repeats") if getattr(args, k)]
    if args.strategy not in PIPELINE_STRATEGIES:
        if asked:
            raise ValueError(
                f"{', '.join(asked)} configure a pipeline, but strategy {args.strategy!r} does not "
                f"pipeline; use one of {sorted(PIPELINE_STRATEGIES)} with a 'stage' mesh axis"
            )
        return None
    if stages < 2:
        raise ValueError(
            f"strategy {args.strategy!r} pipelines the layer stack over the 'stage' mesh axis, "
            f"but --mesh {args.mesh!r} has stage={stages}; add stage=N with N >= 2, "
            f"e.g. 'stage=2,data=4'"
        )
    schedule = args.schedule or "gpipe"
    repeats = args.repeats or (2 if schedule == "circular" else 1)
    return PipelineSpec(
        schedule=schedule,
        microbatches=args.microbatches or 2 * stages,
        repeats=repeats,
        input_key=family.INPUT,
        loss_from_logits=family.loss_from_logits,
    )


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

"""Which compiler a target's programs come from: `compiler_for` resolves it once, a `Compiler`.

JAX compiles for an accelerator ahead of time on a host that has none: with ``jax[cuda12]``
installed, `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
topology="1x1x8")` gives compile-only H100s, and XLA:GPU compiles a sharded step for them on a
CPU host (libtpu does the same for a named TPU slice). The compiled program is the target's
own: its buffer assignment, its collectives as it rewrites and schedules them. So the facts
spmdkit prices (memory, collectives, FLOPs) come from the target's compiler wherever it is
installed (``auto``), and from XLA:CPU on simulated devices only where it is not, which the
`Compiler`'s ``note`` says with the extra to install. ``target`` refuses instead of falling
back; ``cpu`` asks for XLA:CPU (the numerics tests run there).

Example:
    >>> c = compiler_for(target("h100:1x8"))  # doctest: +SKIP
    >>> c.describe()  # doctest: +SKIP
    'XLA:GPU for 8 x NVIDIA H100 80GB HBM3 (compile-only devices on this host)'
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from sharding._devices import cpu_only
from sharding.targets._chips import CHIPS, GpuChip, gpu_target_config, tpu_shape
from sharding.targets._devices import TargetError
from sharding.targets._target import Target

CHOICES = ("auto", "target", "cpu")
# platform -> (the module its plugin installs, the extra that installs it, jax's extra)
_INSTALLS = {
    "gpu": ("jax_cuda12_plugin", "spmdkit[gpu]", "jax[cuda12]"),
    "tpu": ("libtpu", "spmdkit[tpu]", "jax[tpu]"),
}


class CompilerError(TargetError):
    """A target whose own compiler was asked for (``--compiler target``) but cannot run here."""


@dataclass(frozen=True)
class Compiler:
    """Where a target's programs are compiled: by which compiler, for which devices.

    ``platform`` is the compiler's ("gpu", "tpu" or "cpu"): whose optimisation passes the
    programs have been through. ``devices`` are the compile-only devices to build programs on;
    empty: this process's own (simulated CPU devices, or the real accelerators of this host).
    ``note`` says why the programs do not come from the target's compiler, with the fix; None
    when they do.
    """

    name: str
    platform: str
    device_kind: str
    count: int
    where: str
    note: str | None = None
    devices: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def describe(self) -> str:
        """``XLA:GPU for 8 x NVIDIA H100 80GB HBM3 (compile-only devices on this host)``."""
        return f"{self.name} for {self.count} x {self.device_kind} ({self.where})"

    def device_list(self) -> list | None:
        """The devices to build programs on; None: this process's own."""
        return list(self.devices) if self.devices else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "platform": self.platform,
            "device_kind": self.device_kind,
            "devices": self.count,
            "where": self.where,
            "note": self.note,
        }


def check_choice(choice: str) -> str:
    """``choice`` if it is one of `CHOICES`, else a `CompilerError` saying what each means."""
    if choice not in CHOICES:
        raise CompilerError(
            f"--compiler {choice!r}: choose auto (the target's compiler where installed, else "
            f"XLA:CPU, saying so), target (the target's compiler or an error) or cpu (XLA:CPU)"
        )
    return choice


def compiler_name(platform: str) -> str:
    """How tables name the compiler of a platform: ``"gpu"`` -> ``"XLA:GPU"``."""
    return f"XLA:{platform.upper()}"


def compiler_for(tgt: Target, choice: str = "auto") -> Compiler:
    """The compiler ``tgt``'s programs come from (``choice``: "auto", "target" or "cpu").

    On a host with accelerators, their own compiler on their devices. Otherwise ``auto``: the
    target's compiler on compile-only devices where its extra is installed, else XLA:CPU on
    simulated devices with a ``note`` naming the extra; ``target``: the target's compiler or a
    `CompilerError` naming the extra; ``cpu``: XLA:CPU. Call it after this process's CPU
    devices are simulated (`sharding.simulate_cpu_devices`): compile-only devices need JAX on
    its CPU platform.

    Raises:
        CompilerError: an unknown ``choice``, or ``target`` where its compiler cannot run here.
    """
    check_choice(choice)
    if not cpu_only():
        import jax

        return Compiler(
            compiler_name(jax.default_backend()),
            jax.default_backend(),
            jax.devices()[0].device_kind,
            jax.device_count(),
            "this host's devices",
        )
    if choice == "cpu":
        return _cpu(tgt, None)
    try:
        return _target_compiler(tgt)
    except CompilerError as err:
        if choice == "target":
            raise
        return _cpu(tgt, str(err))


def _cpu(tgt: Target, note: str | None) -> Compiler:
    return Compiler(
        compiler_name("cpu"),
        "cpu",
        "simulated CPU device",
        tgt.devices,
        "simulated on this host",
        note,
    )


def _target_compiler(tgt: Target) -> Compiler:
    """The target's own compiler on compile-only devices, or a `CompilerError` saying why not."""
    spec = tgt.device
    chip = CHIPS.get(spec.chip) if spec.chip else None
    if chip is None:
        raise CompilerError(
            f"device profile {spec.name!r} names no chip its compiler knows, so its programs "
            f"come from XLA:CPU; add chip = one of {', '.join(map(repr, CHIPS))} to its TOML "
            f"to compile for that chip with the profile's memory"
        )
    platform = "gpu" if isinstance(chip, GpuChip) else "tpu"
    module, extra, jax_extra = _INSTALLS[platform]
    name = compiler_name(platform)
    if importlib.util.find_spec(module) is None:
        raise CompilerError(
            f"{name} (the {spec.name}'s compiler) is not installed here, so the programs come "
            f"from XLA:CPU on simulated devices, corrected by hand for what {name} does; "
            f"pip install '{extra}' ({jax_extra}) to compile for the {spec.name} itself"
        )
    if platform == "gpu":
        text = gpu_target_config(chip, spec.hbm_bytes, spec.hbm_bw)
        key = ("cuda", text, f"1x{tgt.nodes}x{tgt.per_node}")
    else:
        if tgt.per_node & (tgt.per_node - 1):  # not a power of two
            raise CompilerError(
                f"{tgt.name}: libtpu names slices of a power of two chips, not {tgt.per_node}; "
                f"use a slice of {2 ** (tgt.per_node.bit_length() - 1)} or "
                f"{2 ** tgt.per_node.bit_length()} chips"
            )
        shape = f"{chip.prefix}:{tpu_shape(chip, tgt.per_node)}"
        key = ("tpu", shape, chip.chip_config, chip.chips_per_host, tgt.nodes)
    try:
        devices = _topology(key)
    except Exception as err:  # the plugin's own refusal, whatever its type: say it
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompilerError(
            f"{name} could not describe {tgt.devices} x {chip.description} here ({first}); "
            f"compiled by XLA:CPU instead"
        ) from None
    return Compiler(
        name,
        platform,
        devices[0].device_kind,
        len(devices),
        "compile-only devices on this host",
        None,
        tuple(devices),
    )


@functools.lru_cache(maxsize=16)
def _topology(key: tuple) -> list:
    """The compile-only devices of one topology (the plugin's call; cached, ~0.1 s)."""
    from jax.experimental import topologies

    if key[0] == "cuda":
        _, text, shape = key
        desc = topologies.get_topology_desc(platform="cuda", target_config=text, topology=shape)
    else:
        _, name, config, per_host, slices = key
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=name,
            chip_config_name=config,
            chips_per_host_bounds=per_host,
            num_slices=slices,
            wrap=(False, False, False),
        )
    return list(desc.devices)


__all__ = ["CHOICES", "Compiler", "CompilerError", "check_choice", "compiler_for", "compiler_name"]

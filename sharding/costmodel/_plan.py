"""`plan`: rank strategies and meshes for a model on N devices before owning them (`spmdkit plan`).

The ranking comes from the cost model (no devices, any size). For meshes small enough to simulate
here, the top layouts are also compiled ahead of time on simulated CPU devices from abstract
shapes, and their compiled memory shown beside the prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sharding._devices import cpu_only
from sharding._mesh import simulate_cpu_devices
from sharding._units import SizeFormatError, fmt_bytes, fmt_count, parse_bytes
from sharding.costmodel._layouts import strategy_names
from sharding.costmodel._predict import (
    DTYPE_BYTES,
    LM_FAMILIES,
    OPTIMIZER_MOMENTS,
    CostModelError,
)
from sharding.costmodel._search import (
    PROFILES,
    DeviceProfile,
    Estimate,
    candidates,
    compile_candidate,
)

# Simulating more CPU devices than this makes an AOT compile too slow to be worth waiting for.
MAX_AOT_DEVICES = 64
# The size `plan` takes when none is given: the largest of each family that fits the default
# 8 devices of the default kind (llama 70b needs more than 8 x 80 GB).
DEFAULT_SIZES = {"llama": "7b", "gpt2": "1.5b"}


class PlanError(CostModelError):
    """An argument of `plan` it cannot take."""


@dataclass
class PlanResult:
    """The ranked layouts of one `plan` call, with what the ranking assumed.

    ``ranked`` holds every layout (fitting ones first, by estimated step time); ``shown`` the
    first ``top`` of them, which `table`, `to_dict` and `to_json` report.
    """

    family: str
    size: str
    layers: int
    devices: int
    memory_bytes: int
    batch: int
    seq: int
    dtype: str
    optimizer: str
    profile: DeviceProfile
    search_s: float
    ranked: list[Estimate]
    top: int
    assumptions: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def shown(self) -> list[Estimate]:
        return self.ranked[: self.top]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.family, "size": self.size, "layers": self.layers,
            "devices": self.devices, "memory_bytes": self.memory_bytes, "batch": self.batch,
            "seq": self.seq, "dtype": self.dtype, "search_s": self.search_s,
            "assumptions": self.assumptions + self.notes,
            "candidates": [c.to_dict() for c in self.shown],
        }  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self) -> Group:
        """The ranking as a table, then the assumptions behind it (dim)."""
        shown = self.shown
        table = Table(
            title=f"{self.family} {self.size} ({self.layers} layers) on {self.devices} devices of "
            f"{fmt_bytes(self.memory_bytes)}: batch {self.batch} x seq {self.seq}; "
            f"{sum(c.fits for c in shown)} of the top {len(shown)} fit (searched in "
            f"{self.search_s:.1f} s)",
            title_justify="left",
        )
        for col in ("#", "strategy", "mesh", "pipeline", "remat", "memory/device", "fits",
                    "compiled", "comm/step", "step (compute+comm)", "tokens/s"):  # fmt: skip
            left = col in ("strategy", "mesh", "pipeline")
            table.add_column(col, justify="left" if left else "right")
        for i, c in enumerate(shown, 1):
            p = c.prediction
            pipe = f"{p.pipeline['name']} m={p.pipeline['microbatches']}" if p.pipeline else "-"
            compiled = "-"
            if c.compiled_memory is not None:
                err = (p.memory_bytes - c.compiled_memory) / c.compiled_memory
                compiled = f"{fmt_bytes(c.compiled_memory)} ({err:+.0%})"
            table.add_row(
                str(i), p.strategy, c.mesh_text, pipe, p.remat, fmt_bytes(p.memory_bytes),
                "[green]yes[/green]" if c.fits else "[red]no[/red]", compiled,
                fmt_bytes(p.collective_bytes()),
                f"{c.step_s * 1e3:,.0f} ms ({c.compute_s * 1e3:,.0f}+{c.comm_s * 1e3:,.0f})",
                fmt_count(p.batch * p.seq / c.step_s),
            )  # fmt: skip
        lines = [Text(f"- {line}", style="dim") for line in self.assumptions + self.notes]
        return Group(table, *lines)


def plan(
    family: Any,
    *,
    size: str | None = None,
    cfg: Any = None,
    devices: int = 8,
    memory: int | str | None = None,
    device_kind: str = "h100-80gb",
    batch: int | None = None,
    seq: int | None = None,
    layers: int | None = None,
    strategies: str | Sequence[str] | None = None,
    dtype: str = "float32",
    optimizer: str = "adamw",
    top: int = 12,
    aot: int | None = None,
) -> PlanResult:
    """Rank every (strategy, mesh, schedule, remat) layout of ``devices`` devices for a model.

    Args:
        family: a language-model family module (``models.llama``, ``models.gpt2``).
        size, cfg: a named size of the family (default: `DEFAULT_SIZES`, the largest that fits
            the default 8 devices) or a Config; ``layers`` overrides its layer count.
        devices: the number of devices the mesh spans (none need exist here).
        memory: bytes per device, or a size such as "80GB" (default: the device kind's).
        device_kind: a `PROFILES` entry: peak FLOP/s and link bandwidths.
        batch, seq: global batch in sequences (default: ``devices``) and sequence length
            (default: min(4096, the model's maximum)).
        strategies: a subset of the presets (a comma list or a sequence; default: all).
        dtype, optimizer: compute dtype and optimizer ("adamw", "adam", "sgd").
        top: how many layouts the result shows.
        aot: AOT-compile this many of the top fitting layouts on simulated CPU devices (default:
            2 when ``devices`` <= 64; skipped, with a note, when this process cannot hold
            ``devices`` devices). Simulating fixes this process's CPU device count.

    Raises:
        PlanError: an argument out of range; `NoFittingStrategyError`, `NoValidLayoutError` from
            the search.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> result = plan(llama, size="70b", devices=512, memory="80GB", top=3)  # doctest: +SKIP
        >>> result.shown[0].fits  # doctest: +SKIP
        True
    """
    name = getattr(family, "NAME", None)
    if name not in LM_FAMILIES:
        raise PlanError(
            f"--model {name or family!r}: plan covers the language-model families "
            f"{', '.join(LM_FAMILIES)}; choose one of them"
        )
    cfg = _config(family, size, cfg)
    _whole("--devices", devices, 1, "the number of devices the mesh spans, e.g. --devices 8")
    _whole("--top", top, 1, "the rows to show, e.g. --top 12")
    for flag, value in (("--batch", batch), ("--layers", layers), ("--seq", seq)):
        if value is not None:
            _whole(flag, value, 1, "or leave it out for the default")
    if aot is not None:
        _whole("--aot", aot, 0, "how many top layouts to compile; 0 for none")
    if device_kind not in PROFILES:
        raise PlanError(f"--device-kind {device_kind!r}: known kinds: {', '.join(PROFILES)}")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise PlanError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_MOMENTS)}")
    if seq is not None and seq > cfg.max_seq_len:
        raise PlanError(
            f"--seq {seq}: {name} {cfg.name} holds at most {cfg.max_seq_len} positions; use "
            f"--seq {cfg.max_seq_len} or less"
        )
    strategies = strategy_names(strategies)
    profile = PROFILES[device_kind]
    memory = profile.memory_bytes if memory is None else _memory(memory)
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    aot = aot if aot is not None else (2 if devices <= MAX_AOT_DEVICES else 0)
    if aot and cpu_only():  # before anything initialises JAX
        with contextlib.suppress(RuntimeError):  # holding another count already: noted below
            simulate_cpu_devices(devices)
    batch = batch or devices
    seq = seq or min(4096, cfg.max_seq_len)
    start = time.perf_counter()
    ranked = candidates(family, cfg, devices, batch, seq, strategies=tuple(strategies),
                        dtype=dtype, optimizer=optimizer, memory_bytes=memory,
                        profile=profile)  # fmt: skip
    elapsed = time.perf_counter() - start
    notes = []
    if aot:
        import jax

        if jax.device_count() != devices:
            notes.append(f"AOT skipped: {jax.device_count()} devices here, not {devices}")
        else:
            for c in [c for c in ranked if c.fits][:aot]:
                compile_candidate(c, family, cfg)
    assumptions = [
        f"device: {profile.describe()}; memory budget {fmt_bytes(memory)} per device",
        "step time = critical-path matmul FLOPs / peak + ring collective time at the bandwidth "
        "of the links each group spans, no overlap (an upper bound); axes laid out stage, data, "
        "fsdp, tensor with tensor innermost",
        "memory = params + gradients + optimizer state + batch + saved activations + one "
        "layer's backward transients + gathered layer weights + float32 logits; no runtime "
        "reserve",
        f"float32 master weights; {dtype} compute; {optimizer}",
    ]
    return PlanResult(name, cfg.name, cfg.n_layers, devices, memory, batch, seq, dtype,
                      optimizer, profile, elapsed, ranked, top, assumptions, notes)  # fmt: skip


def _config(family: Any, size: str | None, cfg: Any) -> Any:
    if cfg is not None:
        if size is not None:
            raise PlanError(f"plan(size={size!r}, cfg=...): give a size or a config, not both")
        return cfg
    if size is None:
        size = DEFAULT_SIZES.get(family.NAME)
        if size is None:
            raise PlanError(f"--size: give one of {family.NAME}'s sizes: {', '.join(family.SIZES)}")
    if size not in family.SIZES:
        raise PlanError(
            f"--size {size!r}: unknown {family.NAME} size; sizes: {', '.join(family.SIZES)}"
        )
    return family.config(size)


def _whole(flag: str, value: Any, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanError(f"{flag} {value!r}: give a whole number >= {low} ({what})")


def _memory(memory: int | str) -> int:
    try:
        value = parse_bytes(memory) if isinstance(memory, str) else memory
    except SizeFormatError as e:
        raise PlanError(f"--memory {memory!r}: {e}") from None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise PlanError(f"--memory {memory!r}: give the memory per device > 0, e.g. --memory 80GB")
    return int(value)


__all__ = ["DEFAULT_SIZES", "MAX_AOT_DEVICES", "PlanError", "PlanResult", "plan"]

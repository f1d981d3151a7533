"""Rewrite a checkpoint for another mesh and strategy, ahead of time (`spmdkit reshard`).

`reshard` reads one step of a checkpoint directory, places every array straight into its sharding
under the target strategy on the target mesh (each device reads only its own shards) and writes
it as the same step of another directory, whose metadata then names the new mesh and strategy.
Restoring onto another mesh also works without it (a resumed run reshards as it restores); this
makes the conversion once. Every input is checked before anything is read or written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from partition_rules import CompositionError, composition
from sharding._init import abstract_params
from sharding._mesh import MeshSpec, make_mesh, mesh_sizes, mesh_text
from sharding._resolve import resolve
from sharding._units import fmt_bytes
from sharding._workload import Workload
from sharding.training._checkpoint import Checkpointer, NoCheckpointError
from sharding.training._elastic import checkpoint_shardings
from sharding.training._manifest import CheckpointError


class ReshardError(CheckpointError):
    """The source or destination of a reshard cannot be used as given."""


@dataclasses.dataclass(frozen=True)
class ReshardResult:
    """What `reshard` wrote: one step, from the source's mesh and strategy to the target's."""

    src: str
    dst: str
    step: int
    family: str
    size: str
    from_strategy: str
    from_mesh: dict
    to_strategy: str
    to_mesh: dict
    arrays: int
    bytes: int

    @property
    def written(self) -> str:
        """The step directory written."""
        return str(Path(self.dst) / str(self.step))

    def summary(self) -> str:
        """One line: ``step 5: llama tiny, fsdp on fsdp=8 -> fsdp_tp on fsdp=2,tensor=4; ...``."""
        return (
            f"step {self.step}: {self.family} {self.size}, {self.from_strategy} on "
            f"{mesh_text(self.from_mesh)} -> {self.to_strategy} on {mesh_text(self.to_mesh)}; "
            f"{self.arrays} arrays, {fmt_bytes(self.bytes)}; wrote {self.written}"
        )

    def __str__(self) -> str:
        return self.summary()

    def table(self):
        """A rich table: the source and the target side by side."""
        from rich.table import Table

        t = Table(title=f"reshard step {self.step}: {self.family} {self.size}, "
                  f"{self.arrays} arrays, {fmt_bytes(self.bytes)}")  # fmt: skip
        for col in ("", "directory", "strategy", "mesh"):
            t.add_column(col)
        t.add_row("from", str(Path(self.src) / str(self.step)), self.from_strategy,
                  mesh_text(self.from_mesh))  # fmt: skip
        t.add_row("to", self.written, self.to_strategy, mesh_text(self.to_mesh))
        return t

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "written": self.written}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before anything is read or created, a SRC/DST pair reshard cannot use."""
    train_dir = "give as SRC the --checkpoint-dir of a spmdkit train run"
    if not src.exists():
        raise ReshardError(f"SRC {src} does not exist; {train_dir}")
    if not src.is_dir():
        raise ReshardError(f"SRC {src} is a file, not a checkpoint directory; {train_dir}")
    a, b = src.resolve(), dst.resolve()
    if a == b:
        raise ReshardError(f"reshard: SRC and DST are both {src}; give a new directory as DST")
    if a in b.parents or b in a.parents:
        inner, outer = ("DST", "SRC") if a in b.parents else ("SRC", "DST")
        raise ReshardError(
            f"{inner} {dst if inner == 'DST' else src} is inside {outer} "
            f"{src if outer == 'SRC' else dst}; give a DST outside SRC (and SRC outside DST)"
        )
    if dst.exists() and not dst.is_dir():
        raise ReshardError(f"DST {dst} is a file; give a new or empty directory as DST")
    if dst.is_dir() and not overwrite:
        entries = sorted(p.name for p in dst.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ReshardError(
                f"DST {dst} is not empty ({len(entries)} entries: {shown}); give a new or empty "
                f"directory as DST, or pass --overwrite to write the step into it (replacing "
                f"that step if DST holds it)"
            )


def reshard(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    mesh: MeshSpec | str,
    strategy: str,
    families: Mapping[str, ModuleType] | None = None,
    model: Workload | None = None,
    step: int | None = None,
    overwrite: bool = False,
) -> ReshardResult:
    """Rewrite step ``step`` (default: the latest) of checkpoint ``src`` into ``dst``.

    Args:
        src: a checkpoint directory (`spmdkit train --checkpoint-dir`, `Checkpointer`).
        dst: where to write the same step, for ``strategy`` on ``mesh``; new or empty unless
            ``overwrite`` (then the step replaces the same step there, other steps stay).
        mesh: the target mesh (its device count must be this process's).
        strategy: the target strategy: a name (`partition_rules.STRATEGIES`) or a composition.
        families: model family name -> family module (``models.FAMILIES``): the model the
            checkpoint names is built from it, abstractly, to place the arrays.
        model: the `sharding.Workload` the checkpoint was trained from (your own model; its
            name must be the one the checkpoint records), instead of ``families``.
        step: the step to rewrite; None for the latest.

    Example (with ``models`` the package of shipped model families):
        >>> r = reshard("ck", "ck_tp", mesh="fsdp=2,tensor=4", strategy="fsdp_tp",
        ...             families=models.FAMILIES)  # doctest: +SKIP
        >>> print(r)  # doctest: +SKIP
        step 10: llama tiny, fsdp on fsdp=8 -> fsdp_tp on fsdp=2,tensor=4; 38 arrays, ...
    """
    try:
        composition(strategy)
    except CompositionError as e:
        raise ReshardError(f"--strategy {strategy!r}: {e}") from None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ReshardError(f"--step {step!r} is not a whole number; give a saved step")
    spec = MeshSpec.of(mesh)
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, overwrite)
    with Checkpointer(src, keep=None, read_only=True) as source:
        steps = source.steps()
        if not steps:
            raise NoCheckpointError(
                f"SRC {src} holds no committed checkpoint; give as SRC the --checkpoint-dir of "
                f"a spmdkit train run that saved one (--save-every, or its last step)"
            )
        if step is not None and step not in steps:
            raise NoCheckpointError(
                f"--step {step}: SRC {src} has no step {step}; its saved steps are "
                f"{', '.join(map(str, steps))}; give one of them, or drop --step for the latest "
                f"({steps[-1]})"
            )
        meta = source.meta(step)  # checks every file of the step against its manifest
        work = _workload(meta, families or {}, model)
        target_mesh = make_mesh(spec)
        _, params = abstract_params(lambda: work.model(_rngs()))
        shardings = resolve(work.rules, work.axis_map(strategy), params, target_mesh)
        saved = source.array_metadata(meta.step)
        targets = checkpoint_shardings(saved, params, shardings, target_mesh)
        state, _ = source.restore(targets, meta.step, verify=False)  # verified by meta() above
    new_meta = dataclasses.replace(meta, mesh=mesh_sizes(target_mesh), strategy=strategy)
    with Checkpointer(dst, keep=None, async_save=False) as target:
        target.save(meta.step, state, new_meta, overwrite=overwrite)
    return ReshardResult(
        src=str(src.absolute()),
        dst=str(dst.absolute()),
        step=meta.step,
        family=meta.family,
        size=meta.size,
        from_strategy=meta.strategy,
        from_mesh=dict(meta.mesh),
        to_strategy=strategy,
        to_mesh=dict(new_meta.mesh),
        arrays=len(saved),
        bytes=sum(v.size * v.dtype.itemsize for v in saved.values()),
    )


def _workload(meta: Any, families: Mapping[str, ModuleType], model: Workload | None) -> Workload:
    """The model the checkpoint holds: the given workload, or the family it names."""
    if model is not None:
        if meta.family != model.name and meta.family != getattr(model.family, "NAME", None):
            raise ReshardError(
                f"SRC step {meta.step} holds a {meta.family!r} model, not {model.name!r}; give "
                f"--model the workload that run trained"
            )
        return model
    if meta.family not in families:
        raise ReshardError(
            f"SRC step {meta.step} holds a {meta.family!r} model, which is not among the "
            f"model families given ({', '.join(families) or 'none'}); for your own model give "
            f"--model package.module:attribute (reshard(model=...))"
        )
    family = families[meta.family]
    return Workload.from_family(family, family.config(meta.size, **meta.config))


def _rngs():
    from flax import nnx

    return nnx.Rngs(0)

"""``--model`` and ``--size``: a shipped model at a named size, a Hugging Face config.json
(``hf:PATH``), or the user's own workload (``module:attribute``)."""

from __future__ import annotations

import argparse
import dataclasses

import models


def sizes_text(family: str, sources: bool = False) -> str:
    """``"tiny, 124m"``: a family's sizes (with ``sources``: each with its ``SOURCES`` entry)."""
    known = getattr(fam := models.get_family(family), "SOURCES", {})
    return ", ".join(f"{s} ({known[s]})" if sources and s in known else s for s in fam.SIZES)


def add_model_args(
    p: argparse.ArgumentParser,
    *,
    size: str | None = None,
    families: tuple[str, ...] | None = None,
    size_help: str = "",
) -> None:
    families = tuple(families or sorted(models.FAMILIES))
    sizes = "; ".join(f"{f}: {sizes_text(f, sources=True)}" for f in families)
    p.add_argument("--model", default="llama" if "llama" in families else families[0],
                   metavar="NAME|MODULE:ATTR|hf:PATH",
                   help=f"a shipped model ({', '.join(families)}); a Hugging Face config.json "
                   f"(hf:path/to/config.json or hf:folder; model types "
                   f"{', '.join(models.hf.MODEL_TYPES)}); or your own: "
                   "package.module:attribute or path/to/file.py:attribute naming a "
                   "sharding.Workload or a function returning one")  # fmt: skip
    p.add_argument("--size", default=size,
                   help=f"named size of a shipped model ({sizes}){size_help or '; when unset: tiny'}"
                   "; for your own model, passed as size= to its function")  # fmt: skip


def workload_from_args(args: argparse.Namespace, *, families: tuple[str, ...] | None = None):
    """The `sharding.Workload` that ``--model`` / ``--size`` name (shipped or the user's)."""
    from sharding import Workload, WorkloadError, load_workload

    shipped = {f: models.get_family(f) for f in (families or models.FAMILIES)}
    if args.model.startswith("hf:"):  # a Hugging Face config.json: its family at its sizes
        if args.size is not None:
            raise WorkloadError(f"--size {args.size}: --model {args.model} gives the sizes; "
                                f"leave --size out")  # fmt: skip
        family, cfg = models.hf.read_config(args.model[3:])
        if family.NAME not in shipped:
            raise WorkloadError(f"--model {args.model}: a {family.NAME} model; this command "
                                f"takes {', '.join(shipped)}")  # fmt: skip
        # named by where it came from, so tables and the train command plan prints say so
        return Workload.from_family(family, dataclasses.replace(cfg, name=args.model))
    if args.model in models.FAMILIES and args.model not in shipped:
        raise WorkloadError(
            f"--model {args.model}: this command takes {', '.join(shipped)} among the shipped "
            f"models, or your own as module:attribute"
        )
    if args.model in shipped:
        family, size = shipped[args.model], args.size or "tiny"
        if size not in family.SIZES:
            raise WorkloadError(
                f"--size {size!r}: unknown {args.model} size; sizes: {', '.join(family.SIZES)}"
            )
        return load_workload(args.model, size=size, shipped=shipped)
    return load_workload(args.model, size=args.size, shipped=shipped)

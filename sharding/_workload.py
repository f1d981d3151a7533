"""The model contract: a `Workload` is everything spmdkit needs to know about a model.

Every command and library entry point takes one: `build_program`, `fit`, `compare`, `plan`,
`explain`, `reshard`, and the CLI's ``--model package.module:attribute``. The shipped families
are workloads too (`Workload.from_family`), so nothing downstream has a special path for them.

What a model must provide, and nothing more:

- ``model(rngs) -> nnx.Module``, and ``loss(model, batch) -> scalar`` (float32): the user's own
  function, run as written under every strategy and every pipeline schedule;
- ``batch_shapes(batch, seq) -> {name: jax.ShapeDtypeStruct}``: the global batch, batch first;
- ``rules``: a `partition_rules.Rules` table (regex over parameter paths -> logical axes), and
  ``names``: which of your logical names play the shipped roles (``{"embed": "hidden"}``), so
  every shipped strategy applies to your table (`partition_rules.strategy`);
- optionally ``stack``: the module path of the layer stack (built with
  `models.layers.make_stacked`, called once as ``self.blocks(h, *extras)``): needed for
  pipelines and remat, which spmdkit applies through that call;
- optionally ``kernels``: a context manager factory ``kernels(**{name: fn})`` under which the
  model's attention / expert layers run the given kernels (`models.kernels.use` for models built
  from `models.layers`): needed for context and expert parallelism, which spmdkit applies by
  substituting distributed kernels while it traces the loss.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from partition_rules import AxisMap, Rules, strategy
from sharding._errors import SpmdkitError
from sharding._stack import find_stack, n_layers


class WorkloadError(SpmdkitError):
    """A workload that cannot be used, or a ``--model`` that names none."""


@dataclass(frozen=True)
class Workload:
    """A model as spmdkit sees it: factory, loss, batch shapes, partition rules, layer stack.

    Attributes:
        name: shown in tables and file names.
        model: ``rngs -> nnx.Module`` (called abstractly for shapes, inside jit for values).
        loss: ``(model, batch) -> scalar``; pipelines run exactly this function (1f1b per
            micro-batch, so there it must be a mean over the batch's rows).
        batch_shapes: ``(batch, seq) -> {name: ShapeDtypeStruct}`` with the batch first.
        rules: the partition rule table over your parameter paths.
        names: shipped logical axis -> your name(s), for strategies (`partition_rules.strategy`).
        stack: module path of the layer stack, or None (no pipelines, no toolkit remat).
        seq: default sequence length; None for a batch without one (images, features).
        make_batch: ``(batch, seq, key) -> {name: array}`` synthetic data for measuring and
            smoke runs (default: zeros of `batch_shapes`).
        check_batch: ``batch -> None`` raising for a host batch the model cannot take.
        kernels: ``(**{name: fn}) -> context manager`` substituting the model's kernels
            (`models.kernels.use`), or None (no context or expert parallelism).
        attention: ``kind -> kernel``, the attention kernels the model offers by name
            (`models.attention.kernel`: "blockwise", "xla", "cudnn", "splash"), for
            ``build_program(..., attention=kind)``; None: only the model's own.
        attention_core: the online softmax the model's attention is built from
            (`models.attention.ONLINE_SOFTMAX`: block steps ``grouped``, ``scores``,
            ``forward_block``, ``finish``, ``backward_block`` and the reference
            ``masked_attention``, ``causal_mask``), which context parallelism's kernels run on
            the blocks they hold; None: no context parallelism.
        family, config: set for the shipped families (closed-form cost predictions).
    """

    name: str
    model: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable[[nnx.Module, dict], jax.Array]
    batch_shapes: Callable[[int, int | None], dict[str, jax.ShapeDtypeStruct]]
    rules: Rules
    names: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    stack: str | None = None
    seq: int | None = None
    make_batch: Callable[[int, int | None, jax.Array], dict] | None = None
    check_batch: Callable[[dict], None] | None = None
    kernels: Callable[..., Any] | None = None
    attention: Callable[[str], Callable] | None = None
    attention_core: Any = None
    family: Any = None
    config: Any = None

    def __post_init__(self) -> None:
        for attr in ("model", "loss", "batch_shapes"):
            if not callable(getattr(self, attr)):
                raise WorkloadError(
                    f"Workload({self.name!r}).{attr} is {getattr(self, attr)!r}; give a function "
                    f"({_SIGNATURES[attr]})"
                )
        if not isinstance(self.rules, Rules):
            raise WorkloadError(
                f"Workload({self.name!r}).rules is a {type(self.rules).__name__}; give a "
                f"partition_rules.Rules([(regex, logical_axes), ...])"
            )
        if self.stack is not None and not (isinstance(self.stack, str) and self.stack.strip("/")):
            raise WorkloadError(
                f"Workload({self.name!r}).stack is {self.stack!r}; give the module path of the "
                f"layer stack, e.g. 'layers' or 'decoder/blocks', or None"
            )
        if self.kernels is not None and not callable(self.kernels):
            raise WorkloadError(
                f"Workload({self.name!r}).kernels is {self.kernels!r}; give a context manager "
                f"factory (**{{name: fn}}) -> with-block, e.g. models.kernels.use, or None"
            )

    @property
    def unit(self) -> str:
        """What a step processes: tokens (a sequence axis) or samples."""
        return "tokens" if self.seq else "samples"

    def axis_map(self, strategy_name: str) -> AxisMap:
        """The named (or composed) strategy over this workload's logical names."""
        return strategy(strategy_name, **dict(self.names))

    def places(self, logical: str) -> bool:
        """Whether the rules put a dimension on the shipped logical axis ``logical`` (under
        the name ``names`` gives it): ``places("experts")`` is whether it has experts."""
        named = self.names.get(logical, logical)
        named = {named} if isinstance(named, str) else set(named)
        used = {a for rule in self.rules for entry in (rule.axes or ())
                for a in ((entry,) if isinstance(entry, str) else (entry or ()))}  # fmt: skip
        return bool(named & used)

    def abstract(self) -> nnx.Module:
        """The model with `jax.ShapeDtypeStruct` parameters (no memory, any size)."""
        return nnx.eval_shape(lambda: self.model(nnx.Rngs(0)))

    def depth(self) -> int | None:
        """Layers in the stack (None without a stack)."""
        return None if self.stack is None else n_layers(find_stack(self.abstract(), self.stack))

    def synthetic_batch(self, batch: int, seq: int | None = None, seed: int = 0) -> dict:
        """`make_batch`, or zeros shaped like `batch_shapes`."""
        if self.make_batch is not None:
            return self.make_batch(batch, seq, jax.random.key(seed))
        shapes = self.batch_shapes(batch, seq)
        return {k: jax.numpy.zeros(v.shape, v.dtype) for k, v in shapes.items()}

    def param_count(self) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(self.abstract(), nnx.Param)))

    def seq_refusal(self, seq: int) -> str | None:
        """Why ``seq`` positions are more than the model holds (its config's ``max_seq_len``),
        and what to change: a shorter --seq, or a size of its family that holds them (only those
        of the same depth and width where there are any: llama 70b -> 3-70b); None where they
        fit or nothing limits them."""
        limit = getattr(self.config, "max_seq_len", None)
        if limit is None or seq <= limit:
            return None
        name = self.name if self.family is None else (
            f"{self.family.NAME} {getattr(self.config, 'name', self.name)}")  # fmt: skip
        text = f"--seq {seq}: {name} holds at most {limit} positions; use --seq {limit} or less"
        hold = sizes_with(self.family, "max_seq_len", seq)
        same = [k for k in hold if all(getattr(self.family.SIZES[k], a, None)
                                       == getattr(self.config, a, 0)
                                       for a in ("n_layers", "d_model"))]  # fmt: skip
        if same:
            return f"{text}, or --size {' or '.join(same)} (same layers and width; holds {seq})"
        if hold:
            return f"{text}, or a --size that holds {seq}: {', '.join(hold)}"
        return text

    @classmethod
    def from_family(cls, family: Any, cfg: Any) -> Workload:
        """A shipped family module (`models.llama`, ...) at one config, as a workload."""
        from partition_rules import family_rules

        seq = getattr(cfg, "max_seq_len", None)
        return cls(
            name=f"{family.NAME}-{cfg.name}",
            model=lambda rngs: family.Model(cfg, rngs=rngs),
            loss=family.loss,
            batch_shapes=lambda b, s=None: family.batch_shapes(cfg, b, s),
            rules=family_rules(family.NAME),
            stack="layers",
            seq=min(seq, 128) if seq else None,
            make_batch=lambda b, s, key: family.make_batch(cfg, b, s, key=key),
            check_batch=lambda batch: family.check_batch(cfg, batch),
            kernels=getattr(family, "use_kernels", None),
            attention=getattr(family, "attention_kernel", None),
            attention_core=getattr(family, "attention_core", None),
            family=family,
            config=cfg,
        )


def sizes_with(family: Any, field: str, least: int) -> list[str]:
    """The sizes of a shipped family (its ``SIZES``) whose config's ``field`` is at least
    ``least`` (``max_seq_len``, ``vocab_size``), in the family's order; [] for none or no
    family."""
    sizes = getattr(family, "SIZES", None) or {}
    return [k for k, c in sizes.items() if (getattr(c, field, None) or 0) >= least]


_SIGNATURES = {
    "model": "rngs -> nnx.Module",
    "loss": "(model, batch) -> scalar",
    "batch_shapes": "(batch, seq) -> {name: jax.ShapeDtypeStruct}",
}


def load_workload(
    spec: Any, *, size: str | None = None, shipped: Mapping[str, Any] | None = None
) -> Workload:
    """The workload ``spec`` names: a `Workload`; a shipped family name (``shipped[name]``,
    at ``size``); ``"package.module:attribute"`` or ``"path/to/file.py:attribute"``, where the
    attribute is a Workload or a function returning one (called with ``size=`` when given).

    Example:
        >>> load_workload("my_models.vit:workload")  # doctest: +SKIP
    """
    shipped = shipped or {}
    if isinstance(spec, Workload):
        return spec
    if not isinstance(spec, str):
        family = spec
        if not hasattr(family, "NAME"):
            raise WorkloadError(f"model {spec!r}: give a Workload, a family name or 'module:attr'")
        return Workload.from_family(family, family.config(size or "tiny"))
    if spec in shipped:
        family = shipped[spec]
        return Workload.from_family(family, family.config(size or "tiny"))
    if ":" not in spec:
        raise WorkloadError(
            f"--model {spec!r}: not a shipped model ({', '.join(sorted(shipped)) or 'none'}) and not "
            f"'package.module:attribute' or 'file.py:attribute' naming your Workload"
        )
    where, attr = spec.rsplit(":", 1)
    module = _import(spec, where)
    if not hasattr(module, attr):
        own = [k for k, v in vars(module).items() if not k.startswith("_") and (
            isinstance(v, Workload)
            or (inspect.isfunction(v) and v.__module__ == module.__name__))]  # fmt: skip
        raise WorkloadError(
            f"--model {spec!r}: {where} has no attribute {attr!r}; it defines "
            f"{', '.join(own) or 'no workload and no function'}"
        )
    value = getattr(module, attr)
    if not isinstance(value, Workload) and callable(value):
        signature = inspect.signature(value)
        kwargs = {} if size is None else {"size": size}
        if size is not None and "size" not in signature.parameters:
            raise WorkloadError(
                f"--size {size}: {spec} takes no size= argument; leave --size out or give the "
                f"function a size parameter"
            )
        try:
            signature.bind(**kwargs)
        except TypeError:
            raise WorkloadError(
                f"--model {spec!r}: {attr} is a function of ({', '.join(signature.parameters)}); "
                f"name a sharding.Workload or a function returning one (called with no "
                f"arguments, or with size=)"
            ) from None
        value = value(**kwargs)
    if not isinstance(value, Workload):
        raise WorkloadError(
            f"--model {spec!r} gave a {type(value).__name__}; it must be a sharding.Workload or "
            f"a function returning one"
        )
    return value


def _import(spec: str, where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise WorkloadError(f"--model {spec!r}: no file {str(path)!r}")
        module_spec = importlib.util.spec_from_file_location(f"spmdkit_user_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise WorkloadError(
            f"--model {spec!r}: cannot import {where!r} ({e}); install the package, or name the "
            f"file instead: --model path/to/{where.rsplit('.', 1)[-1]}.py:attribute"
        ) from e


__all__ = ["Workload", "WorkloadError", "load_workload"]

"""Layouts: which strategy on which mesh (and pipeline schedule), enumerated once for every use.

A `Layout` is one way to split a model over devices. `layouts` lists them: for `spmdkit compare`
each strategy on the one mesh shape that suits it (later shapes as fallbacks), for `spmdkit plan`
(``search=True``) every factorisation of the devices the strategy's rules can use. Both measure
or predict the same `Layout` objects, and `Layout.program` builds the training step of one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from partition_rules import STRATEGIES, CompositionError, composition
from sharding._mesh import AXES, BATCH_AXES, MeshSpec, mesh_text
from sharding._recipe import build_program, pipeline_for
from sharding.costmodel._predict import CostModelError
from sharding.costmodel._shapes import _divisors, _node_wide, _suggested, splits
from sharding.pipeline import EXPLICIT, PipelineSpec

# Layouts in order: the guides' three families, their hybrids, the sequence and expert splits.
ORDER = ("dp", "fsdp", "tp", "dp_tp", "fsdp_tp", "pp", "pp_tp", "pp_fsdp", "tp_sp", "fsdp_tp_sp",
         "cp", "fsdp_cp", "cp_tp_sp", "ep", "fsdp_ep", "ep_tp", "fsdp+tp+pp")  # fmt: skip
DEFAULT = ORDER[:8]  # what every model is offered when no strategy is named
# Compositions without a name that plan's search tries beside DEFAULT (any composition can be
# named): ZeRO-3 in tensor-split stages, the largest dense runs' layout (torchtitan 405B: fsdp 8
# x tensor 8 x pp 8).
PRICED_COMPOSITIONS = ("fsdp+tp+pp", "zero1", "zero1+tp", "zero1+tp+pp")
# From this sequence length on, compare and plan also offer the sequence splits to a model whose
# attention can run split (Megatron SP, context parallelism): below it attention's activations
# are small beside the weights and the splits only add traffic.
LONG_SEQUENCE = 2048
SEQUENCE_STRATEGIES = ("tp_sp", "cp", "fsdp_cp")
# Offered to a model whose rules place an expert dimension (a mixture of experts).
EXPERT_STRATEGIES = ("ep", "fsdp_ep", "ep_tp")
# The schedules `spmdkit compare` runs each pipeline strategy under, and `spmdkit plan` searches
# (interleaved where each stage's layers split into 2 chunks). Chunked ones take 2 repeats.
COMPARE_SCHEDULES = {"pp": ("gpipe", "1f1b", "interleaved", "zb-h1", "circular")}
SEARCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CHUNKED = ("circular", "interleaved")


class UnknownStrategyError(CostModelError):
    """A strategy name that is not a preset of `partition_rules.STRATEGIES`."""


@dataclass(frozen=True)
class Layout:
    """One strategy on one mesh and, for pipeline strategies, one schedule.

    Example:
        >>> Layout("pp", "stage=4,data=2", "gpipe", 8).label
        'pp gpipe m=8'
        >>> Layout("fsdp_tp", "fsdp=4,tensor=2").sizes
        {'stage': 1, 'data': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 2}
    """

    strategy: str
    mesh: str  # the mesh's text, e.g. "data=4,tensor=2" (`sharding.mesh_text`)
    schedule: str | None = None
    microbatches: int | None = None
    repeats: int = 1
    fallback: bool = False  # another shape, tried only if the ones before it failed
    # "auto": stages whose layer counts differ (the stack does not split evenly over them),
    # priced by the closed form; spmdkit's own step needs the stages to divide the layers.
    stage_layers: str | None = None

    @property
    def label(self) -> str:
        if self.schedule is None:
            return self.strategy
        r = f" r={self.repeats}" if self.repeats > 1 else ""
        uneven = " uneven" if self.stage_layers else ""
        return f"{self.strategy} {self.schedule} m={self.microbatches}{r}{uneven}"

    @property
    def sizes(self) -> dict[str, int]:
        """Every mesh axis' size, in canonical order (`sharding.AXES`)."""
        return MeshSpec.of(self.mesh).sizes

    def pipeline(self) -> PipelineSpec | None:
        """The `PipelineSpec` of a pipeline layout, or None."""
        if self.schedule is None:
            return None
        spec = pipeline_for(self.strategy, self.sizes["stage"], schedule=self.schedule,
                            microbatches=self.microbatches, repeats=self.repeats)  # fmt: skip
        return spec if self.stage_layers is None else replace(spec, stage_layers=self.stage_layers)

    def program(
        self,
        workload: Any,
        *,
        batch: int,
        seq: int | None,
        optimizer: Any,
        dtype: str = "float32",
        remat: str = "none",
        accum_steps: int = 1,
        devices: list | None = None,
        attention: str | None = None,
    ) -> Any:
        """The `TrainProgram` of this layout on ``devices`` (default: all), by the one recipe
        `sharding.build_program` (the workload's rules under this strategy).

        Nothing compiles until ``program.compiled`` (or ``report()``, ``step``) is first used,
        so ``program.abstract_state`` can be sized for any model first.

        Example (with ``work`` a `sharding.Workload`):
            >>> import optax
            >>> program = Layout("fsdp", "fsdp=8").program(  # doctest: +SKIP
            ...     work, batch=16, seq=32, optimizer=optax.adamw(1e-3))
        """
        piped = self.schedule is not None
        # The explicit schedules run the head on the last stage: balance the stages around it.
        balanced = "auto" if self.schedule in EXPLICIT else None
        return build_program(
            workload, self.strategy, self.mesh, batch=batch, seq=seq, optimizer=optimizer,
            compute_dtype=dtype, remat=remat, accum_steps=accum_steps, schedule=self.schedule,
            microbatches=self.microbatches, repeats=self.repeats if piped else None,
            stage_layers=balanced, devices=devices, attention=attention,
        )  # fmt: skip


def called_for(work: Any, seq: int | None) -> tuple[str, ...]:
    """The strategies beyond `DEFAULT` a workload calls for: the sequence splits from
    ``seq >= LONG_SEQUENCE`` on when its attention can run split (it has a kernel seam,
    ``work.kernels``), the expert splits when its rules place an expert dimension (logical
    ``"experts"``, or the name ``work.names`` gives it).

    Example (with ``llama`` the model family module ``models.llama``):
        >>> from sharding import Workload
        >>> called_for(Workload.from_family(llama, llama.config("tiny")), 4096)
        ('tp_sp', 'cp', 'fsdp_cp')
    """
    long = seq is not None and seq >= LONG_SEQUENCE and work.kernels is not None
    experts = EXPERT_STRATEGIES if work.places("experts") else ()
    return (SEQUENCE_STRATEGIES if long else ()) + experts


def strategy_names(strategies: str | Sequence[str] | None, extra: Sequence[str] = ()) -> list[str]:
    """The strategies asked for (a comma list or a sequence), once each: named ones in `ORDER`,
    then compositions without a name as given.

    None: `DEFAULT` plus ``extra``, the strategies the model calls for (`called_for`); the
    others run when named.

    Example:
        >>> strategy_names("pp,dp,dp")
        ['dp', 'pp']
        >>> strategy_names(None, ("cp",))[-2:]
        ['pp_fsdp', 'cp']
    """
    if strategies is None:
        wanted = [*DEFAULT, *extra]
    elif isinstance(strategies, str):
        wanted = [s.strip() for s in strategies.split(",")]
    else:
        wanted = list(strategies)
    unknown = [s for s in wanted if not _known(s)]
    if unknown or not wanted:
        raise UnknownStrategyError(
            f"--strategies {','.join(map(str, wanted))!r}: unknown strategies {unknown}; known: "
            f"{', '.join(STRATEGIES)}, or parts joined by '+' (a comma list, e.g. --strategies "
            f"dp,fsdp+tp)"
        )
    named = [s if s in STRATEGIES else (c := composition(s)).alias or c.name for s in wanted]
    known = [s for s in dict.fromkeys((*ORDER, *STRATEGIES)) if s in named]
    return known + [s for s in dict.fromkeys(named) if s not in known]  # compositions, as given


def _known(strategy: object) -> bool:
    try:
        composition(strategy)
    except CompositionError:
        return False
    return True


def meshes(
    devices: int, axes: Sequence[str] = ("stage", "data", "fsdp", "tensor")
) -> list[dict[str, int]]:
    """Every mesh whose ``axes`` multiply to ``devices`` (every other axis 1), as full sizes.

    Example:
        >>> len(meshes(8))  # 3 factors of 2 over 4 axes
        20
        >>> [m["context"] for m in meshes(8, ("data", "context"))]
        [8, 4, 2, 1]
    """
    axes = sorted(axes, key=AXES.index)
    out: list[dict[str, int]] = []

    def fill(i: int, left: int, sizes: dict[str, int]) -> None:
        if i == len(axes) - 1:
            out.append({a: {**sizes, axes[i]: left}.get(a, 1) for a in AXES})
            return
        for k in range(1, left + 1):
            if left % k == 0:
                fill(i + 1, left // k, {**sizes, axes[i]: k})

    fill(0, devices, {})
    return out


def layouts(
    devices: int,
    n_layers: int,
    *,
    strategies: str | Sequence[str] | None = None,
    mesh: str | dict | None = None,
    search: bool = False,
    batch: int | None = None,
    per_node: int | None = None,
    extra: Sequence[str] = (),
    rejected: list[dict] | None = None,
) -> list[Layout]:
    """The layouts to try on ``devices`` devices for a model of ``n_layers`` layers.

    Without ``search`` (`spmdkit compare`), each strategy on the shape that suits it (later
    shapes of the same strategy marked ``fallback``), pipelines with 2 x stages micro-batches,
    ``pp`` under gpipe, 1f1b, interleaved, zb-h1 and circular (interleaved and circular with 2
    repeats, on as many stages as the layers allow). With ``search`` (`spmdkit plan`), every
    factorisation of the devices the strategy's rules can use (``tp`` and ``dp_tp`` one map,
    named by the data axis), pipelines under gpipe, 1f1b, zb-h1 and (where each stage's layers
    split in 2) interleaved with the most micro-batches of 4p, 2p, p that ``batch`` splits into. With ``mesh`` every strategy
    runs on that one mesh. compare's pipelines need their stages (times repeats) to divide
    ``n_layers``; the search's take uneven stages (``stage_layers="auto"``) where they do not.
    Given ``batch``, compare's pipelines take 2 x stages micro-batches, or stages, whichever the
    batch splits into. With ``per_node`` (devices per node of a multi-node target) the tensor
    strategies are also tried with tensor spanning one node, the data or fsdp axis across nodes.
    ``rejected``, a list, receives ``{"layout", "mesh", "reason"}`` for each searched layout
    left out.

    Example:
        >>> [x.label for x in layouts(8, 4, strategies="dp,pp")]  # doctest: +NORMALIZE_WHITESPACE
        ['dp', 'pp gpipe m=8', 'pp 1f1b m=8', 'pp interleaved m=4 r=2', 'pp zb-h1 m=8',
         'pp circular m=4 r=2']
        >>> len(layouts(8, 4, strategies="fsdp", search=True, batch=8))
        3
    """
    names = strategy_names(strategies, (*extra, *PRICED_COMPOSITIONS) if search else extra)
    if search and "tp" in names and "dp_tp" in names:  # one axis map: tp with data > 1 is dp_tp
        names.remove("dp_tp")
    given = None if mesh is None else MeshSpec.of(mesh).resolve(devices).sizes
    out: list[Layout] = []
    for name in names:
        if given is not None:
            shapes = [given]
        elif search:
            allowed, needs = splits(name)
            shapes = [s for s in meshes(devices, tuple(allowed)) if all(s[a] > 1 for a in needs)]
        else:
            shapes = [MeshSpec.of(t).resolve(devices).sizes for t in _suggested(name, devices)]
        node_wide = _node_wide(name, devices, per_node) if given is None and not search else []
        for alt, sizes in enumerate(shapes):
            strategy = name
            if search and name in ("tp", "dp_tp"):
                strategy = "dp_tp" if sizes["data"] > 1 else "tp"
            if not composition(strategy).pipelined:
                out.append(Layout(strategy, mesh_text(sizes), fallback=alt > 0 and not search))
                continue
            if search:
                pipes = _searched_pipelines(sizes, n_layers, batch)
                if not pipes and rejected is not None:
                    rejected.append({"layout": f"{strategy} (pipelined)", "mesh": mesh_text(sizes),
                                     "reason": _no_pipeline(sizes, n_layers, batch)})  # fmt: skip
            else:
                pipes = [(*x, None) for x in _compare_pipelines(
                    name, sizes, n_layers, devices, fixed=given is not None, batch=batch)]  # fmt: skip
            out += [Layout(strategy, mesh_text(at), s, m, r, stage_layers=u)
                    for s, m, r, at, u in pipes]  # fmt: skip
        for text in node_wide:
            sizes = MeshSpec.of(text).resolve(devices).sizes
            if mesh_text(sizes) in {x.mesh for x in out if x.strategy == name}:
                continue
            if composition(name).pipelined:
                pipes = _compare_pipelines(name, sizes, n_layers, devices, fixed=True, batch=batch)
                out += [Layout(name, mesh_text(at), s, m, r) for s, m, r, at in pipes]
            else:
                out.append(Layout(name, mesh_text(sizes)))
    return out


def _compare_pipelines(
    name: str,
    sizes: dict[str, int],
    n_layers: int,
    devices: int,
    *,
    fixed: bool,
    batch: int | None = None,
) -> list[tuple[str, int, int, dict[str, int]]]:
    out = []
    for schedule in COMPARE_SCHEDULES.get(name, ("gpipe",)):
        repeats = 2 if schedule in CHUNKED else 1
        at = sizes
        if not fixed and repeats > 1:  # as many stages as the layers allow
            stages = next((s for s in _divisors(devices) if 1 < s <= n_layers // 2
                           and n_layers % (2 * s) == 0), 0)  # fmt: skip
            at = {"stage": stages, "data": devices // max(stages, 1), "fsdp": 1, "tensor": 1}
        stages = at["stage"]
        if stages < 2 or n_layers % (stages * repeats):
            continue
        split = at["data"] * at["fsdp"] * at.get("expert", 1)
        fitting = [m for m in (2 * stages, stages) if batch is None or batch % (m * split) == 0]
        out.append((schedule, fitting[0] if fitting else 2 * stages, repeats, at))
    return out


def _no_pipeline(sizes: dict[str, int], n_layers: int, batch: int | None) -> str:
    p = sizes["stage"]
    if n_layers < p:
        return f"{n_layers} layers on stage={p}: every stage needs a layer"
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    if batch is None or batch % shards:
        return f"the global batch {batch} does not split over data x fsdp x expert = {shards}"
    return (f"the batch's {batch // shards} rows per data x fsdp x expert shard do not split "
            f"into at least stage={p} micro-batches")  # fmt: skip


def _searched_pipelines(
    sizes: dict[str, int], n_layers: int, batch: int | None
) -> list[tuple[str, int, int, dict[str, int], str | None]]:
    """``(schedule, microbatches, repeats, sizes, stage_layers)`` of each pipeline searched."""
    from sharding.costmodel._batching import pipeline_microbatches

    p = sizes["stage"]
    if batch is None or p < 2 or n_layers < p:
        return []
    m = pipeline_microbatches(sizes, batch)  # the most of 4p, 2p, p: a smaller bubble
    if m is None:
        return []
    # Stages that do not divide the layers take uneven counts ("auto"), as Llama 3 405B's 126
    # layers on 16 stages did; chunked schedules only where each chunk's layers are even.
    return [
        (schedule, m, 2 if schedule in CHUNKED else 1, sizes,
         None if n_layers % p == 0 else "auto")
        for schedule in SEARCH_SCHEDULES
        if schedule not in CHUNKED or n_layers % (2 * p) == 0
    ]  # fmt: skip


__all__ = [
    "DEFAULT",
    "EXPERT_STRATEGIES",
    "LONG_SEQUENCE",
    "ORDER",
    "PRICED_COMPOSITIONS",
    "SEQUENCE_STRATEGIES",
    "Layout",
    "UnknownStrategyError",
    "called_for",
    "layouts",
    "meshes",
    "splits",
    "strategy_names",
]

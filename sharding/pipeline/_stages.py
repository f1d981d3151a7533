"""What each pipeline stage holds and computes, and what pipelining costs in FLOPs.

`stage_report` makes an unbalanced split visible before anything runs: the layers each stage
owns, its parameter bytes, and its matmul FLOPs per micro-batch, with the embedding and head
charged where the schedule runs them (1f1b, interleaved, zb-h1: head and loss on the last stage
inside the pipeline; gpipe/circular: outside it, split over every device). `balanced_stages`
measures any workload's layer and head costs and picks the layers per stage that even them out.

`stack_flop_overhead` measures the price of the bubble from compiled programs: the matmul FLOPs
of the pipelined layer stack (forward and backward, summed over all devices) over those of the
same stack run without a pipeline on one device (no remat in either).
Bubble ticks compute on zeros, so the ratio is (m+p-1)/m for gpipe and (r*m+p-1)/(r*m) for
circular, up to what `count_flops` cannot see (dots XLA rewrites into multiplies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import sharding as jshard
from rich.table import Table

from sharding._stack import apply_layers, find_stack, layer_class, n_layers, taken_over
from sharding._units import fmt_bytes, fmt_count
from sharding.inspection import count_flops
from sharding.pipeline._balance import balance_layers, check_stage_layers, layer_slots
from sharding.pipeline._layers import Layers
from sharding.pipeline._loss import Extras
from sharding.pipeline._scan import PipelineSpec, scan_pipeline, to_microbatches
from sharding.pipeline._schedule import EXPLICIT, check_layers
from sharding.pipeline._split import Split


@dataclass(frozen=True)
class StageLoad:
    """One stage: the layers it owns (model order), their bytes, and forward matmul FLOPs per
    micro-batch, the head's included where it runs on this stage."""

    stage: int
    layers: tuple[int, ...]
    param_bytes: int
    forward_flops: int


@dataclass(frozen=True)
class StageReport:
    """Per-stage loads plus the parameters every stage also holds (embedding, head, norms)."""

    schedule: str
    stages: tuple[StageLoad, ...]
    shared_param_bytes: int
    shared_forward_flops: int
    microbatch_rows: int

    @property
    def imbalance(self) -> float:
        """Slowest stage's forward FLOPs over the mean: 1.0 is balanced."""
        flops = [s.forward_flops for s in self.stages]
        return max(flops) * len(flops) / sum(flops)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "imbalance": self.imbalance}

    def __rich__(self) -> Table:
        table = Table(title=f"{self.schedule}: per-stage load (micro-batch of "
                            f"{self.microbatch_rows} rows)")  # fmt: skip
        for col in ("stage", "layers", "params", "fwd FLOPs / micro-batch"):
            table.add_column(col, justify="left" if col == "layers" else "right")
        for s in self.stages:
            layers = ",".join(map(str, s.layers))
            table.add_row(
                str(s.stage), layers, fmt_bytes(s.param_bytes), fmt_count(s.forward_flops)
            )
        shared = "the last stage" if self.schedule in EXPLICIT else "outside the pipeline"
        table.add_row("shared", f"embedding, head ({shared})", fmt_bytes(self.shared_param_bytes),
                      fmt_count(self.shared_forward_flops), style="dim")  # fmt: skip
        table.caption = f"imbalance (slowest / mean stage): {self.imbalance:.3f}"
        return table


def _bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _flops(fn: Any, *args: Any) -> int:
    """Matmul FLOPs of ``fn(*args)`` compiled for one device (args may be abstract)."""
    return count_flops(jax.jit(fn).lower(*args).compile().as_text()).total


def _embedded_shape(model: nnx.Module, rows: int, seq_len: int) -> jax.ShapeDtypeStruct:
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
    return jax.eval_shape(lambda st, t: nnx.merge(graphdef, st).embed(t), state, tokens)


def _costs(model: nnx.Module, microbatch_rows: int, seq_len: int) -> tuple[Any, int, int, int]:
    """(the stacked layers' state, their count, one layer's and the head's forward FLOPs)."""
    gdef, layers = nnx.split(model.layers)
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    h = _embedded_shape(model, microbatch_rows, seq_len)
    one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), layers)
    call = (layer_class(model.layers) or type(model.layers)).__call__
    layer_flops = _flops(lambda w, x: call(nnx.merge(gdef, w), x), one, h)
    graphdef, state = nnx.split(model)
    shared = nnx.State({k: v for k, v in state.items() if k != "layers"})

    def head(rest: Any, x: jax.Array) -> jax.Array:
        full = nnx.State({**dict(rest), "layers": state["layers"]})
        return nnx.merge(graphdef, full).head(x)

    return layers, n_layers, layer_flops, _flops(head, shared, h)


def stage_report(
    model: nnx.Module, spec: PipelineSpec, stages: int, microbatch_rows: int, seq_len: int
) -> StageReport:
    """Per-stage parameter bytes and forward FLOPs of ``model`` pipelined as ``spec``
    (``spec.stage_layers`` for balanced stages).

    ``model`` may be abstract (`nnx.eval_shape`); FLOPs come from compiling one layer and the
    head for one micro-batch on one device, so it works for sizes that do not fit here.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> model = nnx.eval_shape(lambda: llama.Model(llama.config("tiny"), rngs=nnx.Rngs(0)))
        >>> stage_report(model, PipelineSpec("1f1b", 8), 2, 4, 128).imbalance  # doctest: +SKIP
        1.06
    """
    layers, n_layers, layer_flops, head_flops = _costs(model, microbatch_rows, seq_len)
    if spec.stage_layers is None:
        counts = (check_layers(n_layers, stages, spec.repeats),) * (stages * spec.repeats)
    else:
        counts = check_stage_layers(spec.stage_layers, n_layers, stages, spec.repeats)
    index, valid = layer_slots(counts, stages, spec.repeats)
    loads = []
    for s in range(stages):
        owned = tuple(int(i) for i in index[s][valid[s]])
        on_last = spec.schedule in EXPLICIT and s == stages - 1
        loads.append(
            StageLoad(
                stage=s,
                layers=owned,
                param_bytes=_bytes(layers) * len(owned) // n_layers,
                forward_flops=layer_flops * len(owned) + (head_flops if on_last else 0),
            )
        )
    shared = nnx.State({k: v for k, v in nnx.split(model)[1].items() if k != "layers"})
    return StageReport(
        schedule=spec.schedule,
        stages=tuple(loads),
        shared_param_bytes=_bytes(shared),
        shared_forward_flops=head_flops,
        microbatch_rows=microbatch_rows,
    )


class _AtStack:
    """A workload's loss, abstractly (``state``, ``batch`` are shapes), with its stack's call
    handed to a function: the one way `workload_stage_costs` and `stage_work` build programs."""

    def __init__(self, workload: Any, rows: int, seq_len: int | None):
        self.workload, self.path = workload, workload.stack
        self.graphdef, self.state = nnx.split(nnx.eval_shape(lambda: workload.model(nnx.Rngs(0))))
        self.batch = workload.batch_shapes(rows, seq_len or workload.seq)

    def loss(self, stack_out: Any) -> Any:
        """``(state, batch, *more) -> the loss`` with the stack's output ``stack_out(call,
        *more)``."""

        def run(state: Any, batch: dict, *more: Any) -> jax.Array:
            m = nnx.merge(self.graphdef, state)
            with taken_over(m, self.path, lambda call: stack_out(call, *more)):
                return self.workload.loss(m, batch)

        return run

    def at(self, fn: Any) -> Any:
        """``(state, batch, *more) -> fn(call, *more)``, evaluated where the loss calls the
        stack (what follows it is dead code)."""

        def run(state: Any, batch: dict, *more: Any) -> Any:
            out = {}

            def take(call: Any) -> jax.Array:
                out["value"] = fn(call, *more)
                return call.h

            self.loss(take)(state, batch)
            return out["value"]

        return run


_COSTS: dict[tuple, tuple[Any, dict]] = {}  # (id(workload), rows, seq) -> (workload, costs)


def workload_stage_costs(workload: Any, microbatch_rows: int, seq_len: int | None) -> dict:
    """Matmul FLOPs of one micro-batch through any workload's pieces, compiled on one device:
    ``layer`` (one layer of its stack), ``before`` (the loss up to the stack) and ``after`` (what
    follows the stack: head and loss). Three abstract programs, nothing runs: the loss with the
    stack's output alone, with the stack as the identity, and with one layer in its place.
    """
    key = (id(workload), microbatch_rows, seq_len)
    if key in _COSTS and _COSTS[key][0] is workload:  # compare asks once per candidate
        return dict(_COSTS[key][1])
    at = _AtStack(workload, microbatch_rows, seq_len)

    def one_layer(call: Any) -> jax.Array:
        first = jax.tree.map(lambda w: w[0], call.state)
        return call.apply_layer(first, call.h, call.args, call.kwargs)

    before = _flops(at.at(lambda call: call.h), at.state, at.batch)
    identity = _flops(at.loss(lambda call: call.h), at.state, at.batch)
    layered = _flops(at.loss(one_layer), at.state, at.batch)
    costs = {"layer": layered - identity, "before": before, "after": identity - before}
    _COSTS[key] = (workload, costs)
    return dict(costs)


def stage_work(
    workload: Any, layers: int, microbatch_rows: int, seq_len: int | None, remat: str = "none"
) -> dict[str, int]:
    """Matmul FLOPs of one micro-batch through one stage of ``layers`` layers, compiled on one
    device with the pieces the explicit schedules run (`sharding.pipeline._explicit`):

    ``forward`` (F, residuals kept), ``backward`` (1f1b's B: input and weight gradients),
    ``input_grad`` and ``weight_grad`` (zb-h1's B and W; they add up to ``backward``), and
    ``head_forward`` / ``head_backward``: what follows the stack (head and loss), forward and
    its VJP, run by the last stage; ``head_input_grad`` / ``head_weight_grad`` split that VJP as
    zb-h1 runs it (with the forward's B and in its W). Feed them to `Schedule.tick_costs` to price a schedule.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> work = Workload.from_family(llama, llama.config("tiny"))  # doctest: +SKIP
        >>> stage_work(work, 2, 2, 32)["forward"]  # doctest: +SKIP
        10485760
    """

    from sharding._shardings import remat_wrapper  # it imports this package

    at = _AtStack(workload, microbatch_rows, seq_len)
    state, batch, path = at.state, at.batch, at.path

    def pieces(call: Any) -> tuple[Any, Any, list, list]:
        extras = Extras.of(call, path)
        floats = [bool(jnp.issubdtype(x.dtype, jnp.inexact)) for x in extras.arrays]
        chunk = Layers(extras.layer_fn(call), remat_wrapper(remat), floats)
        w = jax.tree.map(lambda a: a[:layers], call.state)
        fex = [x for x, f in zip(extras.arrays, floats, strict=True) if f]
        return chunk, w, fex, extras.arrays

    def forward(call: Any) -> Any:
        chunk, w, fex, ex = pieces(call)
        return chunk.forward(w, call.h, fex, ex)

    def backward(call: Any, res: list, weights: bool) -> Any:
        chunk, w, fex, ex = pieces(call)
        chunk.forward(w, call.h, fex, ex)  # traced for the pullback's structure; dead code
        return chunk.backward(w, res, call.h, fex, weights=weights)

    def weight_grad(call: Any, res: list, boundary: list) -> Any:
        chunk, w, fex, ex = pieces(call)
        chunk.forward(w, call.h, fex, ex)
        return chunk.weight_grad(w, res, boundary, call.h)

    def after(state: Any, batch: dict, y: jax.Array) -> jax.Array:
        """What follows the stack (head and loss), given the stack's output ``y``."""
        return at.loss(lambda _, y: y)(state, batch, y)

    res = jax.eval_shape(at.at(lambda c: forward(c)[1]), state, batch)
    bnd = jax.eval_shape(at.at(lambda c, r: backward(c, r, False)[2]), state, batch, res)
    before = _flops(at.at(lambda call: call.h), state, batch)
    f = _flops(at.at(lambda c: forward(c)[0]), state, batch)
    full = _flops(at.at(lambda c, r: backward(c, r, True)), state, batch, res)
    dx = _flops(at.at(lambda c, r: backward(c, r, False)), state, batch, res)
    dw = _flops(at.at(weight_grad), state, batch, res, bnd)

    def head_split(state: Any, batch: dict, y: jax.Array) -> Split:
        def vjp(state: Any, y: jax.Array, batch: dict) -> list:
            value, pullback = jax.vjp(lambda s_, y_: after(s_, batch, y_), state, y)
            dstate, dy = pullback(jnp.ones_like(value))
            return [*jax.tree.leaves(dstate), dy]

        return Split(vjp, [state, y, batch], len(jax.tree.leaves(state)), keep={0})

    def head_input(state: Any, batch: dict, y: jax.Array) -> tuple:
        return head_split(state, batch, y).input_grads([state, y, batch])

    def head_weight(state: Any, batch: dict, y: jax.Array, kept: list) -> list:
        return head_split(state, batch, y).weight_grads([state], kept)

    y = jax.eval_shape(at.at(lambda call: call.h), state, batch)
    head_f = _flops(after, state, batch, y)
    head_b = _flops(jax.grad(after, argnums=(0, 2)), state, batch, y)
    head_dx = _flops(head_input, state, batch, y)
    kept = jax.eval_shape(head_input, state, batch, y)[1]
    head_dw = _flops(head_weight, state, batch, y, kept)
    return {"forward": f - before, "backward": full - before, "input_grad": dx - before,
            "weight_grad": dw - before, "head_forward": head_f,
            "head_backward": head_b - head_f, "head_input_grad": head_dx - head_f,
            "head_weight_grad": head_dw}  # fmt: skip


def balanced_stages(
    workload: Any, spec: PipelineSpec, stages: int, microbatch_rows: int, seq_len: int | None
) -> tuple[int, ...]:
    """Layers per virtual stage that even out the stages' forward FLOPs for any workload
    (`sharding.Workload`; `Workload.from_family` for a shipped model): `balance_layers` on the
    costs `workload_stage_costs` measures, the last stage carrying what follows the stack under
    1f1b, interleaved and zb-h1 (gpipe and circular run it outside the pipeline).

    Example (with ``llama`` the model family module ``models.llama``, vocabulary 8192):
        >>> work = Workload.from_family(llama, cfg)  # doctest: +SKIP
        >>> balanced_stages(work, PipelineSpec("1f1b", 8), 4, 2, 32)  # doctest: +SKIP
        (5, 5, 5, 1)
    """
    costs = workload_stage_costs(workload, microbatch_rows, seq_len)
    model = nnx.eval_shape(lambda: workload.model(nnx.Rngs(0)))
    depth = n_layers(find_stack(model, workload.stack))
    last = costs["after"] if spec.schedule in EXPLICIT else 0
    return balance_layers(depth, stages, layer=float(max(costs["layer"], 1)), last=float(last),
                          repeats=spec.repeats)  # fmt: skip


def stack_flop_overhead(
    model: nnx.Module, spec: PipelineSpec, mesh: jshard.Mesh, batch: int, seq_len: int
) -> dict[str, float]:
    """Matmul FLOPs of the pipelined layer stack over the unpipelined one (gpipe, circular).

    Both differentiate ``sum(stack(h))`` with respect to the layers and ``h``, neither
    rematerialising anything; the reference runs on one device. Returns
    ``{"pipelined", "reference", "overhead", "theory"}`` (FLOPs summed over devices).
    """
    if spec.schedule in EXPLICIT:
        raise ValueError(
            f"stack_flop_overhead measures gpipe and circular, whose backward is autodiff through "
            f"the tick scan; {spec.schedule}'s ticks branch (lax.cond) between forward and "
            f"backward, and a static count charges every branch: price it with "
            f"sharding.costmodel.work_from_report"
        )
    schedule = spec.table(mesh.shape["stage"])
    gdef, layers = nnx.split(model.layers)
    h = _embedded_shape(model, batch, seq_len)
    call = (layer_class(model.layers) or type(model.layers)).__call__

    def layer_fn(state: Any, x: jax.Array, extras: list) -> jax.Array:
        return call(nnx.merge(gdef, state), x)

    def reference(w: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(apply_layers(layer_fn, w, x, [], None))  # the stack, no remat

    def pipelined(w: Any, x: jax.Array) -> jax.Array:
        x_m = to_microbatches(x, schedule.microbatches, mesh)
        return jnp.sum(scan_pipeline(layer_fn, w, x_m, mesh=mesh, schedule=schedule, wrap=None))

    ref = _flops(jax.grad(reference, argnums=(0, 1)), layers, h)
    stage_sharded = jshard.NamedSharding(mesh, jshard.PartitionSpec("stage"))
    w_in = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=stage_sharded),
                        layers)  # fmt: skip
    x_in = jax.ShapeDtypeStruct(h.shape, h.dtype,
                                sharding=jshard.NamedSharding(mesh, jshard.PartitionSpec("data")))  # fmt: skip
    piped = _flops(jax.grad(pipelined, argnums=(0, 1)), w_in, x_in) * mesh.size
    rm = schedule.repeats * schedule.microbatches
    return {
        "pipelined": float(piped),
        "reference": float(ref),
        "overhead": piped / ref,
        "theory": (rm + schedule.stages - 1) / rm,
    }


__all__ = [
    "StageLoad",
    "StageReport",
    "balanced_stages",
    "stack_flop_overhead",
    "stage_report",
    "stage_work",
    "workload_stage_costs",
]

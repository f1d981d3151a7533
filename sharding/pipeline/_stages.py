"""What each pipeline stage holds and computes, and what pipelining costs in FLOPs.

`stage_report` makes an unbalanced split visible before anything runs: the layers each stage
owns, its parameter bytes, and its matmul FLOPs per micro-batch, with the embedding and head
charged where the schedule runs them (1f1b: head and loss on the last stage inside the pipeline;
gpipe/circular: outside it, split over every device).

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

from sharding._stack import apply_layers, layer_class
from sharding._units import fmt_bytes, fmt_count
from sharding.inspection import count_flops
from sharding.pipeline._scan import PipelineSpec, scan_pipeline, to_microbatches
from sharding.pipeline._schedule import check_layers


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
        shared = "every stage" if self.schedule == "1f1b" else "outside the pipeline"
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


def stage_report(
    model: nnx.Module, spec: PipelineSpec, stages: int, microbatch_rows: int, seq_len: int
) -> StageReport:
    """Per-stage parameter bytes and forward FLOPs of ``model`` pipelined as ``spec``.

    ``model`` may be abstract (`nnx.eval_shape`); FLOPs come from compiling one layer and the
    head for one micro-batch on one device, so it works for sizes that do not fit here.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> model = nnx.eval_shape(lambda: llama.Model(llama.config("tiny"), rngs=nnx.Rngs(0)))
        >>> stage_report(model, PipelineSpec("1f1b", 8), 2, 4, 128).imbalance  # doctest: +SKIP
        1.06
    """
    gdef, layers = nnx.split(model.layers)
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    per = check_layers(n_layers, stages, spec.repeats)
    h = _embedded_shape(model, microbatch_rows, seq_len)
    one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), layers)
    call = (layer_class(model.layers) or type(model.layers)).__call__
    layer_flops = _flops(lambda w, x: call(nnx.merge(gdef, w), x), one, h)
    graphdef, state = nnx.split(model)
    shared = nnx.State({k: v for k, v in state.items() if k != "layers"})

    def head(rest: Any, x: jax.Array) -> jax.Array:
        full = nnx.State({**dict(rest), "layers": state["layers"]})
        return nnx.merge(graphdef, full).head(x)

    head_flops = _flops(head, shared, h)
    loads = []
    for s in range(stages):
        owned = tuple((j * stages + s) * per + i for j in range(spec.repeats) for i in range(per))
        on_last = spec.schedule == "1f1b" and s == stages - 1
        loads.append(
            StageLoad(
                stage=s,
                layers=owned,
                param_bytes=_bytes(layers) * len(owned) // n_layers,
                forward_flops=layer_flops * len(owned) + (head_flops if on_last else 0),
            )
        )
    return StageReport(
        schedule=spec.schedule,
        stages=tuple(loads),
        shared_param_bytes=_bytes(shared),
        shared_forward_flops=head_flops,
        microbatch_rows=microbatch_rows,
    )


def stack_flop_overhead(
    model: nnx.Module, spec: PipelineSpec, mesh: jshard.Mesh, batch: int, seq_len: int
) -> dict[str, float]:
    """Matmul FLOPs of the pipelined layer stack over the unpipelined one (gpipe, circular).

    Both differentiate ``sum(stack(h))`` with respect to the layers and ``h``, neither
    rematerialising anything; the reference runs on one device. Returns
    ``{"pipelined", "reference", "overhead", "theory"}`` (FLOPs summed over devices).
    """
    if spec.schedule == "1f1b":
        raise ValueError(
            "stack_flop_overhead measures gpipe and circular, whose backward is autodiff through "
            "the tick scan; 1f1b's ticks branch between forward and backward (lax.switch), and "
            "a static count charges every branch"
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


__all__ = ["StageLoad", "StageReport", "stack_flop_overhead", "stage_report"]

"""`TrainProgram`: a compiled training step and what it was built from (`compile_train_step`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import sharding as jshard

from sharding._resolve import shard_abstract
from sharding.pipeline import PipelineSpec


@dataclass
class TrainProgram:
    """A compiled training step: `init(seed)` -> state born sharded; `step(state, batch)`.

    Build it with `compile_train_step`. The step is compiled ahead of time from abstract shapes
    on first use (`compiled`), and `report()` inspects that same executable. `unused_rules`: the
    rules that matched no parameter at all (``{index, pattern, reason}``; almost always a typo'd
    regex), also shown by `report()`; a rule shadowed by an earlier one is not listed.
    """

    mesh: jshard.Mesh
    graphdef: nnx.GraphDef
    abstract_state: Any
    state_shardings: Any
    batch_shardings: dict[str, jshard.NamedSharding]
    batch_shapes: dict[str, jax.ShapeDtypeStruct]
    accum_steps: int
    _init_fn: Callable = field(repr=False)
    _step_fn: Callable = field(repr=False)
    _grad_fn: Callable = field(repr=False)
    _eval_fn: Callable = field(repr=False)
    _compiled: Any = field(default=None, repr=False)
    _partitioned: str | None = field(default=None, repr=False)
    compile_time_s: float | None = None
    schedule: Any = None  # the pipeline's `Schedule`, None without a pipeline
    pipeline: PipelineSpec | None = None  # how it was asked for (stage_layers included)
    check_batch: Callable[[dict], None] | None = field(default=None, repr=False)
    unused_rules: list[dict] = field(default_factory=list)
    optimizer_whole: list[str] = field(default_factory=list)  # zero1 arrays no data size divides

    @property
    def param_shardings(self) -> Any:
        return self.state_shardings["params"]

    def init(self, seed: int = 0) -> dict[str, Any]:
        """Train state {params, opt_state, step}, created directly in its shardings."""
        return self._init_fn(jnp.asarray(seed, jnp.uint32))

    def lowered(self) -> Any:
        """The train step lowered from abstract shapes (`jax.stages.Lowered`: the program as
        traced, before XLA partitions it); ``compiled`` compiles it. Traced under the mesh's
        abstract mesh, which names the devices' platform: a model choosing a kernel by platform
        (`models.attention`'s auto) chooses the target's, not this host's."""
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return self._step_fn.lower(
                shard_abstract(self.abstract_state, self.state_shardings),
                shard_abstract(self.batch_shapes, self.batch_shardings),
            )

    @property
    def compiled(self) -> Any:
        if self._compiled is None:
            from sharding.inspection import compile_partitioned

            start = time.perf_counter()
            # The module as partitioned is kept for the collectives' true dtypes (XLA:CPU
            # widens bfloat16 ones to float32 after partitioning; `compile_partitioned`).
            self._compiled, self._partitioned = compile_partitioned(
                self.lowered(),
                self.mesh.devices.flat[0].platform,
                unroll_loops=self.schedule is None,
            )
            self.compile_time_s = time.perf_counter() - start
        return self._compiled

    def step(self, state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict, dict]:
        """One optimizer step; `state` is donated (do not reuse it)."""
        return self.compiled(state, self.shard_batch(batch))

    def loss_and_grads(self, params: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
        """Loss and gradients of one step (accumulated as the step does), without updating."""
        return self._grad_fn(params, self.shard_batch(batch))

    def eval_loss(self, params: Any, batch: dict[str, Any]) -> jax.Array:
        """The loss alone (forward only), with the step's shardings."""
        return self._eval_fn(params, self.shard_batch(batch))

    def lower_eval(self) -> Any:
        """The forward-only program, lowered from abstract shapes (for inspection)."""
        return self._eval_fn.lower(
            shard_abstract(self.abstract_state["params"], self.param_shardings),
            shard_abstract(self.batch_shapes, self.batch_shardings),
        )

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """Place a host batch (the full global batch, single process) in its sharding.

        With ``check_batch`` (e.g. ``models.llama.check_batch`` bound to its config) a batch of
        host arrays is checked first: a token id outside the vocabulary would otherwise gather NaN
        inside the compiled step and train on a NaN loss without a word.
        """
        if self.check_batch is not None and not any(
            isinstance(v, jax.Array) for v in batch.values()
        ):
            self.check_batch(batch)  # host arrays only: reading device arrays back would stall
        return {
            k: v
            if _placed(v, self.batch_shardings[k])
            else jax.device_put(v, self.batch_shardings[k])
            for k, v in batch.items()
        }

    def report(self) -> Any:
        """Collectives, memory and FLOPs of the compiled step (`sharding.ProgramReport`)."""
        from sharding.inspection import inspect_compiled

        compiled = self.compiled
        report = inspect_compiled(compiled, mesh=self.mesh, compile_time_s=self.compile_time_s,
                                  partitioned=self._partitioned)  # fmt: skip
        if self.schedule is not None:
            s = self.schedule
            report.extra["pipeline"] = f"{s.name} stages={s.stages} microbatches={s.microbatches}"
            report.extra["bubble_fraction"] = round(s.bubble_fraction, 4)
        if self.optimizer_whole:
            report.extra["optimizer state kept whole over data (zero1: no dimension divides)"] = (
                ", ".join(self.optimizer_whole)
            )
        if self.unused_rules:
            report.extra["rules that matched no parameter (check the regex)"] = ", ".join(
                f"rule {u['index']} {u['pattern']!r}" for u in self.unused_rules
            )
        return report


def _placed(x: Any, sharding: jshard.NamedSharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding == sharding


__all__ = ["TrainProgram"]

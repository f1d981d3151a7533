"""Lock-step lanes for the explicit schedules (`sharding.pipeline._explicit`).

A collective inside a branch that only some stages take waits forever for the
stages that skip it, unless its group lies inside one stage: an all-reduce over tensor (groups
within a stage) is safe, a collective-permute is not (its one rendezvous is every device of the
program, XLA:CPU's and NCCL's clique alike). XLA inserts such permutes itself when the stage body
is partitioned over an automatic axis (a fused qkv projection split over tensor is cut into q, k
and v by moving columns between shards), and ring attention sends its key/value blocks with one.
So whenever the region leaves a mesh axis of size > 1 automatic, or the chunk's program holds a
``ppermute``, every branch runs in lock-step: its predicate is the tick's ("does any stage run
F now?", from the table, equal on every device), every stage executes it, and a stage the table
leaves idle discards its results (writes masked by its own cell; balanced stages' spare layer
slots computed and discarded, not skipped). 1f1b and interleaved lose nothing by it (each tick
already lasts its slowest stage, and the stages that work in a tick run the same kinds of
action); zb-h1 pays for a tick the union of the kinds its stages run (`Schedule.tick_costs`,
``lockstep=True``). The tick body runs under the named scope ``pipeline_lockstep`` then, so a
compiled program says which it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxprs_in_params

from sharding.pipeline._schedule import Schedule


def sends(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (its sub-programs included) holds a ``ppermute``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            return True
        if any(sends(getattr(sub, "jaxpr", sub)) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


class Lockstep:
    """The branches of one explicit schedule's tick, per stage (``on=False``) or in lock-step.

    ``cells``: the schedule's `tables`. Per tick, from them: whether any stage runs each lane,
    the head (the last virtual stage's F, zb-h1's W) or the embedding (the first stage's first
    chunk, in F and B), equal on every device. Writes take ``on``, the stage's own mask (True:
    none, per-stage branches write unmasked).
    """

    def __init__(self, on: bool, schedule: Schedule, cells: dict[str, np.ndarray]):
        self.on = on
        p, v = schedule.stages, schedule.repeats
        self.anyone = {k: jnp.asarray((cells[f"{k}.micro"] >= 0).any(1)) for k in ("F", "B", "W")}

        def at(kind: str, stage: int, chunk: int) -> jax.Array:
            return jnp.asarray((cells[f"{kind}.micro"][:, stage] >= 0)
                               & (cells[f"{kind}.chunk"][:, stage] == chunk))  # fmt: skip

        self.ticked = {"head.F": at("F", p - 1, v - 1), "head.W": at("W", p - 1, v - 1),
                       "embed.F": at("F", 0, 0), "embed.B": at("B", 0, 0)}  # fmt: skip

    def lane(self, kind: str, t: jax.Array, mine: jax.Array) -> jax.Array:
        """The predicate of lane ``kind`` (F, B, W) at tick ``t``; ``mine``: the stage's own."""
        return self.anyone[kind][t] if self.on else mine

    def real(self, index: jax.Array) -> Any:
        """The mask of a lane's writes: is its (micro-batch or chunk) ``index`` real?"""
        return index >= 0 if self.on else True

    def branch(self, mine: jax.Array, name: str, t: jax.Array, on: Any, yes: Callable,
               no: Callable, *ops: Any) -> tuple[Any, Any]:  # fmt: skip
        """``lax.cond(mine, yes, no, *ops)`` per stage, or in lock-step under the tick's
        predicate ``name``; with the mask of what the caller keeps (True: all). ``on``: the
        enclosing lane's mask."""
        if not self.on:
            return lax.cond(mine, yes, no, *ops), True
        return lax.cond(self.ticked[name][t], yes, no, *ops), mine & on

    @staticmethod
    def masked(on: Any, new: Any, old: Any) -> Any:
        if on is True:
            return new
        return jax.tree.map(lambda a, b: jnp.where(on, a, b), new, old)

    def zeroed(self, on: Any, tree: Any) -> Any:
        """``tree`` where ``on``, zeros elsewhere."""
        return self.masked(on, tree, jax.tree.map(jnp.zeros_like, tree))

    @staticmethod
    def put(buf: Any, slot: jax.Array, value: Any, on: Any = True) -> Any:
        """``buf[slot] = value`` per leaf; masked, a stage the table leaves idle (slot -1)
        rewrites slot 0 with what it held."""
        if on is True:
            return jax.tree.map(lambda b, x: b.at[slot].set(x.astype(b.dtype)), buf, value)
        slot = jnp.maximum(slot, 0)
        return jax.tree.map(lambda b, x: b.at[slot].set(jnp.where(on, x.astype(b.dtype), b[slot])),
                            buf, value)  # fmt: skip

    def add(self, acc: Any, index: jax.Array, value: Any, on: Any = True) -> Any:
        """``acc[index] += value`` per leaf, nothing added where masked off."""
        return jax.tree.map(lambda g, d: g.at[index].add(d), acc, self.zeroed(on, value))


__all__ = ["Lockstep", "sends"]

"""The tick tables of each pipeline schedule, their arrivals and buffer slots (pure Python).

A table maps ``(tick, stage)`` to a cell: the actions that stage runs in that tick, in order.
gpipe and circular cells hold one forward (autodiff runs the backward as a reversed scan); the
explicit schedules hold their backwards too, so one scan runs the whole step:

    1f1b         F(i, s) = i + s                  B(i, s) = i + 2p - 2 - s        one F and one B
    interleaved  F = f(i, c) + s                  B = b(i, c) + vp + p - 2 - s    per cell (fused)
    zb-h1        one F, B or W per cell, placed by a lock-step list scheduler (below)

Interleaved (Megatron's depth-first looping, v = repeats chunks per stage, virtual stage
``c*p + s``) takes micro-batches in groups of p: ``f(i, c) = g*p*v + c*p + k`` and
``b(i, c) = g*p*v + (v-1-c)*p + k`` for ``i = g*p + k``. The last virtual stage runs F and B of a
micro-batch in the same cell (its loss is computed there), as 1f1b's last stage does.

zb-h1 (Qi et al. 2024, arXiv 2401.10241) splits the backward into B, the input gradient that the
previous stage waits for, and W, the weight gradient nobody waits for. Each tick every stage
runs the first that is ready of F (at most ``p - s`` micro-batches between F and B, 1F1B's rule,
and at most ``p`` between F and W, 1F1B's peak), B, W. With F, B and W of equal cost the step
takes ``3m + p - 1`` ticks, the lower bound (stage 0 idles only while its first cotangent comes
back), against ``3(m + p - 1)`` for 1f1b in the same units.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharding.pipeline._kinds import IDLE, Action, Cell, Kind

Cells = dict[tuple[int, int], list[Action]]


def forward_only(p: int, m: int, r: int) -> Cells:
    """gpipe (r = 1) and circular: stage s takes item ``t - s`` of its stream ``j*m + i``."""
    return {(k + s, s): [Action(Kind.FORWARD, k % m, k // m)] for k in range(r * m)
            for s in range(p)}  # fmt: skip


def one_f_one_b(p: int, m: int) -> Cells:
    """Fused 1F1B: one forward and one backward per stage per tick, m + 2p - 2 ticks."""
    cells: Cells = {}
    for i in range(m):
        for s in range(p):
            cells.setdefault((i + s, s), []).append(Action(Kind.FORWARD, i))
    for i in range(m):
        for s in range(p):
            cells.setdefault((i + 2 * p - 2 - s, s), []).append(Action(Kind.BACKWARD, i))
    return cells


def interleaved(p: int, m: int, v: int) -> Cells:
    """Interleaved 1F1B with v chunks per stage; m must be a multiple of p."""
    cells: Cells = {}
    for i in range(m):
        g, k = divmod(i, p)
        for c in range(v):
            for s in range(p):
                f = g * p * v + c * p + k + s
                cells.setdefault((f, s), []).append(Action(Kind.FORWARD, i, c))
    for i in range(m):
        g, k = divmod(i, p)
        for c in range(v):
            for s in range(p):
                b = g * p * v + (v - 1 - c) * p + k + v * p + p - 2 - s
                cells.setdefault((b, s), []).append(Action(Kind.BACKWARD, i, c))
    return cells


def zero_bubble_h1(p: int, m: int) -> Cells:
    """ZB-H1 in lock-step: per stage per tick the first ready of F, B, W (see the module doc)."""
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    done = [[0, 0, 0] for _ in range(p)]  # per stage: forwards, backwards, weight grads so far
    cells: Cells = {}
    t = 0
    while any(d[2] < m for d in done):
        chosen = []
        for s in range(p):
            nf, nb, nw = done[s]
            f_ready = nf < m and nf - nb < p - s and nf - nw < p and (
                s == 0 or f_at.get((s - 1, nf), t) < t)  # fmt: skip
            b_ready = nb < nf and f_at[s, nb] < t and (
                s == p - 1 or b_at.get((s + 1, nb), t) < t)  # fmt: skip
            if f_ready:
                chosen.append((s, Action(Kind.FORWARD, nf)))
            elif b_ready:
                chosen.append((s, Action(Kind.BACKWARD, nb)))
            elif nw < nb:
                chosen.append((s, Action(Kind.WEIGHT, nw)))
        for s, a in chosen:
            cells[t, s] = [a]
            slot = "FBW".index(a.kind.value)
            done[s][slot] += 1
            if a.kind is Kind.FORWARD:
                f_at[s, a.microbatch] = t
            elif a.kind is Kind.BACKWARD:
                b_at[s, a.microbatch] = t
        t += 1
    return cells


def grid(cells: Cells, p: int) -> tuple[tuple[Cell, ...], ...]:
    """The ``[tick][stage]`` table of a cell dict (empty cells idle)."""
    ticks = 1 + max(t for t, _ in cells)
    return tuple(tuple(tuple(cells.get((t, s), ())) for s in range(p)) for t in range(ticks))


def arrivals(table: tuple, p: int, chunks: int) -> tuple[tuple, tuple]:
    """``(activation_in, cotangent_in)``: per tick and stage, the action whose input arrives then.

    A forward's output reaches stage ``s + 1`` the next tick (the last stage's, with more chunks
    to go, wraps to stage 0 for the next chunk); a backward's input gradient reaches ``s - 1``
    (stage 0's wraps to the last stage for the previous chunk).
    """
    ticks = len(table)
    act = [[IDLE] * p for _ in range(ticks)]
    cot = [[IDLE] * p for _ in range(ticks)]
    for t in range(1, ticks):
        for s in range(p):
            for a in table[t - 1][s - 1]:  # from the previous stage (stage 0: from the last)
                if a.kind is Kind.FORWARD and s > 0:
                    act[t][s] = a
                elif a.kind is Kind.FORWARD and a.repeat + 1 < chunks:
                    act[t][s] = a._replace(repeat=a.repeat + 1)
            for a in table[t - 1][(s + 1) % p]:  # from the next stage (the last: from stage 0)
                if a.kind is Kind.BACKWARD and s < p - 1:
                    cot[t][s] = a
                elif a.kind is Kind.BACKWARD and a.repeat > 0:
                    cot[t][s] = a._replace(repeat=a.repeat - 1)
    return tuple(map(tuple, act)), tuple(map(tuple, cot))


@dataclass(frozen=True)
class Slots:
    """Buffer slots an explicit schedule's scan carries, and which slot each action uses.

    Attributes:
        activations, cotangents: arrivals waiting for their forward / backward (the last
            stage's loss gradient waits in a cotangent slot too).
        residuals: a forward's saved residuals, kept until its last backward action.
        weight_cotangents: zb-h1's per-layer output gradients, from B until W.
        of: ``{(buffer, stage, microbatch, chunk): slot}`` for buffer in ``act cot res wct``.
    """

    activations: int
    cotangents: int
    residuals: int
    weight_cotangents: int
    of: dict[tuple[str, int, int, int], int]


def slots(table: tuple, act_in: tuple, cot_in: tuple, p: int, chunks: int, explicit: bool) -> Slots:
    """Interval-colour each buffer per stage: a slot is free again the tick after its last use
    (a slot written and read in one tick is busy in that tick). Without ``explicit`` (gpipe,
    circular: autodiff keeps the residuals) only the activation arrivals."""
    spans: dict[str, dict[tuple[int, int, int], list[int]]] = {b: {} for b in
                                                             ("act", "cot", "res", "wct")}  # fmt: skip
    split = any(a.kind is Kind.WEIGHT for row in table for cell in row for a in cell)

    def mark(buf: str, key: tuple[int, int, int], t: int) -> None:
        span = spans[buf].setdefault(key, [t, t])
        span[0], span[1] = min(span[0], t), max(span[1], t)

    for t, row in enumerate(table):
        for s in range(p):
            if act_in[t][s] is not IDLE:
                mark("act", (s, act_in[t][s].microbatch, act_in[t][s].repeat), t)
            if cot_in[t][s] is not IDLE:
                mark("cot", (s, cot_in[t][s].microbatch, cot_in[t][s].repeat), t)
            for a in row[s]:
                key = (s, a.microbatch, a.repeat)
                last = s == p - 1 and a.repeat == chunks - 1
                if a.kind is Kind.FORWARD:
                    if key in spans["act"]:
                        mark("act", key, t)
                    if not explicit:
                        continue
                    mark("res", key, t)
                    if last:  # the loss's gradient, made with the forward
                        mark("cot", key, t)
                elif a.kind is Kind.BACKWARD:
                    mark("cot", key, t)
                    mark("res", key, t)
                    if split:
                        mark("wct", key, t)
                else:
                    mark("res", key, t)
                    mark("wct", key, t)
    of: dict[tuple[str, int, int, int], int] = {}
    count = {}
    for buf, by_key in spans.items():
        most = 0
        for s in range(p):
            free: list[int] = []  # per slot, the last tick it is busy
            items = sorted(((v[0], v[1], k) for k, v in by_key.items() if k[0] == s))
            for start, end, key in items:
                slot = next((j for j, busy in enumerate(free) if busy < start), len(free))
                free[slot:slot + 1] = [end]  # fmt: skip
                of[(buf, *key)] = slot
            most = max(most, len(free))
        count[buf] = most
    return Slots(count["act"], count["cot"], count["res"], count["wct"], of)

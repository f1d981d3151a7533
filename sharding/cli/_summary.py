"""The one-screen summary printed at the end of `spmdkit train`."""

from __future__ import annotations

import statistics
from typing import Any

import jax
from rich.console import Group
from rich.table import Table

from partition_rules.strategies import DESCRIPTIONS
from sharding._init import state_bytes
from sharding._units import fmt_bytes, fmt_count


def program_summary(args: Any, spec: Any, program: Any, history: list[dict]) -> Group:
    report = program.report()
    params = program.abstract_state["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("strategy", f"{args.strategy}: {DESCRIPTIONS[args.strategy]}")
    grid.add_row("mesh", f"{spec} ({spec.size} {jax.devices()[0].platform} devices)")
    grid.add_row("model", f"{args.model} {args.size}, {fmt_count(n_params)} parameters")
    grid.add_row(
        "params / device",
        fmt_bytes(state_bytes(params, program.param_shardings)),
    )
    grid.add_row(
        "train state / device",
        fmt_bytes(state_bytes(program.abstract_state, program.state_shardings)),
    )
    if report.memory is not None:
        m = report.memory
        peak = f", peak {fmt_bytes(m.peak)}" if m.peak is not None else ""
        grid.add_row(
            "memory / device",
            f"arguments {fmt_bytes(m.argument)}, temporaries {fmt_bytes(m.temp)}{peak}",
        )
    if report.matmul_flops:
        grid.add_row("matmul FLOPs / device / step", fmt_count(report.matmul_flops))
    if report.compile_time_s is not None:
        grid.add_row("compile", f"{report.compile_time_s:.2f} s")
    if history:
        timed = [h["step_time_s"] for h in history[1:]] or [history[0]["step_time_s"]]
        median = statistics.median(timed)
        grid.add_row(
            "loss",
            f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} over {len(history)} steps",
        )
        grid.add_row(
            "step time",
            f"median {median * 1e3:.1f} ms, {args.batch * args.seq / median:,.0f} tokens/s",
        )
    return Group(grid, report)

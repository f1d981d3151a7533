"""Calibrate a device profile on one real device: the matmul fraction, and a training step.

(a) Large square matmuls in --dtype, timed against the device's datasheet peak from
    `sharding.targets`: the achievable matmul fraction (the best over --matmul sizes).
(b) A training step of llama at each of --models (``SIZE`` or ``SIZE:LAYERS``, default 1b and 8b
    cut to 4 layers) on one device, timed, beside `step_time`'s prediction for that compiled
    program on a 1-device target of the device: with the shipped profile (its default fraction)
    and with the calibrated one. ``implied`` is the fraction that would predict the step exactly.
(c) Training-shaped GEMMs (--gemms, default `benchmarks._gemms.grid`: the MLP's column- and
    row-parallel matmuls of widths 2048-8192 split 1-8 ways over tensor) and (a)'s squares, each
    timed alone: its fraction of the peak and of the best square, the measurement a
    shape-dependent matmul term needs; a PNG.

Writes ``calibrate.toml``, the profile with the measured fraction (``--fraction-from matmul``, or
``step`` for the median implied one), which `spmdkit plan --target calibrate.toml:1x8` reads;
``calibrate.json`` with every figure predicted and measured, and ``calibrate_gemms.png``; prints
the tables. A CPU host runs it tiny, for a smoke test only: the datasheet is then another
device's, and the figures say so.

    python -m benchmarks.calibrate                          # on a GPU: its profile from the kind
    python -m benchmarks.calibrate --target h100 --matmul 128 --models tiny --batch 2 --seq 16
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from benchmarks import _gemms
from benchmarks._common import median_time, out_dir, parser, setup, write_json

# jax device_kind substrings -> shipped profile names (first match wins).
KINDS = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("A100", "a100"),
         ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6", "v6e"))  # fmt: skip
CHAIN = 8  # matmuls per timed call, so dispatch overhead does not count


class CalibrateArgumentError(ValueError):
    """A --models entry or --target this benchmark cannot take."""


GemmArgumentError = _gemms.GemmArgumentError  # a --gemms entry it cannot take


def profile_for(kind: str, given: str | None) -> tuple[Any, str]:
    """The `DeviceSpec` to calibrate and why: ``given`` (a name or .toml), else from the kind."""
    from sharding.targets import target

    if given:
        return target(given).device, "--target"
    name = next((n for pattern, n in KINDS if pattern.lower() in kind.lower()), None)
    if name is None:
        return target("h100").device, f"{kind!r} has no shipped profile: h100's datasheet"
    return target(name).device, f"from the device kind {kind!r}"


def parse_models(text: str) -> list[tuple[str, int | None]]:
    """``"1b,8b:4"`` -> ``[("1b", None), ("8b", 4)]``.

    Example:
        >>> parse_models("1b,8b:4")
        [('1b', None), ('8b', 4)]
    """
    from models import llama

    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        size, _, layers = item.partition(":")
        if size not in llama.SIZES or (layers and not (layers.isdigit() and int(layers) > 0)):
            raise CalibrateArgumentError(
                f"--models {item!r}: write SIZE or SIZE:LAYERS, SIZE one of "
                f"{', '.join(llama.SIZES)}, e.g. --models 1b,8b:4"
            )
        out.append((size, int(layers) if layers else None))
    return out


def matmul_rate(n: int, dtype: str, steps: int, device: Any) -> dict[str, Any]:
    """FLOP/s of ``CHAIN`` chained ``n x n`` matmuls in ``dtype`` on ``device``, median time."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (n, n), jnp.float32).astype(dtype), device)
    b = jax.random.normal(kb, (n, n), jnp.float32) / math.sqrt(n)  # keeps the chain's scale
    b = jax.device_put(b.astype(dtype), device)
    chain = jax.jit(lambda a, b: jax.lax.fori_loop(0, CHAIN, lambda _, c: c @ b, a))
    chain(a, b).block_until_ready()
    median, times = median_time(lambda: chain(a, b).block_until_ready(), steps)
    flops = CHAIN * 2.0 * n**3
    return {"n": n, "dtype": dtype, "seconds": median / CHAIN, "flops_per_s": flops / median,
            "times_s": times}  # fmt: skip


def implied_fraction(st: Any, flops: float, peak: float, measured: float) -> float | None:
    """The matmul fraction at which `step_time` would predict ``measured`` for this step."""
    rest = measured - st.memory_bound_s - st.exposed_comm_s
    return None if rest <= 0 else min(1.0, flops / (peak * rest))


def step_row(size: str, layers: int | None, args: Any, device: Any, spec: Any, limit: int,
             fraction: float) -> dict[str, Any]:  # fmt: skip
    """Compile, run and predict one llama step on ``device``; a row of the step table."""
    import optax

    from models import llama
    from sharding import Workload, state_bytes
    from sharding.costmodel import Layout, predict, step_time, work_from_report
    from sharding.targets import Target

    cfg = llama.config(size)
    cfg = dataclasses.replace(cfg, n_layers=layers) if layers else cfg
    work = Workload.from_family(llama, cfg)
    row: dict[str, Any] = {"model": f"llama {size}" + (f" ({layers} layers)" if layers else ""),
                           "params": llama.param_count(cfg), "fits": False}  # fmt: skip
    program = Layout("dp", "data=1").program(work, batch=args.batch, seq=args.seq,
                                             optimizer=optax.adamw(1e-4), dtype=args.dtype,
                                             remat=args.remat, devices=[device])  # fmt: skip
    row["state_bytes"] = state_bytes(program.abstract_state)
    if row["state_bytes"] > limit:
        row["reason"] = "train state alone exceeds the memory (not compiled)"
        return row
    report = program.report()
    row["allocated"] = None if report.memory is None else report.memory.allocated
    if row["allocated"] is not None and row["allocated"] > limit:
        row["reason"] = "compiled step exceeds the memory"
        return row
    state = {"s": program.init(0)}
    batch = program.shard_batch(work.synthetic_batch(args.batch, args.seq))

    def one() -> None:
        state["s"], metrics = program.step(state["s"], batch)
        float(metrics["loss"])  # blocks on the step

    for _ in range(args.warmup):
        one()
    measured, times = median_time(one, args.steps)
    tokens = args.batch * args.seq
    useful = predict(llama, cfg, "dp", {}, args.batch, args.seq, dtype=args.dtype).matmul_flops
    sw = work_from_report(report, tokens=tokens, dtype=args.dtype, model_flops=useful,
                          remat=args.remat)  # fmt: skip
    calibrated = dataclasses.replace(spec, matmul_fraction=fraction)
    shipped_st = step_time(sw, Target(f"{spec.name}:1x1", spec, 1, 1))
    calibrated_st = step_time(sw, Target(f"{spec.name}-calibrated:1x1", calibrated, 1, 1))
    peak = spec.peak(args.dtype)
    row.update(
        fits=True, reason="ran", tokens=tokens, matmul_flops=sw.matmul_flops, model_flops=useful,
        measured_s=measured, times_s=times, measured_mfu=useful / (measured * peak),
        predicted_s=shipped_st.step_s, predicted_error=shipped_st.step_s / measured - 1,
        calibrated_s=calibrated_st.step_s, calibrated_error=calibrated_st.step_s / measured - 1,
        implied_fraction=implied_fraction(shipped_st, sw.matmul_flops, peak, measured),
        memory_bound_s=shipped_st.memory_bound_s,
    )  # fmt: skip
    return row


def memory_limit(device: Any, memory: str | None) -> int:
    """--memory, else the accelerator's bytes_limit, else 4 GB (a CPU host)."""
    from sharding import parse_bytes

    if memory is not None:
        return parse_bytes(memory)
    stats = (device.memory_stats() or {}) if device.platform != "cpu" else {}
    return int(stats.get("bytes_limit", parse_bytes("4GB")))


def main(argv: list[str] | None = None) -> int:
    p = parser("calibrate", __doc__.split("\n\n")[0])
    p.set_defaults(devices=1)
    p.add_argument("--target", help="profile to calibrate: a shipped name or a .toml (when "
                   "unset: from the device kind)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--matmul", help="square matmul sizes, comma list (when unset: "
                   "4096,8192,16384 on an accelerator, 256,512 on CPU)")  # fmt: skip
    p.add_argument("--models", help="llama SIZE or SIZE:LAYERS, comma list (when unset: "
                   "1b,8b:4 on an accelerator, tiny on CPU)")  # fmt: skip
    p.add_argument("--gemms", help="MxKxN shapes to time, comma list, or none (when unset: "
                   "training-shaped ones, benchmarks._gemms.grid)")  # fmt: skip
    p.add_argument("--batch", type=int, default=4, help="global batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: %(default)s)")
    p.add_argument("--remat", default="full", choices=("none", "full", "dots"),
                   help="per-layer remat (default: %(default)s; the step is priced as compiled)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="timed steps/calls (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--memory", help="memory budget per device (when unset: the device's)")
    p.add_argument("--fraction-from", choices=("matmul", "step"), default="matmul",
                   help="which measurement the profile's matmul_fraction takes (default: "
                   "%(default)s; step: the median implied by the training steps)")  # fmt: skip
    args = p.parse_args(argv)
    setup(args.devices)

    import jax
    from rich.console import Console
    from rich.table import Table

    from sharding import fmt_bytes, fmt_count

    console = Console(width=160)
    device = jax.devices()[0]
    cpu = device.platform == "cpu"
    spec, why = profile_for(device.device_kind, args.target)
    sizes = [int(n) for n in (args.matmul or ("256,512" if cpu else "4096,8192,16384")).split(",")]
    todo = parse_models(args.models or ("tiny" if cpu else "1b,8b:4"))
    shapes = _gemms.grid(cpu) if args.gemms is None else _gemms.parse(args.gemms)
    peak = spec.peak(args.dtype)
    if cpu:
        console.print(f"[yellow]CPU host: timed against {spec.name}'s datasheet ({why}); a smoke "
                      f"test, not a calibration[/yellow]")  # fmt: skip

    mm = [matmul_rate(n, args.dtype, args.steps, device) for n in sizes]
    for r in mm:
        r["fraction"] = r["flops_per_s"] / peak
    fraction = max(r["fraction"] for r in mm)
    gemms = [_gemms.rate(shape, args.dtype, args.steps, device)
             for shape in (_gemms.squares(sizes) + shapes if shapes else [])]  # fmt: skip
    for r in gemms:
        r["fraction"] = r["flops_per_s"] / peak
    best = max((r["fraction"] for r in gemms if r["what"].startswith("square")), default=1.0)
    for r in gemms:
        r["of_square"] = r["fraction"] / best
    limit = memory_limit(device, args.memory)
    rows = [step_row(size, layers, args, device, spec, limit, fraction) for size, layers in todo]
    implied = [r["implied_fraction"] for r in rows if r.get("implied_fraction")]
    chosen = statistics.median(implied) if args.fraction_from == "step" and implied else fraction
    calibrated = dataclasses.replace(
        spec, name=f"{spec.name}-calibrated", matmul_fraction=float(f"{chosen:.4g}"),
        source=f"{spec.source}; matmul_fraction measured by benchmarks.calibrate on one "
        f"{device.device_kind} ({args.fraction_from}, {args.dtype})",
    )  # fmt: skip

    t = Table(title=f"(a) {args.dtype} matmuls on one {device.device_kind} against {spec.name}'s "
              f"datasheet peak {peak / 1e12:g} TFLOP/s ({why})")  # fmt: skip
    for col in ("n", "time", "TFLOP/s", "fraction of peak"):
        t.add_column(col, justify="right")
    for r in mm:
        t.add_row(str(r["n"]), f"{r['seconds'] * 1e3:.3g} ms", f"{r['flops_per_s'] / 1e12:.4g}",
                  f"{r['fraction']:.2%}")  # fmt: skip
    console.print(t)
    t = Table(title=f"(b) training step on one device, {args.dtype}, batch {args.batch} x seq "
              f"{args.seq}, remat {args.remat}: measured vs step_time")  # fmt: skip
    for col in ("model", "params", "memory", "measured", f"predicted (f={spec.matmul_fraction})",
                f"calibrated (f={fraction:.3g})", "implied f", "MFU"):  # fmt: skip
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        if not r["fits"]:
            t.add_row(r["model"], fmt_count(r["params"]), fmt_bytes(r["state_bytes"]),
                      r["reason"], "", "", "", "")  # fmt: skip
            continue
        f = r["implied_fraction"]
        t.add_row(r["model"], fmt_count(r["params"]), fmt_bytes(r["allocated"] or 0),
                  f"{r['measured_s'] * 1e3:.4g} ms",
                  f"{r['predicted_s'] * 1e3:.4g} ms ({r['predicted_error']:+.0%})",
                  f"{r['calibrated_s'] * 1e3:.4g} ms ({r['calibrated_error']:+.0%})",
                  "-" if f is None else f"{f:.3g}", f"{r['measured_mfu']:.1%}")  # fmt: skip
    console.print(t)
    out = out_dir(args.out)
    title = (f"(c) {args.dtype} GEMMs on one {device.device_kind} against {spec.name}'s peak and "
             f"the best square timed the same way ({best:.1%} of peak)")  # fmt: skip
    png = out / "calibrate_gemms.png"
    png.unlink(missing_ok=True)  # an earlier run's, which --gemms none would leave behind
    if gemms:
        console.print(_gemms.table(gemms, title))
        _gemms.plot(gemms, png, title)

    (out / "calibrate.toml").write_text(calibrated.to_toml())
    record = {"benchmark": "calibrate", "args": vars(args), "profile": spec.to_dict(),
              "profile_source": why, "cpu_smoke": cpu, "matmul": mm, "matmul_fraction": fraction,
              "steps": rows, "gemms": gemms, "calibrated": calibrated.to_dict()}  # fmt: skip
    write_json(out / "calibrate.json", record)
    console.print(f"matmul_fraction {calibrated.matmul_fraction} ({args.fraction_from}); wrote "
                  f"{out / 'calibrate.toml'} (use --target {out / 'calibrate.toml'}:1x8) and "
                  f"{out / 'calibrate.json'}" + (f" and {png}" if gemms else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

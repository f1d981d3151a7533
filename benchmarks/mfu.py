"""One device: tokens/s and MFU of llama training at the largest size that fits.

Sizes are tried from the largest down: a size whose unsplit train state (float32 parameters and
AdamW moments) already exceeds the memory is refused without compiling; otherwise its one-device
step is compiled ahead of time from abstract shapes (nothing allocated) and the first whose
compiled peak fits is run. The memory is the accelerator's ``bytes_limit``, or ``--memory`` on a
CPU host (default 4GB, so CPU runs stay small).

MFU = model FLOPs per step / step time / peak FLOP/s of the device. Model FLOPs are the matmul
FLOPs of the compiled step without recomputation (`ProgramReport.matmul_flops`, every scan
iteration counted); ``6 * N * tokens`` is shown beside them for reference. The peak is the
datasheet figure on an accelerator and a measured matmul roofline on CPU
(`sharding.inspection.host_peak`).

    python -m benchmarks.mfu                          # auto size, CPU: float32, 4GB
    python -m benchmarks.mfu --size 1b --dtype bfloat16 --batch 4 --seq 2048 --remat full
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import median_time, out_dir, parser, setup, write_json


class NoSizeFitsError(ValueError):
    """No llama size's training step fits the device memory."""


def sizes_largest_first(sizes: dict[str, Any], param_count: Any) -> list[str]:
    """Size names ordered by parameter count, largest first.

    Example:
        >>> from models import llama
        >>> sizes_largest_first(llama.SIZES, llama.param_count)[:2]
        ['70b', '7b']
    """
    return sorted(sizes, key=lambda s: -param_count(sizes[s]))


def train_flops_6nd(n_params: int, tokens: int) -> float:
    """The usual dense-transformer estimate of one training step: 6 FLOPs per parameter-token.

    Example:
        >>> train_flops_6nd(1_000, 10)
        60000.0
    """
    return 6.0 * n_params * tokens


def _build(fam: Any, cfg: Any, args: Any, device: Any, remat: str) -> Any:
    """The one-device dp program (built, not compiled: its abstract state is sized first)."""
    from sharding import Workload
    from sharding.comparison import Settings, build
    from sharding.costmodel import Layout

    settings = Settings(args.batch, args.seq, lr=1e-4)
    return build(Layout("dp", "data=1"), Workload.from_family(fam, cfg), settings,
                 dtype=args.dtype, remat=remat, devices=[device])  # fmt: skip


def try_size(fam: Any, size: str, args: Any, device: Any, limit: int) -> dict[str, Any]:
    """Whether ``size`` fits ``limit`` bytes on one device, and the compiled program if it does."""
    from sharding import state_bytes

    cfg = fam.config(size)
    row: dict[str, Any] = {"size": size, "params": fam.param_count(cfg), "state_bytes": None,
                           "peak_bytes": None, "fits": False, "reason": ""}  # fmt: skip
    if args.seq > cfg.max_seq_len:
        row["reason"] = f"seq {args.seq} > max_seq_len {cfg.max_seq_len}"
        return row
    program = _build(fam, cfg, args, device, args.remat)
    row["state_bytes"] = state_bytes(program.abstract_state)
    if row["state_bytes"] > limit:
        row["reason"] = "train state alone exceeds the memory (not compiled)"
        return row
    start = time.perf_counter()
    report = program.report()
    row["compile_time_s"] = time.perf_counter() - start
    row["peak_bytes"] = None if report.memory is None else report.memory.allocated
    row["fits"] = row["peak_bytes"] is not None and row["peak_bytes"] <= limit
    row["reason"] = "fits" if row["fits"] else "compiled peak exceeds the memory"
    row["program"], row["report"], row["cfg"] = program, report, cfg
    return row


def memory_limit(device: Any, memory_arg: str | None) -> tuple[int, str]:
    """The byte budget and where it comes from: --memory, else the accelerator's bytes_limit."""
    from sharding import parse_bytes

    if memory_arg is not None:
        return parse_bytes(memory_arg), "--memory"
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]), "device bytes_limit"
    return parse_bytes("4GB"), "CPU default --memory 4GB"


def run_steps(row: dict[str, Any], fam: Any, args: Any) -> dict[str, Any]:
    """Initialise, warm up and time ``args.steps`` steps of the chosen program."""
    program, cfg = row["program"], row["cfg"]
    state = {"s": program.init(0)}
    batch = program.shard_batch(fam.make_batch(cfg, args.batch, args.seq))
    losses = []

    def one() -> None:
        state["s"], metrics = program.step(state["s"], batch)
        losses.append(float(metrics["loss"]))  # blocks on the step

    for _ in range(args.warmup):
        one()
    median, times = median_time(one, args.steps)
    return {"step_time_s": median, "step_times_s": times, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    p = parser("mfu", __doc__.split("\n\n")[0])
    p.add_argument("--size", help="llama size; default: the largest that fits")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="compute dtype (default: bfloat16 on an accelerator, float32 on CPU)")  # fmt: skip
    p.add_argument("--batch", type=int, default=8, help="global batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"),
                   help="per-layer remat (model FLOPs never count the recompute)")  # fmt: skip
    p.add_argument("--memory", help="device memory budget, e.g. 80GB (CPU default 4GB)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of the device for MFU")
    args = p.parse_args(argv)
    setup(args.devices)

    import jax
    from rich.console import Console
    from rich.table import Table

    import models
    from sharding import fmt_bytes, fmt_count
    from sharding.inspection import host_peak, mfu

    console = Console(width=160)
    fam = models.get_family("llama")
    device = jax.devices()[0]
    args.dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    limit, limit_src = memory_limit(device, args.memory)
    names = [args.size] if args.size else sizes_largest_first(fam.SIZES, fam.param_count)
    fam.config(names[0])  # an unknown --size fails here, naming the known ones

    tried = []
    with console.status("sizing") as status:
        for size in names:
            status.update(f"compiling llama {size} for one device")
            tried.append(try_size(fam, size, args, device, limit))
            if tried[-1]["fits"]:
                break
    sizing = Table(title=f"llama sizes on one {device.device_kind} ({fmt_bytes(limit)}, "
                         f"{limit_src})")  # fmt: skip
    for col in ("size", "params", "train state", "compiled peak", "verdict"):
        sizing.add_column(col, justify="left" if col in ("size", "verdict") else "right")
    for r in tried:
        sizing.add_row(r["size"], fmt_count(r["params"]),
                       "-" if r["state_bytes"] is None else fmt_bytes(r["state_bytes"]),
                       "-" if r["peak_bytes"] is None else fmt_bytes(r["peak_bytes"]),
                       r["reason"])  # fmt: skip
    console.print(sizing)
    chosen = tried[-1]
    if not chosen["fits"]:
        needs = [r["peak_bytes"] or r["state_bytes"] for r in tried if r["state_bytes"]]
        need = f"the smallest needs {fmt_bytes(min(needs))}" if needs else tried[-1]["reason"]
        raise NoSizeFitsError(
            f"no llama size in {names} fits {fmt_bytes(limit)} ({limit_src}) at batch "
            f"{args.batch} x seq {args.seq}: {need}. Lower --batch/--seq, add --remat full, "
            f"or raise --memory"
        )

    report, cfg = chosen["report"], chosen["cfg"]
    flops = report.matmul_flops
    if args.remat != "none":  # count the useful work only, not the recompute
        flops = _build(fam, cfg, args, device, "none").report().matmul_flops
    timing = run_steps(chosen, fam, args)
    peak = host_peak([device], dtype=args.dtype, tflops=args.peak_tflops)
    tokens = args.batch * args.seq
    flops_6nd = train_flops_6nd(chosen["params"], tokens)
    step = timing["step_time_s"]
    result = {
        "size": chosen["size"], "params": chosen["params"], "dtype": args.dtype,
        "batch": args.batch, "seq": args.seq, "remat": args.remat, "tokens_per_step": tokens,
        "step_time_s": step, "tokens_per_s": tokens / step, "model_flops": flops,
        "flops_6nd": flops_6nd, "achieved_flops_per_s": flops / step,
        "mfu": mfu(flops, step, peak), "mfu_6nd": mfu(flops_6nd, step, peak),
        "peak": peak.to_dict(), "peak_bytes": chosen["peak_bytes"],
        "compile_time_s": report.compile_time_s, **timing,
    }  # fmt: skip
    t = Table(title=f"llama {chosen['size']} training on one device ({args.steps} timed steps)")
    for col in ("dtype", "batch x seq", "step (median)", "tokens/s", "model FLOPs/step",
                "6ND/step", "TFLOP/s", "peak TFLOP/s", "MFU", "MFU (6ND)"):  # fmt: skip
        t.add_column(col, justify="right")
    t.add_row(args.dtype, f"{args.batch} x {args.seq}", f"{step * 1e3:.1f} ms",
              f"{tokens / step:,.0f}", fmt_count(flops), fmt_count(flops_6nd),
              f"{flops / step / 1e12:.3g}", f"{peak.per_device / 1e12:.3g} ({peak.source})",
              f"{result['mfu']:.1%}", f"{result['mfu_6nd']:.1%}")  # fmt: skip
    console.print(t)
    console.print(f"loss {timing['losses'][0]:.3f} -> {timing['losses'][-1]:.3f}; compiled peak "
                  f"{fmt_bytes(chosen['peak_bytes'])} of {fmt_bytes(limit)}")  # fmt: skip
    out = out_dir(args.out)
    keep = ("size", "params", "state_bytes", "peak_bytes", "fits", "reason", "compile_time_s")
    record = {"benchmark": "mfu", "memory_limit": limit, "memory_source": limit_src,
              "tried": [{k: r[k] for k in keep if k in r} for r in tried], "result": result}  # fmt: skip
    write_json(out / "mfu.json", record)
    console.print(f"wrote {out / 'mfu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

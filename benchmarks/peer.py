"""spmdkit beside MaxText on one model and four meshes, in MaxText's own metric terms.

The model is llama ``maxtext-tiny`` (llama2-style decoder: emb 256, 4 heads, 4 kv heads,
head_dim 64, mlp 1024, 8 layers, vocab 1024), seq 256, 2 sequences per device, float32, AdamW,
on meshes data=8, fsdp=8, tensor=4 x data=2 and stage=4 x data=2 (gpipe, 8 micro-batches).
spmdkit's step is compiled, warmed up and timed here; MaxText cannot be installed here, so the
benchmark prints the MaxText command line of each mesh, and reads the logs those commands write
(``--maxtext-log MESH=FILE``, repeatable) to show both side by side with ratios.

MaxText's log line per step (``metric_logger.py``):
``completed step: N, seconds: X, TFLOP/s/device: Y, Tokens/s/device: Z, total_weights: W,
loss: L``. Its TFLOP/s/device divides a closed-form count (`maxtext_train_flops_per_device`, the
formula of MaxText's ``calculate_tflops_training_per_device``) by the step time; spmdkit's column
uses the same count, so the ratio compares speed alone.

    python -m benchmarks.peer --commands-only                  # the MaxText command lines
    python -m benchmarks.peer --maxtext-log data=8=dp.log --maxtext-log stage=4,data=2=pp.log
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks._common import out_dir, parser, setup, write_json

SIZE = "maxtext-tiny"
SEQ = 256
PER_DEVICE_BATCH = 2
# (label, spmdkit strategy, mesh, pipeline micro-batches)
RUNS = (
    ("dp", "dp", "data=8", None),
    ("fsdp", "fsdp", "fsdp=8", None),
    ("tp", "tp", "tensor=4,data=2", None),
    ("pp", "pp", "stage=4,data=2", 8),
)
ICI = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism",
       "tensor": "ici_tensor_parallelism", "stage": "ici_pipeline_parallelism"}  # fmt: skip
_STEP = re.compile(r"completed step: (\d+), (.*)$")


class MaxTextLogError(ValueError):
    """A MaxText log that cannot be read or matched to a mesh."""


def parse_maxtext_log(text: str, source: str = "<text>") -> list[dict[str, Any]]:
    """The per-step records of a MaxText train log: one dict per ``completed step`` line.

    Keys are MaxText's (``step``, ``seconds``, ``TFLOP/s/device``, ``Tokens/s/device``,
    ``total_weights``, ``loss``, plus any extras it logs); numbers become floats.

    Example:
        >>> line = ("I0101 metric_logger.py:196] completed step: 3, seconds: 0.512, "
        ...         "TFLOP/s/device: 1.250, Tokens/s/device: 1000.000, total_weights: 4096, "
        ...         "loss: 6.875")
        >>> parse_maxtext_log(line)[0]["Tokens/s/device"]
        1000.0
    """
    records = []
    for line in text.splitlines():
        hit = _STEP.search(line)
        if not hit:
            continue
        rec: dict[str, Any] = {"step": int(hit.group(1))}
        for part in hit.group(2).split(", "):
            key, sep, value = part.partition(": ")
            if sep:
                rec[key.strip()] = _number(value.strip())
        records.append(rec)
    if not records:
        raise MaxTextLogError(
            f"{source}: no MaxText step lines found; expected lines like 'completed step: 5, "
            f"seconds: 0.512, TFLOP/s/device: 1.250, Tokens/s/device: 1000.000, total_weights: "
            f"4096, loss: 6.875' (pass the log MaxText's train command printed)"
        )
    return records


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def summarize_log(records: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Medians of MaxText's per-step figures after the first ``skip`` steps (compile, warm-up);
    ``loss`` is the last step's, ``loss_by_step`` every step's (to compare at equal steps)."""
    timed = [r for r in records if r["step"] >= skip] or records[-1:]
    out: dict[str, Any] = {"steps": len(timed), "loss": records[-1].get("loss"),
                           "loss_by_step": {r["step"]: r.get("loss") for r in records}}  # fmt: skip
    for key in ("seconds", "TFLOP/s/device", "Tokens/s/device"):
        values = [r[key] for r in timed if isinstance(r.get(key), float)]
        out[key] = statistics.median(values) if values else None
    return out


def parse_log_arg(arg: str) -> tuple[str, Path]:
    """``MESH=FILE`` (or ``LABEL=FILE``, label dp/fsdp/tp/pp) -> (label, path).

    Example:
        >>> parse_log_arg("tensor=4,data=2=logs/tp.txt")
        ('tp', PosixPath('logs/tp.txt'))
    """
    for label, _, mesh, _ in RUNS:
        for key in (mesh, label, _canonical(mesh)):
            if arg.startswith(key + "="):
                return label, Path(arg[len(key) + 1 :])
    known = ", ".join(f"{mesh}=FILE ({label}=FILE)" for label, _, mesh, _ in RUNS)
    raise MaxTextLogError(f"--maxtext-log {arg!r}: name one of the meshes: {known}")


def _canonical(mesh: str) -> str:
    from sharding import MeshSpec

    return str(MeshSpec.of(mesh))


def maxtext_train_flops_per_device(cfg: Any, per_device_batch: int, seq: int) -> float:
    """MaxText's training FLOPs per device per step for a dense llama2 decoder.

    3 x (forward matmuls: per layer SwiGLU 6BSDF, QKV 2BSD(N+2K)H, output projection 2BSDNH;
    the head 2BSDV) plus 3 x causal attention 4BS^2NH/2 per layer, with B the per-device batch.

    Example:
        >>> from models import llama
        >>> f"{maxtext_train_flops_per_device(llama.config('maxtext-tiny'), 2, 256):.4g}"
        '2.819e+10'
    """
    b, s, d, f = per_device_batch, seq, cfg.d_model, cfg.d_ff
    n, k, h, v = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    ffn = 6 * b * s * d * f  # gate and up (two activations) plus down
    qkv = 2 * b * s * d * (n + 2 * k) * h
    proj = 2 * b * s * d * n * h
    head = 2 * b * s * d * v
    attention = 4 * b * s * s * n * h / 2
    return 3.0 * ((ffn + qkv + proj) * cfg.n_layers + head) + 3.0 * attention * cfg.n_layers


def maxtext_command(label: str, mesh: str, microbatches: int | None, *, steps: int,
                    config: str) -> str:  # fmt: skip
    """The MaxText command that trains the same model on ``mesh`` and logs its steps."""
    from sharding import MeshSpec

    sizes = MeshSpec.of(mesh).sizes
    parts = [
        f"python -m maxtext.trainers.pre_train.train {config} run_name=spmdkit-peer-{label}",
        "model_name=default decoder_block=llama2 base_emb_dim=256 base_num_query_heads=4",
        "base_num_kv_heads=4 head_dim=64 base_mlp_dim=1024 base_num_decoder_layers=8",
        f"vocab_size=1024 max_target_length={SEQ} per_device_batch_size={PER_DEVICE_BATCH}",
        # optax.adamw's defaults (MaxText's are b2=0.95, decay 0.1; its lr warms up, cosine)
        "dtype=float32 weight_dtype=float32 opt_type=adamw learning_rate=1e-3 adam_b2=0.999",
        "adam_weight_decay=1e-4",
        f"dataset_type=synthetic steps={steps} enable_checkpointing=false",
        " ".join(f"{ICI[a]}={sizes[a]}" for a in ("data", "fsdp", "tensor", "stage")),
    ]
    if microbatches:
        per_stage = 8 // sizes["stage"]  # one repeat: gpipe, as spmdkit's run
        parts.append(f"num_pipeline_microbatches={microbatches} "
                     f"num_layers_per_pipeline_stage={per_stage}")  # fmt: skip
    return " \\\n    ".join(parts) + f" 2>&1 | tee maxtext-{label}.log"


def run_spmdkit(args: Any) -> list[dict[str, Any]]:
    """Compile, warm up and time spmdkit's step on each mesh (`sharding.comparison.evaluate`
    and `measure_here`; the prediction for an H100 node is kept beside the measured time)."""
    import models
    from sharding import Workload
    from sharding.comparison import Settings, evaluate, measure_here
    from sharding.costmodel import Layout
    from sharding.targets import target

    fam = models.get_family("llama")
    cfg = fam.config(SIZE)
    work = Workload.from_family(fam, cfg)
    settings = Settings(PER_DEVICE_BATCH * args.devices, SEQ)
    tgt = target(f"h100:1x{args.devices}")
    flops = maxtext_train_flops_per_device(cfg, PER_DEVICE_BATCH, SEQ)
    rows = []
    for label, strategy, mesh, micro in RUNS:
        if label not in args.meshes:
            continue
        cand = Layout(strategy, mesh, "gpipe" if micro else None, micro)
        r, program = evaluate(cand, work, settings, tgt, dtype="float32")
        measure_here(r, program, work, settings, warmup=args.warmup, timed=args.steps)
        secs = r.measured_step_s
        rows.append({
            "label": label, "mesh": mesh, "seconds": secs,
            "TFLOP/s/device": flops / secs / 1e12,
            "matmul TFLOP/s/device": r.matmul_flops / secs / 1e12,
            "Tokens/s/device": PER_DEVICE_BATCH * SEQ / secs, "loss": r.losses[-1],
            "losses": r.losses, "step_times_s": r.measured_s,
            "predicted_h100_step_s": r.step_s,
            "compile_time_s": r.compile_time_s, "collective_bytes": r.collective_bytes,
        })  # fmt: skip
    return rows


def side_by_side(ours: list[dict[str, Any]], theirs: dict[str, dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=f"spmdkit | MaxText: llama {SIZE}, seq {SEQ}, {PER_DEVICE_BATCH}/device, "
                    "float32 (ratio = spmdkit / MaxText; for seconds lower is better; loss at "
                    "spmdkit's last step)")  # fmt: skip
    t.add_column("mesh")
    metrics = ("seconds", "TFLOP/s/device", "Tokens/s/device", "loss")
    for m in metrics:
        for who in ("spmdkit", "MaxText", "ratio"):
            t.add_column(f"{m}\n{who}", justify="right")
    for row in ours:
        other = theirs.get(row["label"], {})
        cells = [row["mesh"]]
        for m in metrics:
            a, b = row[m], other.get(m)
            if m == "loss" and other:  # both losses at the same step (MaxText counts from 0)
                b = other["loss_by_step"].get(len(row["losses"]) - 1, b)
            cells += [_fmt(a), _fmt(b), "-" if not (a and b) else f"{a / b:.2f}"]
        t.add_row(*cells)
    return t


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if x >= 100 else f"{x:.4g}"


def plot(ours: list[dict[str, Any]], theirs: dict[str, dict[str, Any]], path: Path) -> Path:
    """Tokens/s/device per mesh, spmdkit beside MaxText where a log was given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(ours))
    ax.bar([x - 0.2 for x in xs], [r["Tokens/s/device"] for r in ours], 0.4, label="spmdkit")
    mt = [theirs.get(r["label"], {}).get("Tokens/s/device") or 0 for r in ours]
    if any(mt):
        ax.bar([x + 0.2 for x in xs], mt, 0.4, label="MaxText")
    ax.set_xticks(list(xs), [r["mesh"] for r in ours], fontsize=8)
    ax.set_ylabel("Tokens/s/device")
    ax.set_title(f"llama {SIZE}: spmdkit vs MaxText", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = parser("peer", __doc__.split("\n\n")[0])
    p.add_argument("--maxtext-log", action="append", default=[], metavar="MESH=FILE",
                   help="a MaxText train log for one mesh, e.g. data=8=dp.log (repeatable)")  # fmt: skip
    p.add_argument("--maxtext-skip", type=int, default=2,
                   help="MaxText steps to leave out of the medians (compile, warm-up)")  # fmt: skip
    p.add_argument("--maxtext-config", default="src/maxtext/configs/base.yml",
                   help="base config path in the MaxText checkout (default: %(default)s)")  # fmt: skip
    p.add_argument("--maxtext-steps", type=int, default=20, help="steps= in the MaxText commands")
    p.add_argument("--meshes", default=",".join(r[0] for r in RUNS),
                   help="subset of %(default)s")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed spmdkit steps per mesh")
    p.add_argument("--warmup", type=int, default=1, help="untimed spmdkit steps first")
    p.add_argument("--commands-only", action="store_true", help="print the MaxText commands")
    args = p.parse_args(argv)
    args.meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    unknown = [m for m in args.meshes if m not in {r[0] for r in RUNS}]
    if unknown:
        raise MaxTextLogError(f"--meshes {unknown}: known labels {[r[0] for r in RUNS]}")
    logs = dict(parse_log_arg(a) for a in args.maxtext_log)
    if args.devices != 8:
        raise MaxTextLogError(f"--devices {args.devices}: the peer meshes need exactly 8 devices")
    theirs = {label: summarize_log(parse_maxtext_log(path.read_text(), str(path)),
                                   args.maxtext_skip) for label, path in logs.items()}  # fmt: skip
    setup(args.devices)

    from rich.console import Console

    import models

    console = Console(width=200)
    commands = {label: maxtext_command(label, mesh, micro, steps=args.maxtext_steps,
                                       config=args.maxtext_config)
                for label, _, mesh, micro in RUNS if label in args.meshes}  # fmt: skip
    console.print("[bold]MaxText commands[/] (run in a MaxText checkout on 8 devices; pass each "
                  "log back as --maxtext-log MESH=FILE):")  # fmt: skip
    for cmd in commands.values():
        console.print(cmd, highlight=False, soft_wrap=True)
    if args.commands_only:
        return 0
    with console.status("spmdkit: compiling and timing each mesh"):
        ours = run_spmdkit(args)
    console.print(side_by_side(ours, theirs))
    if not theirs:
        console.print("no --maxtext-log given: MaxText columns are empty")
    out = out_dir(args.out)
    record = {"benchmark": "peer", "model": {"family": "llama", "size": SIZE, "seq": SEQ,
              "per_device_batch": PER_DEVICE_BATCH, "dtype": "float32"},
              "maxtext_flops_per_device": maxtext_train_flops_per_device(
                  models.llama.config(SIZE), PER_DEVICE_BATCH, SEQ),
              "spmdkit": ours, "maxtext": theirs, "maxtext_commands": commands}  # fmt: skip
    write_json(out / "peer.json", record)
    plot(ours, theirs, out / "peer.png")
    console.print(f"wrote {out / 'peer.json'} and {out / 'peer.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

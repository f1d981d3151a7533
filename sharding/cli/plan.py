"""`spmdkit plan`: rank strategies and meshes for a model on a target cluster before owning it.

llama and gpt2 are ranked from closed forms (no devices, any size), each layout's step priced on
the target by the same model compare uses; when the target has at most 64 devices, the top
layouts are also compiled for it here from abstract shapes, and the formula shown beside the
compiled program. Any other model (cnn, mlp, your own) is ranked from compiled programs of a few
layouts per strategy.
"""

from __future__ import annotations

import argparse
import contextlib

from partition_rules import STRATEGIES
from sharding.cli.common import (
    add_attention_arg,
    add_command,
    add_compiler_arg,
    add_model_args,
    console,
    non_negative_int,
    positive_int,
    workload_from_args,
)
from sharding.planning import DEFAULT_SIZES, MAX_AOT_DEVICES
from sharding.planning import plan as plan_layouts


class _Renamed(argparse.Action):
    """A flag that became part of --target: refuse it, naming the --target that means it."""

    def __init__(self, option_strings, dest, *, new, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"renamed: use {self.new(values)}")


def _devices_to_target(n: str) -> str:
    count = int(n) if n.isdigit() and int(n) > 0 else 8
    nodes = f"{count // 8}x8" if count % 8 == 0 else f"1x{count}" if count < 8 else "NODESx8"
    return f"--target h100:{nodes} (NODESxDEVICES per node; {n} devices)"


def _kind_to_target(kind: str) -> str:
    return f"--target {kind.split('-')[0].lower()}:1x8 (the device and its nodes)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "plan", help="rank strategies and meshes for a target cluster",
                    doc=__doc__, examples=["", "--model gpt2 --target h100:8x8 --aot 0 --json",
                                           "--size 70b --target h100:64x8 --top 5",
                                           "--model my_models.py:workload --target a100:1x8"])  # fmt: skip
    defaults = ", ".join(f"{s} for {f}" for f, s in DEFAULT_SIZES.items())
    add_model_args(p, size=None,
                   size_help=f" (default: {defaults}, the largest that fits 8 H100s; else tiny)")  # fmt: skip
    p.add_argument("--target", default="h100:1x8",
                   help="the cluster: DEVICE:NODESxPER (e.g. h100:64x8 = 512 H100s), DEVICE, or "
                   "a .toml device profile (devices: h100, h200, b200, a100, h100-96gb-500w, "
                   "v5e, v5p, v6e)")  # fmt: skip
    p.add_argument("--memory", help="memory a step may fill per device, e.g. 70GB (when unset: "
                   "90%% of the target's HBM)")  # fmt: skip
    p.add_argument("--batch", type=positive_int,
                   help="global batch in sequences (when unset: the target's devices)")  # fmt: skip
    p.add_argument("--seq", type=positive_int,
                   help="sequence length (when unset: min(4096, the model's maximum))")  # fmt: skip
    p.add_argument("--accum", type=positive_int, help="pin the gradient accumulation steps "
                   "(when unset: per layout the fewest that fit)")  # fmt: skip
    p.add_argument("--micro-batch", type=positive_int, help="pin the rows each device runs per "
                   "forward pass (Megatron's micro-batch size; when unset: searched)")  # fmt: skip
    p.add_argument("--layers", type=positive_int, help="override a shipped model's layer count")
    p.add_argument("--strategies", help=f"comma list (when unset: all of {','.join(STRATEGIES)})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="compute dtype")  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"),
                   help="optimizer whose state is counted")  # fmt: skip
    add_attention_arg(p, "priced (xla: the score matrix kept; the others flash-style)")
    p.add_argument("--top", type=positive_int, default=12, help="rows to show")
    p.add_argument("--aot", type=non_negative_int,
                   help=f"compile this many top layouts for the target beside their formula "
                   f"(when unset: 2 when the target has at most {MAX_AOT_DEVICES} devices)")  # fmt: skip
    add_compiler_arg(p)
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.add_argument("--devices", action=_Renamed, new=_devices_to_target)
    p.add_argument("--device-kind", action=_Renamed, new=_kind_to_target)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sharding import cpu_only, simulate_cpu_devices
    from sharding.targets import target

    tgt = target(args.target)  # a bad --target is refused before anything is loaded
    if tgt.devices <= MAX_AOT_DEVICES and cpu_only():  # before your module can start JAX
        with contextlib.suppress(RuntimeError):
            simulate_cpu_devices(tgt.devices)
    if args.size is None and args.model in DEFAULT_SIZES:
        args.size = DEFAULT_SIZES[args.model]
    result = plan_layouts(
        workload_from_args(args),
        target=tgt,
        memory=args.memory,
        batch=args.batch,
        seq=args.seq,
        layers=args.layers,
        strategies=args.strategies,
        dtype=args.dtype,
        optimizer=args.optimizer,
        top=args.top,
        aot=args.aot,
        compiler=args.compiler,
        attention=args.attention,
        accum=args.accum,
        micro_batch=args.micro_batch,
    )
    if args.json:
        print(result.to_json())
    else:
        console().print(result.table())
    return 0

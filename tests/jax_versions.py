"""What the installed jax compiles otherwise than jax 0.10.2, on which the closed forms' terms and
the compiled-program facts the tests assert were measured (README, "Tested with").

On jax 0.12 (measured with 0.12.1, Python 3.12):
- XLA:CPU slices bfloat16 natively, so it carries no float32 copies of bfloat16 stacks
  (`sharding.inspection.widened_bytes` finds none, rightly);
- the chunked schedules' regroup of the stage-sharded stack into chunks is partitioned otherwise:
  one all-to-all forward, and its transpose, which GSPMD reports as an "involuntary full
  rematerialization", an all-gather over ``stage`` of the gradients, where jax 0.10.2 runs a
  second all-to-all (interleaved; circular and interleaved under pp_cp);
- its scheduler leaves zb-h1 with 1% more temporaries than 1f1b (tests/test_pipeline.py).
"""

from __future__ import annotations

import jax

VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])
NEWER_PARTITIONER = VERSION >= (0, 12)
REGROUP = ("measured on jax 0.10.2's partitioner: jax 0.12 regroups the stack into chunks with "
           "an all-gather over stage in backward (tests/jax_versions.py)")  # fmt: skip

"""Context parallelism: attention over a sequence split on the ``context`` mesh axis.

Kernels (`allgather_attention`, `ring_attention`, `ulysses_attention`) with the model seam's
signature (`models.kernels`), each running the model's online softmax on its blocks (the
workload's ``attention_core``), the zigzag layout that balances causal work (`zigzag_positions`,
`to_zigzag`, `from_zigzag`, `batch_reorder`, `positions_kernel`), and the closed forms of the
bytes each moves (`context_traffic`).
"""

from sharding.context._errors import ContextParallelError
from sharding.context._kernels import (
    BALANCED,
    METHODS,
    allgather_attention,
    check_ulysses_heads,
    ring_attention,
    ulysses_attention,
)
from sharding.context._layout import (
    batch_reorder,
    check_balanced_seq,
    from_zigzag,
    positions_kernel,
    to_zigzag,
    zigzag_positions,
)
from sharding.context._setup import DEFAULT_METHOD, check_method, context_kernels, seam_calls
from sharding.context._traffic import ContextTraffic, context_traffic

__all__ = [
    "BALANCED",
    "DEFAULT_METHOD",
    "METHODS",
    "ContextParallelError",
    "ContextTraffic",
    "allgather_attention",
    "batch_reorder",
    "check_balanced_seq",
    "check_method",
    "check_ulysses_heads",
    "context_kernels",
    "context_traffic",
    "from_zigzag",
    "positions_kernel",
    "ring_attention",
    "seam_calls",
    "to_zigzag",
    "ulysses_attention",
    "zigzag_positions",
]

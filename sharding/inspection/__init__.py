"""Facts of a compiled program: collectives by kind and mesh axes, memory, FLOPs, peaks.

`compile_and_inspect` / `inspect_compiled` return a `ProgramReport` read from the executable
itself (HLO text with loops multiplied by their trip counts, `memory_analysis`); `count_flops`
counts matmul FLOPs loop-aware; `device_peak` / `host_peak` give the FLOP/s an MFU divides by.
"""

from sharding.inspection._errors import InspectionError
from sharding.inspection._flops import MATMUL_KINDS, FlopCount, FlopCounter, count_flops
from sharding.inspection._hlo import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    CollectiveSummary,
    parse_collectives,
    summarize,
)
from sharding.inspection._overlap import GPU_OVERLAP_OPTIONS, overlap_options, overlap_text
from sharding.inspection._report import (
    MemoryStats,
    ProgramReport,
    compile_and_inspect,
    inspect_compiled,
)
from sharding.inspection._roofline import (
    PEAK_FLOPS,
    Peak,
    UnknownDeviceKindError,
    device_peak,
    host_peak,
    measure_matmul_peak,
    mfu,
)
from sharding.inspection._widened import compile_partitioned, partitioned_widths, widened_bytes

__all__ = [
    "COLLECTIVE_KINDS",
    "GPU_OVERLAP_OPTIONS",
    "MATMUL_KINDS",
    "PEAK_FLOPS",
    "CollectiveOp",
    "CollectiveSummary",
    "FlopCount",
    "FlopCounter",
    "InspectionError",
    "MemoryStats",
    "Peak",
    "ProgramReport",
    "UnknownDeviceKindError",
    "compile_and_inspect",
    "compile_partitioned",
    "count_flops",
    "device_peak",
    "host_peak",
    "inspect_compiled",
    "measure_matmul_peak",
    "mfu",
    "overlap_options",
    "overlap_text",
    "parse_collectives",
    "partitioned_widths",
    "summarize",
    "widened_bytes",
]

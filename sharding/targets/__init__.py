"""Targets: the cluster a step is priced for, as a device profile on a topology of nodes.

`target` parses ``"h100:2x8"`` (2 nodes of 8 H100s), ``"h100"``, ``"h100:8"`` or a TOML device
profile into a `Target`; `PROFILES` are the shipped `DeviceSpec`s (H100, H200, B200, A100, TPU
v5e, v5p, v6e, each citing its datasheet, and the 500 W H100 96GB of torchtitan's runs, its
peaks from `capped_h100_peaks`); `load_profile` reads a user's (its docstring lists the keys and
units). `compiler_for` resolves which compiler a target's programs come from (`Compiler`): the
target's own (XLA:GPU from `CHIPS`' descriptions, libtpu) on compile-only devices where
installed, else XLA:CPU on simulated devices, saying so. `Target.topology(mesh)` lays a mesh on the nodes, tensor innermost, and
says which collective groups cross nodes and at which link they are priced. Every error is a
`TargetError`.

Example:
    >>> t = target("h100:2x8")
    >>> t.topology("tensor=2,data=8").group("data").link.name
    'InfiniBand'
"""

from sharding.targets._chips import CHIPS, GpuChip, TpuChip, gpu_target_config
from sharding.targets._compilers import (
    CHOICES,
    Compiler,
    CompilerError,
    check_choice,
    compiler_for,
    compiler_name,
)
from sharding.targets._devices import (
    PLATFORMS,
    DeviceSpec,
    TargetError,
    TargetProfileError,
    load_profile,
)
from sharding.targets._profiles import ALIASES, PROFILES, capped_h100_peaks
from sharding.targets._target import (
    FORMS,
    Group,
    Link,
    MalformedTargetError,
    Target,
    TargetSizeError,
    Topology,
    TopologyError,
    UnknownTargetError,
    target,
)

__all__ = [
    "ALIASES",
    "CHIPS",
    "CHOICES",
    "FORMS",
    "PLATFORMS",
    "PROFILES",
    "Compiler",
    "CompilerError",
    "DeviceSpec",
    "GpuChip",
    "Group",
    "Link",
    "MalformedTargetError",
    "Target",
    "TargetError",
    "TargetProfileError",
    "TargetSizeError",
    "Topology",
    "TopologyError",
    "TpuChip",
    "UnknownTargetError",
    "capped_h100_peaks",
    "check_choice",
    "compiler_for",
    "compiler_name",
    "gpu_target_config",
    "load_profile",
    "target",
]

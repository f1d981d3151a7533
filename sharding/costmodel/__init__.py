"""Closed-form predictions of a training step, and the layout search behind `spmdkit plan`.

`predict` gives one step's per-device collective bytes (by kind and mesh axes), memory and FLOPs
for a language-model family on any mesh, without devices; `candidates` ranks every layout of N
devices by an estimated step time on a `DeviceProfile`; `compile_candidate` checks one against an
ahead-of-time compile. Every error is a `CostModelError`.
"""

from sharding.costmodel._predict import CostModelError, Prediction, predict
from sharding.costmodel._search import (
    PROFILES,
    Candidate,
    DeviceProfile,
    NoFittingStrategyError,
    NoValidLayoutError,
    candidates,
    comm_seconds,
    compile_candidate,
    meshes,
)
from sharding.costmodel._traffic import Traffic

__all__ = [
    "PROFILES",
    "Candidate",
    "CostModelError",
    "DeviceProfile",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "Prediction",
    "Traffic",
    "candidates",
    "comm_seconds",
    "compile_candidate",
    "meshes",
    "predict",
]

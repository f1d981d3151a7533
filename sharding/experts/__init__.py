"""Expert parallelism: a mixture of experts' experts spread over the ``expert`` mesh axis.

`expert_parallel(mesh)` is the ``experts`` kernel (`models.kernels`) that `build_program`
substitutes when the mesh has ``expert > 1``: tokens dispatched to their experts' devices and
back with two all-to-alls per layer (`sharding.experts._kernel` explains the layout);
`ep_all_to_all_bytes` is what that costs per device per step, in closed form.
"""

from sharding.experts._kernel import ExpertParallelError, expert_kernels, expert_parallel
from sharding.experts._traffic import ALL_TO_ALLS_PER_LAYER, ep_all_to_all_bytes, expert_slots

__all__ = [
    "ALL_TO_ALLS_PER_LAYER",
    "ExpertParallelError",
    "ep_all_to_all_bytes",
    "expert_kernels",
    "expert_parallel",
    "expert_slots",
]

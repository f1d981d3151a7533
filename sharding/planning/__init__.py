"""`spmdkit plan`: which layout for a size you cannot run yet, above the cost model.

`plan` ranks layouts on a target from `sharding.costmodel`'s closed forms (llama, gpt2,
llama-moe), or, for any other workload, from the compiled programs of a few layouts per strategy
(`compiled_candidates`, compare's path in `sharding.comparison`); `check_candidate` compiles one
closed-form estimate for the target beside its formula. It sits above both packages, so the cost
model imports no command.
"""

from sharding.planning._check import check_candidate
from sharding.planning._compiled import compiled_candidates
from sharding.planning._plan import DEFAULT_SIZES, MAX_AOT_DEVICES, PlanError, PlanResult, plan

__all__ = [
    "DEFAULT_SIZES",
    "MAX_AOT_DEVICES",
    "PlanError",
    "PlanResult",
    "check_candidate",
    "compiled_candidates",
    "plan",
]

"""Strategies: where each logical axis goes on the mesh (`AxisMap`s), shared by every family.

Mesh axes: ``data`` (replicas; batch split), ``fsdp`` (batch split *and* parameters sharded,
ZeRO-3), ``tensor`` (Megatron: heads, MLP hidden and vocabulary split inside each layer), ``stage``
(pipeline: the stacked ``layers`` axis split into stages). Axes of size 1 are allowed everywhere, so
one strategy serves every mesh shape. Strategies place parameters only: the batch is split over
``("data", "fsdp")`` by the step compiler (`sharding.BATCH_AXES`), whatever the strategy.

Per-feature vectors (``norm``: norm scales, output biases of width d_model) are sharded over
``fsdp`` (ZeRO-3 shards everything) and replicated otherwise: under tensor or pipeline
parallelism they are a rounding error in bytes, and sharding them would cost a collective per use.

Strategies are keyed by the shipped logical axis names (`LOGICAL_AXES`). A rule table written
with names of its own takes the same strategy renamed: ``partition_rules.strategy("fsdp_tp",
embed="hidden", mlp="ffn")``.

Example:
    >>> FSDP_TP["embed"], FSDP_TP["heads"], FSDP_TP["layers"]
    ('fsdp', 'tensor', None)
"""

from __future__ import annotations

from partition_rules._rules import AxisMap

# Every logical axis a family table may use. A strategy maps each of them; a family that uses a
# name outside this list is reported by `sharding.resolve` as an unknown logical axis. Your own
# names: rename these with `partition_rules.strategy(name, embed="hidden", ...)`.
LOGICAL_AXES = (
    "layers",  # the stacked-blocks axis
    "vocab",  # vocabulary rows of embeddings and heads
    "embed",  # d_model
    "heads",  # query heads
    "kv_heads",  # key/value heads (grouped-query attention)
    "head_dim",
    "mlp",  # feed-forward hidden, and the wide classifier hidden of the CNN
    "norm",  # per-feature vectors
    "positions",  # learned position table rows
    "classes",  # classifier outputs
    "input",  # input features of the MLP
    "features",  # flattened CNN features entering the classifier
    "conv_in",
    "conv_out",
    "kernel_h",
    "kernel_w",
)

_REPLICATED = AxisMap({name: None for name in LOGICAL_AXES})

# Building blocks. `|` raises if two blocks disagree on a name, so the hybrids below are checked
# for consistency when this module is imported.
# ZeRO-3 shards every parameter, per-feature vectors included, so that parameter and optimizer
# bytes per device are the total over fsdp: a replicated remainder would grow with the mesh.
_FSDP = AxisMap({"embed": "fsdp", "features": "fsdp", "conv_out": "fsdp", "norm": "fsdp"})
_TP = AxisMap({"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
               "classes": "tensor"})  # fmt: skip
_PP = AxisMap({"layers": "stage"})


def _strategy(*blocks: AxisMap) -> AxisMap:
    named = AxisMap()
    for block in blocks:
        named = named | block
    # Whatever the blocks leave unnamed is replicated, stated explicitly per name.
    return named | AxisMap({k: v for k, v in _REPLICATED.items() if k not in named})


DP = _strategy()
FSDP = _strategy(_FSDP)
TP = _strategy(_TP)
FSDP_TP = _strategy(_FSDP, _TP)
DP_TP = _strategy(_TP)  # same map as TP: the mesh (data>1) makes it a hybrid
PP = _strategy(_PP)
PP_TP = _strategy(_PP, _TP)
PP_FSDP = _strategy(_PP, _FSDP)

STRATEGIES: dict[str, AxisMap] = {
    "dp": DP,
    "fsdp": FSDP,
    "tp": TP,
    "fsdp_tp": FSDP_TP,
    "dp_tp": DP_TP,
    "pp": PP,
    "pp_tp": PP_TP,
    "pp_fsdp": PP_FSDP,
}

# A mesh of 8 devices that suits each strategy on every family's tiny size (llama tiny has 8 query
# and 4 kv heads, gpt2 tiny 4 heads, so tensor stays <= 4). Used by tests, goldens and defaults.
EXAMPLE_MESHES_8: dict[str, str] = {
    "dp": "data=8",
    "fsdp": "fsdp=8",
    "tp": "data=2,tensor=4",
    "fsdp_tp": "data=2,fsdp=2,tensor=2",
    "dp_tp": "data=4,tensor=2",
    "pp": "stage=4,data=2",
    "pp_tp": "stage=2,data=2,tensor=2",
    "pp_fsdp": "stage=2,fsdp=4",
}

PIPELINE_STRATEGIES = frozenset(name for name, m in STRATEGIES.items() if m["layers"] == "stage")

# What each strategy splits, in the guides' terms (shown by `explain`, `compare`).
DESCRIPTIONS: dict[str, str] = {
    "dp": "batch split over data; every device holds all weights; gradients all-reduced once per step",
    "fsdp": "batch and weights split over fsdp (ZeRO-3); weights all-gathered per layer, "
    "gradients reduce-scattered",
    "tp": "each layer's matrices split over tensor (Megatron); activations all-reduced per layer",
    "fsdp_tp": "fsdp for weights and batch, tensor inside each layer",
    "dp_tp": "batch split over data, each layer's matrices over tensor",
    "pp": "depth split into stages; activations cross stage boundaries per micro-batch",
    "pp_tp": "stages over stage, each stage's matrices over tensor",
    "pp_fsdp": "stages over stage, each stage's weights split over fsdp",
}

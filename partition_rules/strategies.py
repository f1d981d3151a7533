"""Strategies: where each logical axis goes on the mesh (`AxisMap`s), shared by every family.

Mesh axes: ``data`` (replicas; batch split), ``fsdp`` (batch split *and* parameters sharded,
ZeRO-3), ``tensor`` (Megatron: heads, MLP hidden and vocabulary split inside each layer), ``stage``
(pipeline: the stacked ``layers`` axis split into stages). Axes of size 1 are allowed everywhere, so
one strategy serves every mesh shape. Strategies place parameters, plus one activation axis:
the batch is split over the batch axes by the step compiler (`sharding.BATCH_AXES`), whatever the
strategy, and ``"sequence"`` says where the sequence of the stack's activations (and of the batch)
goes: ``tensor`` (Megatron sequence parallelism, tp_sp) or ``context`` (context parallelism, cp).

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

from partition_rules._compose import ALIASES, composition
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
    # An activation axis: it names no parameter dimension. It says where the sequence dimension
    # of the stack's activations and of the batch goes (dim 1 of ``h[B, S, D]`` and of the token
    # arrays): ``"tensor"`` is Megatron sequence parallelism, ``"context"`` context parallelism.
    "sequence",
    "experts",  # a mixture of experts' expert dimension (llama-moe's [E, D, F] weights)
)

# Every strategy is a composition of parts (`partition_rules._compose`); today's names are
# aliases of compositions, their maps built from the parts' blocks in one place.
STRATEGIES: dict[str, AxisMap] = {name: composition(c).axis_map for name, c in ALIASES.items()}

DP, FSDP, TP, FSDP_TP = (STRATEGIES[n] for n in ("dp", "fsdp", "tp", "fsdp_tp"))

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
    "tp_sp": "data=2,tensor=4",
    "fsdp_tp_sp": "data=2,fsdp=2,tensor=2",
    "cp": "data=2,context=4",
    "fsdp_cp": "fsdp=2,context=4",
    "cp_tp_sp": "data=2,context=2,tensor=2",
    "ep": "expert=4,data=2",
    "fsdp_ep": "fsdp=2,expert=4",
    "ep_tp": "expert=2,tensor=2,data=2",
    "pp_cp": "stage=2,data=2,context=2",
    "pp_tp_sp": "stage=2,data=2,tensor=2",
    "pp_ep": "stage=2,expert=2,data=2",
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
    "tp_sp": "tp plus Megatron sequence parallelism: norms and residuals split over the sequence "
    "on tensor; activations all-gathered and reduce-scattered per layer instead of all-reduced",
    "fsdp_tp_sp": "fsdp for weights and batch, tensor inside each layer with the sequence split "
    "over tensor between its matmuls",
    "cp": "batch split over data, sequence over context; every device holds all weights; "
    "attention gathers keys/values over context; gradients all-reduced over data and context",
    "fsdp_cp": "weights split over fsdp (ZeRO-3), sequence over context; weights all-gathered "
    "per layer, attention gathers keys/values over context",
    "cp_tp_sp": "cp and tp_sp together: the sequence over context everywhere and over tensor too "
    "between each layer's tensor-parallel matmuls",
    "ep": "experts split over expert, batch over data and expert; tokens sent to their experts "
    "and back by two all-to-alls per MoE layer; other weights replicated",
    "fsdp_ep": "ep with every weight also split over fsdp (ZeRO-3): the experts over expert on "
    "their expert dimension and over fsdp on d_model, the rest over fsdp",
    "ep_tp": "ep with attention heads and each expert's hidden width split over tensor",
    "pp_cp": "stages over stage, the sequence over context inside each stage: attention passes "
    "keys/values over context, activations cross stage boundaries sequence-split",
    "pp_tp_sp": "stages over stage, each stage's matrices over tensor with the sequence split "
    "over tensor between them (Megatron SP inside each stage)",
    "pp_ep": "stages over stage, each stage's experts split over expert: tokens sent to their "
    "experts and back by all-to-alls inside each stage",
}

"""Memory-bound work of a step in closed form: the bytes its non-matmul operations move.

A layer's matmuls run near the device's matmul peak; everything between them (norms, residual
adds, the MLP's activation, rotary embeddings, a materialised softmax) streams its operands
through HBM and is priced at the memory bandwidth (`sharding.costmodel.step_time`). Per token
and layer, counted as elements read plus written by each operation, every operation its own
kernel (no fusion across them assumed):

- a norm reads x and writes y (2 widths); its backward reads x and dy and writes dx (3);
- a residual add reads two and writes one (3); in the backward the two cotangents are summed
  where the branches join (3); one residual add per norm (pre-norm blocks);
- the MLP's activation on its d_ff slots (a mixture of experts: every expert's, on the capacity
  slots a token fills on average): GELU reads and writes (2), its backward reads x and dy and
  writes dx (3); a gated one (SwiGLU) reads gate and up and writes one (3), its backward reads
  three and writes two (5);
- rotary embeddings read and write q and k (2 each way, forward and backward);
- attention without a flash kernel ("xla") materialises its scores over its keys: the float32
  scores written and read by the softmax, the probabilities (compute dtype) written and read by
  the value product; in the backward the probabilities' cotangent written and read, the
  probabilities read, the float32 scores' cotangent written and read by two products (3 float32
  and 3 compute-dtype passes); a flash kernel keeps them on chip (its time is its FLOPs');
- remat (full or dots) runs the forward's elementwise work again in the backward;
- the loss reads the float32 logits, and its backward reads them again, writes their cotangent,
  which the head's two gradient matmuls read: 4 float32 passes over the local vocabulary.

Widths are per device: d_model-wide tensors split over ``tensor`` only under sequence
parallelism (tensor parallelism alone repeats the norms on every device), d_ff and heads by the
kernels' tensor split, tokens over the batch axes and ``context``.
"""

from __future__ import annotations

from typing import Any

from sharding.costmodel._sequence import splits_sequence_over_tensor

SCORE_BYTES = 4  # scores and softmax in float32 (models.attention's reference kernel)
LOSS_BYTES = 4  # float32 logits in the loss (models.layers.cross_entropy)
# Passes over the score matrix: (float32 ones, compute-dtype ones), forward and backward.
SCORE_PASSES = {"forward": (2, 2), "backward": (3, 3)}
LOSS_PASSES = 4


def _modules(s: Any, name: str) -> int:
    """Per-layer modules holding a parameter called ``name`` (norms: their ``scale``)."""
    return len({q.path.rpartition("/")[0] for q in s.params
                if q.role == "layer" and q.path.rpartition("/")[2] == name})  # fmt: skip


def layer_elements(s: Any) -> tuple[float, float, float]:
    """(forward, backward, score elements) one layer moves per local token on one device;
    scores are 0 under a flash kernel."""
    cfg, t = s.cfg, s.sizes["tensor"]
    hw = cfg.d_model / (t if splits_sequence_over_tensor(s) else 1)
    mlp = [q for q in s.params if q.role == "layer" and len(q.shape) >= 3
           and q.logical[-1] == "mlp"]  # fmt: skip
    # an expert kernel [L, E, D, F] runs on its E experts' capacity slots (expert_share of each)
    slots = getattr(cfg, "n_experts", None) or 1
    fw = cfg.d_ff / s.split("mlp") * slots * s.expert_share if mlp else 0.0
    gated = len({q.path for q in mlp}) > 1
    norms = max(_modules(s, "scale"), 1)
    fwd = norms * (2 + 3) * hw + (3 if gated else 2) * fw
    bwd = norms * (3 + 3) * hw + (5 if gated else 3) * fw
    if hasattr(cfg, "rope_theta"):
        head_dim = getattr(cfg, "head_dim", cfg.d_model // cfg.n_heads)
        width = (cfg.n_heads + getattr(cfg, "n_kv_heads", cfg.n_heads)) * head_dim
        fwd, bwd = fwd + 2 * width / s.split("heads"), bwd + 2 * width / s.split("heads")
    scores = 0.0 if s.flash else cfg.n_heads / s.split("heads") * s.attention_keys
    return fwd, bwd, scores


def elementwise_bytes(s: Any, rows: int) -> float:
    """Bytes the non-matmul work of one step moves on one device, for ``rows`` sequences per
    device (the module doc's count; pipelines: each device's own layers, every micro-batch)."""
    fwd, bwd, scores = layer_elements(s)
    again = s.remat in ("full", "dots")  # the forward's elementwise work runs again
    dense = (fwd * (2 if again else 1) + bwd) * s.act_bytes
    (f32_f, narrow_f), (f32_b, narrow_b) = SCORE_PASSES["forward"], SCORE_PASSES["backward"]
    f32 = f32_f * (2 if again else 1) + f32_b
    narrow = narrow_f * (2 if again else 1) + narrow_b
    attention = scores * (f32 * SCORE_BYTES + narrow * s.act_bytes)
    tokens = rows * s.local_seq
    layers = s.cfg.n_layers / s.sizes["stage"]
    return tokens * (layers * (dense + attention) + LOSS_PASSES * LOSS_BYTES * s.vocab)


__all__ = ["elementwise_bytes", "layer_elements"]

"""Models written from scratch as a user would, with their own module, parameter and logical axis
names: nothing here comes from the shipped families except the `make_stacked` building block.

- `transformer(form=...)`: a small decoder whose blocks take extra per-layer inputs (a padding
  mask and a learned position bias computed before the stack), stacked (``form="stacked"``) or
  as a Python list of blocks (``form="list"``); optional L2 penalties in the loss.
- `fused()`: a decoder written from the README's contract with real attention: one fused
  ``nnx.Linear(D, 3D)`` query/key/value projection cut into heads, a padding mask per layer.
  Split over ``tensor`` on its 3D outputs, cutting q, k and v apart needs XLA to move columns
  between the tensor shards (a collective-permute) inside every layer, forward and backward.
- `cnn()`: a convolutional stack and a wide two-layer classifier: the guides' hybrid case
  (convolutions data-parallel, the classifier split over ``tensor``).

The CLI tests copy this file into a temporary directory and name ``user_models.py:transformer``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import make_stacked
from partition_rules import Rules
from sharding import Workload

VOCAB, WIDTH, FFN, DEPTH, SEQ = 96, 32, 64, 4, 16


def _init(rngs: nnx.Rngs, *shape: int, scale: float = 0.1) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, jnp.float32))


class Block(nnx.Module):
    """x + causal masked mixing, then x + MLP; every layer reads the mask and the position bias."""

    def __init__(self, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((WIDTH,)))
        self.mix = _init(rngs, WIDTH, WIDTH)
        self.up = _init(rngs, WIDTH, FFN)
        self.down = _init(rngs, FFN, WIDTH)

    def __call__(self, h, mask, pos_bias):
        x = h * self.scale[...] + pos_bias
        causal = jnp.tril(jnp.ones((h.shape[1], h.shape[1]), h.dtype))
        weights = causal[None] * mask[:, None, :]
        weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
        h = h + jnp.einsum("bst,btd->bsd", weights, x @ self.mix[...])
        return h + jax.nn.gelu(h @ self.up[...]) @ self.down[...]


class TinyDecoder(nnx.Module):
    def __init__(self, form: str, *, rngs: nnx.Rngs):
        self.tok = _init(rngs, VOCAB, WIDTH, scale=1.0)
        self.pos = _init(rngs, SEQ, WIDTH)
        if form in ("stacked", "shared_bias"):
            self.blocks = make_stacked(lambda r: Block(r), DEPTH, rngs)
        else:
            self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])
        self.form = form
        self.unembed = _init(rngs, WIDTH, VOCAB)

    def __call__(self, ids, mask):
        h = self.tok[...][ids]
        pos_bias = self.pos[...][: ids.shape[1]]  # [S, D]: the same for every row
        if self.form != "shared_bias":  # a pipeline cuts stack inputs by rows: give it rows
            pos_bias = jnp.broadcast_to(pos_bias, h.shape)
        mask = mask.astype(h.dtype)
        if self.form != "list":
            h = self.blocks(h, mask, pos_bias=pos_bias)
        else:
            for block in self.blocks:
                h = block(h, mask, pos_bias)
        return h @ self.unembed[...]


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def decoder_loss(model: TinyDecoder, batch: dict) -> jax.Array:
    return cross_entropy(model(batch["ids"], batch["mask"]), batch["labels"])


def l2_loss(model: TinyDecoder, batch: dict) -> jax.Array:
    """Cross-entropy plus an L2 penalty on every weight, the layer stack's included."""
    penalty = sum(jnp.sum(w**2) for w in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return decoder_loss(model, batch) + 1e-2 * penalty


def head_l2_loss(model: TinyDecoder, batch: dict) -> jax.Array:
    """Cross-entropy plus an L2 penalty on the output projection only (no stack weight)."""
    return decoder_loss(model, batch) + 1e-2 * jnp.sum(model.unembed[...] ** 2)


def decoder_batch(batch: int, seq: int | None = None, key=None) -> dict:
    seq = seq or SEQ
    key = jax.random.key(3) if key is None else key
    ids = jax.random.randint(key, (batch, seq + 1), 0, VOCAB, jnp.int32)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (batch, 1), seq // 2, seq + 1)
    mask = (jnp.arange(seq)[None] < lengths).astype(jnp.int32)
    return {"ids": ids[:, :-1], "mask": mask, "labels": ids[:, 1:]}


def decoder_shapes(batch: int, seq: int | None = None) -> dict:
    ints = jax.ShapeDtypeStruct((batch, seq or SEQ), jnp.int32)
    return {"ids": ints, "mask": ints, "labels": ints}


STACKED_RULES = Rules(
    [
        (r"tok", ("words", "hidden")),
        (r"pos", (None, "hidden")),
        (r"blocks/scale", ("depth", None)),
        (r"blocks/mix", ("depth", "hidden", None)),
        (r"blocks/up", ("depth", "hidden", "ffn")),
        (r"blocks/down", ("depth", "ffn", "hidden")),
        (r"unembed", ("hidden", "words")),
    ]
)
LIST_RULES = Rules(
    [
        (r"tok", ("words", "hidden")),
        (r"pos", (None, "hidden")),
        (r"blocks/\d+/scale", (None,)),
        (r"blocks/\d+/mix", ("hidden", None)),
        (r"blocks/\d+/up", ("hidden", "ffn")),
        (r"blocks/\d+/down", ("ffn", "hidden")),
        (r"unembed", ("hidden", "words")),
    ]
)
# Which of our names play the shipped roles, so every shipped strategy applies.
NAMES = {"layers": "depth", "embed": "hidden", "mlp": "ffn", "vocab": "words"}


def transformer(form: str = "stacked", loss=decoder_loss) -> Workload:
    return Workload(
        name=f"tiny-decoder-{form}",
        model=lambda rngs: TinyDecoder(form, rngs=rngs),
        loss=loss,
        batch_shapes=decoder_shapes,
        rules=LIST_RULES if form == "list" else STACKED_RULES,
        names=NAMES,
        stack=None if form == "list" else "blocks",
        seq=SEQ,
        make_batch=decoder_batch,
    )


# --- attention with a fused query/key/value projection ----------------------------------------
HEADS = 4


class FusedBlock(nnx.Module):
    """Causal attention over the unmasked positions, q, k and v from one fused projection."""

    def __init__(self, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((WIDTH,)))
        self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.up = _init(rngs, WIDTH, FFN)
        self.down = _init(rngs, FFN, WIDTH)

    def __call__(self, h, mask, pos_bias):
        b, s, _ = h.shape
        x = h * self.scale[...] + pos_bias
        q, k, v = (t.reshape(b, s, HEADS, WIDTH // HEADS) for t in jnp.split(self.qkv(x), 3, -1))
        scores = jnp.einsum("bsnh,btnh->bnst", q, k) / (WIDTH // HEADS) ** 0.5
        keep = jnp.tril(jnp.ones((s, s), bool))[None, None] & (mask[:, None, None, :] > 0)
        weights = jax.nn.softmax(jnp.where(keep, scores, -1e9), axis=-1)
        h = h + self.out(jnp.einsum("bnst,btnh->bsnh", weights, v).reshape(b, s, WIDTH))
        return h + jax.nn.gelu(h @ self.up[...]) @ self.down[...]


class FusedDecoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.tok = _init(rngs, VOCAB, WIDTH, scale=1.0)
        self.pos = _init(rngs, SEQ, WIDTH)
        self.blocks = make_stacked(lambda r: FusedBlock(r), DEPTH, rngs)
        self.unembed = _init(rngs, WIDTH, VOCAB)

    def __call__(self, ids, mask):
        h = self.tok[...][ids]
        pos_bias = jnp.broadcast_to(self.pos[...][: ids.shape[1]], h.shape)
        h = self.blocks(h, mask.astype(h.dtype), pos_bias=pos_bias)
        return h @ self.unembed[...]


FUSED_RULES = Rules(
    [
        (r"tok", ("words", "hidden")),
        (r"pos", (None, "hidden")),
        (r"blocks/scale", ("depth", None)),
        (r"blocks/qkv/kernel", ("depth", "hidden", "fused_heads")),
        (r"blocks/out/kernel", ("depth", "fused_heads", "hidden")),
        (r"blocks/up", ("depth", "hidden", "ffn")),
        (r"blocks/down", ("depth", "ffn", "hidden")),
        (r"unembed", ("hidden", "words")),
    ]
)


def fused() -> Workload:
    return Workload(
        name="tiny-decoder-fused-qkv",
        model=lambda rngs: FusedDecoder(rngs=rngs),
        loss=lambda model, batch: cross_entropy(
            model(batch["ids"], batch["mask"]), batch["labels"]
        ),
        batch_shapes=decoder_shapes,
        rules=FUSED_RULES,
        names={**NAMES, "heads": "fused_heads"},
        stack="blocks",
        seq=SEQ,
        make_batch=decoder_batch,
    )


# --- a CNN with a wide classifier ---------------------------------------------------------------
CHANNELS, IMAGE, WIDE, CLASSES = 8, 8, 128, 1000


class ConvBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.kernel = _init(rngs, 3, 3, CHANNELS, CHANNELS)
        self.bias = nnx.Param(jnp.zeros((CHANNELS,)))

    def __call__(self, h):
        y = jax.lax.conv_general_dilated(h, self.kernel[...], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
        return h + jax.nn.gelu(y + self.bias[...])


class ImageNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.stem = _init(rngs, 3, 3, 3, CHANNELS)
        self.trunk = make_stacked(lambda r: ConvBlock(r), DEPTH, rngs)
        self.fc1 = _init(rngs, IMAGE * IMAGE * CHANNELS // 4, WIDE)
        self.fc2 = _init(rngs, WIDE, CLASSES)

    def __call__(self, images):
        h = jax.lax.conv_general_dilated(images, self.stem[...], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
        h = self.trunk(h)
        h = h.reshape(h.shape[0], IMAGE // 2, 2, IMAGE // 2, 2, CHANNELS).mean((2, 4))
        return jax.nn.gelu(h.reshape(h.shape[0], -1) @ self.fc1[...]) @ self.fc2[...]


def cnn_loss(model: ImageNet, batch: dict) -> jax.Array:
    return cross_entropy(model(batch["images"]), batch["labels"])


def cnn_batch(batch: int, seq: int | None = None, key=None) -> dict:
    key = jax.random.key(4) if key is None else key
    images = jax.random.normal(key, (batch, IMAGE, IMAGE, 3), jnp.float32)
    labels = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, CLASSES, jnp.int32)
    return {"images": images, "labels": labels}


def cnn_shapes(batch: int, seq: int | None = None) -> dict:
    return {
        "images": jax.ShapeDtypeStruct((batch, IMAGE, IMAGE, 3), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch,), jnp.int32),
    }


CNN_RULES = Rules(
    [
        (r"stem", (None, None, None, "chan")),
        (r"trunk/kernel", ("depth", None, None, None, "chan")),
        (r"trunk/bias", ("depth", "chan")),
        (r"fc1", ("flat", "wide")),  # column-parallel under tensor strategies
        (r"fc2", ("wide", None)),  # row-parallel: its rows already on tensor
    ]
)


def cnn() -> Workload:
    return Workload(
        name="tiny-cnn",
        model=lambda rngs: ImageNet(rngs=rngs),
        loss=cnn_loss,
        batch_shapes=cnn_shapes,
        rules=CNN_RULES,
        names={"layers": "depth", "conv_out": "chan", "features": "flat", "mlp": "wide"},
        stack="trunk",
        make_batch=cnn_batch,
    )

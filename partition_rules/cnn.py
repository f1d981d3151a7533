"""CNN family: the classic hybrid. Convolutions carry few weights and much compute, so they stay
data-parallel; the very wide classifier head carries most weights, so tensor strategies split it
Megatron-style (fc1 by columns over ``mlp``, fc2 by rows)."""

from partition_rules._rules import Rules

RULES = Rules(
    [
        (r"stem/kernel", ("kernel_h", "kernel_w", "conv_in", "conv_out")),
        (r"stem/bias", ("conv_out",)),
        (r"layers/norm/scale", ("layers", "norm")),
        (r"layers/conv(1|2)/kernel", ("layers", "kernel_h", "kernel_w", "conv_in", "conv_out")),
        (r"layers/conv(1|2)/bias", ("layers", "conv_out")),
        (r"head/fc1/kernel", ("features", "mlp")),
        (r"head/fc1/bias", ("mlp",)),
        # Row-parallel half of the Megatron pair: its rows already use the tensor axis, so its
        # class dimension stays whole (naming it "classes" would put `tensor` on it twice).
        (r"head/fc2/kernel", ("mlp", None)),
        (r"head/fc2/bias", (None,)),
    ]
)

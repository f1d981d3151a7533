"""MLP classifier family: input projection, stacked residual blocks, output layer."""

from partition_rules._rules import Rules

RULES = Rules(
    [
        (r"input/kernel", ("input", "embed")),
        (r"input/bias", ("norm",)),
        (r"layers/fc1/kernel", ("layers", "embed", "mlp")),
        (r"layers/fc1/bias", ("layers", "mlp")),
        (r"layers/fc2/kernel", ("layers", "mlp", "embed")),
        (r"layers/fc2/bias", ("layers", "norm")),
        (r"output/kernel", ("embed", "classes")),
        (r"output/bias", ("classes",)),
    ]
)

"""Errors for input the model families cannot take, one base: `ModelError` (a `ValueError`).

`models` knows nothing of `sharding`, so these are not `sharding.SpmdkitError`s; they are
`ValueError`s, as every spmdkit error is, and the CLI reports them the same way. Each message
states the fact (which value, which limit) and the Python fix.
"""

from __future__ import annotations


class ModelError(ValueError):
    """A model family cannot take this input: the message names the value and the fix."""


class UnknownFamilyError(ModelError):
    """`get_family` of a name that is not a registered family."""


class ModelConfigError(ModelError):
    """An unknown size, an unknown field, or a field value the model cannot be built with."""


class BatchError(ModelError):
    """A batch the model cannot compute on: wrong entries, shapes, dtypes or token ids."""


class AttentionKernelError(ModelConfigError):
    """An attention kernel that cannot run here, or on these shapes."""

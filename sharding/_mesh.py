"""Mesh declaration: ``"data=2,fsdp=-1,tensor=2"`` -> a validated `MeshSpec` -> a `jax.sharding.Mesh`.

Every spmdkit mesh has the same six axes in the same order, whatever order the user wrote them in:

    stage, data, fsdp, expert, context, tensor

Axes not written have size 1, so one partition preset serves every mesh shape. The order is the
device order: `jax.make_mesh` gives the innermost (last) axis the closest devices; it follows
Megatron's ``tp-cp-ep-dp-pp``, innermost first. ``tensor`` goes innermost because tensor
parallelism exchanges activations inside every layer, forward and backward, and needs the fastest
links (NVLink within a host); ``context`` next, its key/value blocks (ring attention) or
all-to-alls (Ulysses) are per attention layer but overlap with the attention's compute;
``expert`` then, its token all-to-alls are per mixture-of-experts layer, twice forward and twice
backward; ``fsdp`` next, its weight gathers are per layer but overlap with compute; ``data``
exchanges gradients once per step; ``stage`` outermost, its point-to-point activation transfers
are the lightest traffic and tolerate the slowest links (across hosts).

``expert`` splits the batch like ``data`` (tokens are exchanged with the experts' devices only
inside a mixture-of-experts layer), so `BATCH_AXES` is data, fsdp, expert; ``context`` splits
the sequence of every sequence-shaped activation.

Axis types are all ``Auto`` (GSPMD), chosen deliberately: jax 0.10's `jax.make_mesh` defaults to
``Explicit``, which would make every ambiguous contraction in model code a trace-time error
needing an ``out_sharding=`` (model code would then carry device logic), and in a pipeline's
``shard_map`` that is manual over ``stage`` only, operands sharded on Explicit automatic axes are
all-gathered at the boundary. With Auto axes the shardings live in `jax.jit`'s in/out shardings
and XLA propagates them; the model stays the same under every strategy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import numpy as np
from jax import sharding as jshard

from sharding._errors import SpmdkitError

AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
# The mesh axes a global batch is split over: every strategy splits it over data x fsdp x expert.
BATCH_AXES = ("data", "fsdp", "expert")
# The mesh axis the sequence of every sequence-shaped activation is split over.
SEQUENCE_AXIS = "context"


class MeshSpecError(SpmdkitError):
    """A mesh declaration that cannot be built."""


class MalformedMeshSpecError(MeshSpecError):
    """The spec string is not ``name=size,name=size,...``."""


class UnknownMeshAxisNameError(MeshSpecError):
    """The spec names an axis other than stage, data, fsdp, expert, context, tensor."""


class MultipleFillAxesError(MeshSpecError):
    """More than one axis is -1."""


class MeshSizeMismatchError(MeshSpecError):
    """The axis sizes do not multiply to the device count."""


_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the six mesh axes; at most one may be -1 ("whatever is left").

    Example:
        >>> spec = MeshSpec.parse("tensor=2,data=2,fsdp=-1")
        >>> spec.resolve(8).sizes
        {'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}
        >>> str(spec)
        'data=2,fsdp=-1,tensor=2'
    """

    stage: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        bad = {
            a: s
            for a, s in self.sizes.items()
            if isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1)
        }
        if bad:
            raise MalformedMeshSpecError(
                "mesh spec: axis sizes must be positive integers or -1, got "
                + ", ".join(f"{a}={s!r} ({type(s).__name__})" for a, s in bad.items())
                + "; e.g. MeshSpec(data=2, tensor=4) or MeshSpec.parse('data=2,tensor=4')"
            )
        fills = [a for a, s in self.sizes.items() if s == -1]
        if len(fills) > 1:
            raise MultipleFillAxesError(
                f"mesh spec {self!s}: at most one axis may be -1, got {len(fills)} "
                f"({', '.join(fills)}). Give all but one of them a size."
            )

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """Parse ``"data=2,fsdp=-1,tensor=2,stage=1"`` (any order, spaces allowed)."""
        if not isinstance(text, str):
            raise TypeError(
                f"mesh spec must be a string like 'data=2,tensor=4', got {type(text).__name__} "
                f"{text!r}"
            )
        if not text.strip():
            raise MalformedMeshSpecError(
                f"mesh spec {text!r} is empty; write e.g. 'data=2,fsdp=2,tensor=2'"
            )
        sizes: dict[str, int] = {}
        for item in text.split(","):
            m = _ITEM.match(item)
            if not m:
                raise MalformedMeshSpecError(
                    f"mesh spec {text!r}: cannot read {item.strip()!r}; each item is name=size "
                    f"with a name from {', '.join(AXES)}, e.g. 'data=2,tensor=4' or 'fsdp=-1'"
                )
            name, size = m.group(1), int(m.group(2))
            if name not in AXES:
                raise UnknownMeshAxisNameError(
                    f"mesh spec {text!r}: unknown axis {name!r}; the axes are "
                    f"{', '.join(AXES)} (e.g. 'data=2,{'tensor' if name != 'tensor' else 'fsdp'}=4')"
                )
            if name in sizes:
                raise MalformedMeshSpecError(
                    f"mesh spec {text!r}: axis {name!r} is given twice ({name}={sizes[name]} and "
                    f"{name}={size}); give it once"
                )
            sizes[name] = size
        return cls(**sizes)

    @classmethod
    def of(cls, spec: MeshSpec | str | dict | None) -> MeshSpec:
        """Accept a MeshSpec, a spec string, a dict of sizes, or None (all devices on data)."""
        if spec is None:
            return cls(data=-1)
        if isinstance(spec, MeshSpec):
            return spec
        if isinstance(spec, str):
            return cls.parse(spec)
        if not isinstance(spec, dict):
            raise TypeError(
                f"a mesh is a MeshSpec, a spec string like 'data=2,tensor=4', a dict of axis sizes "
                f"or None (all devices on data); got {type(spec).__name__} {spec!r}"
            )
        unknown = sorted(set(spec) - set(AXES))
        if unknown:
            raise UnknownMeshAxisNameError(
                f"mesh sizes {spec!r}: unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)}"
            )
        return cls(**spec)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes in canonical order (`AXES`)."""
        return {a: getattr(self, a) for a in AXES}

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.sizes.items() if s != 1) or "data=1"

    @property
    def size(self) -> int:
        """The device count this spec needs (only defined once resolved: no -1 left)."""
        if -1 in self.sizes.values():
            raise MeshSpecError(f"mesh spec {self!s} has a -1 axis; call resolve(n_devices) first")
        return math.prod(self.sizes.values())

    def resolve(self, n_devices: int) -> MeshSpec:
        """Fill the -1 axis and check the sizes multiply to `n_devices`."""
        known = math.prod(s for s in self.sizes.values() if s != -1)
        fill = next((a for a, s in self.sizes.items() if s == -1), None)
        if fill is not None:
            if n_devices % known:
                raise MeshSizeMismatchError(
                    f"mesh spec {self!s} on {n_devices} devices: the fixed axes multiply to "
                    f"{known}, which does not divide {n_devices}, so {fill}=-1 cannot be filled. "
                    f"Choose fixed sizes whose product divides {n_devices} "
                    f"(e.g. '{_suggest(self, n_devices)}')."
                )
            return MeshSpec(**{**self.sizes, fill: n_devices // known})
        if known != n_devices:
            raise MeshSizeMismatchError(
                f"mesh spec {self!s} multiplies to {known} devices but {n_devices} are available. "
                f"Make the sizes multiply to {n_devices}, or write one axis as -1 to take the rest "
                f"(e.g. '{_suggest(self, n_devices)}')."
            )
        return self

    def build(self, devices: list | None = None) -> jshard.Mesh:
        """A `jax.sharding.Mesh` with the six axes in canonical order, all of type Auto."""
        devices = list(jax.devices() if devices is None else devices)
        spec = self.resolve(len(devices))
        shape = tuple(spec.sizes.values())
        auto = (jshard.AxisType.Auto,) * len(AXES)
        if devices == list(jax.devices()):
            # Let JAX lay the axes onto the physical topology (innermost = closest devices).
            return jax.make_mesh(shape, AXES, axis_types=auto)
        return jshard.Mesh(np.array(devices).reshape(shape), AXES, axis_types=auto)


def _suggest(spec: MeshSpec, n_devices: int) -> str:
    """A nearby spec that fits: one written axis turned into -1, else all on data.

    Pure arithmetic (never `resolve`, whose error message calls this).
    """
    fixed = {a: s for a, s in spec.sizes.items() if s not in (-1, 1)}
    for axis in sorted(fixed, key=lambda a: -fixed[a]):
        others = math.prod(s for a, s in fixed.items() if a != axis)
        if n_devices % others == 0:
            return str(MeshSpec(**{**fixed, axis: -1}))
    return f"data={n_devices}"


def mesh_sizes(mesh: jshard.Mesh | jshard.AbstractMesh | MeshSpec) -> dict[str, int]:
    """Axis name -> size for a jax mesh or a (resolved) MeshSpec."""
    if isinstance(mesh, MeshSpec):
        if -1 in mesh.sizes.values():
            raise MeshSpecError(f"mesh spec {mesh!s} has a -1 axis; resolve it first")
        return mesh.sizes
    return dict(mesh.shape)


def mesh_text(mesh: jshard.Mesh | jshard.AbstractMesh | MeshSpec | dict) -> str:
    """The short text of a mesh: its axes larger than 1, ``"stage=2,data=4"``; ``"data=1"`` alone.

    Example:
        >>> mesh_text({"stage": 1, "data": 4, "fsdp": 1, "tensor": 2})
        'data=4,tensor=2'
    """
    sizes = (
        mesh
        if isinstance(mesh, dict)
        else mesh_sizes(mesh)
        if not isinstance(mesh, MeshSpec)
        else mesh.sizes
    )
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "data=1"


def make_mesh(
    spec: MeshSpec | str | dict | None = None, devices: list | None = None
) -> jshard.Mesh:
    """Build the mesh for `spec` over `devices` (default: all devices).

    Example:
        >>> mesh = make_mesh("data=2,fsdp=2,tensor=2")  # doctest: +SKIP
        >>> dict(mesh.shape)  # doctest: +SKIP
        {'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}
    """
    return MeshSpec.of(spec).build(devices)


def simulate_cpu_devices(n: int) -> None:
    """Make the CPU backend expose `n` devices. Must run before JAX initialises its backends.

    Raises RuntimeError, rather than silently giving one device, if any JAX computation (or
    `jax.devices()`) has already run in this process.
    """
    from jax._src import xla_bridge  # the one reliable "already initialised?" probe

    if xla_bridge.backends_are_initialized():
        have = jax.device_count()
        if have == n and jax.default_backend() == "cpu":
            return
        raise RuntimeError(
            f"simulate_cpu_devices({n}): JAX is already initialised with {have} "
            f"{jax.default_backend()} device(s), and the device count can no longer change. Call "
            f"it before any JAX computation or jax.devices(), e.g. first thing in main() or in "
            f"conftest.py, or set JAX_NUM_CPU_DEVICES={n} in the environment."
        )
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)

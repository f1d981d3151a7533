"""A target is a device profile on a topology: ``target("h100:2x8")`` is 2 nodes of 8 H100s.

`target` reads ``NAME`` (one node of the profile's default size), ``NAME:COUNT`` (COUNT devices
on one node, refused if they do not fit one), ``NAME:NODESxPER`` and ``path/to/profile.toml``
(optionally with ``:COUNT`` or ``:NODESxPER`` after it); NAME is a key of `PROFILES` or an
`ALIASES` spelling.

`Topology` lays a mesh on the target's nodes the way `sharding.make_mesh` orders devices: device
ids row-major over ``AXES`` (stage, data, fsdp, expert, context, tensor; tensor innermost), node k holding ids
``k * per_node ... (k + 1) * per_node - 1``. A collective over a set of axes runs in groups of
devices that differ only along those axes. A group inside one node runs at the intra-node link.
A group that spans nodes sends a device's own point-to-point bytes (permutes, all-to-all) through
that device's NIC (`Group.link`), and runs its ring collectives over the rails: with k of its
devices on each node, a ring leaves every node through k NICs at once (NCCL's channels, one per
NIC, each ring crossing each node once), so each device sustains min(intra-node bandwidth, k x
its NIC's) (`Group.ring_link`); both wait the inter-node latency per hop.
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import pathlib
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from sharding._mesh import AXES, MeshSpec, MeshSpecError, mesh_text
from sharding.targets._devices import GIB, DeviceSpec, TargetError, load_profile
from sharding.targets._profiles import ALIASES, PROFILES

_SIZE = re.compile(r"^(?:(\d+)x)?(\d+)$")
FORMS = "NAME, NAME:COUNT, NAME:NODESxPER (e.g. 'h100:2x8') or a path to a .toml profile"


class UnknownTargetError(TargetError):
    """A target name that is neither a shipped profile nor a .toml file."""


class MalformedTargetError(TargetError):
    """A target that is not NAME, NAME:COUNT, NAME:NODESxPER or a .toml path."""


class TargetSizeError(TargetError):
    """A device count that is zero or does not fit the nodes as written."""


@functools.lru_cache(maxsize=4096)
def _nodes_spanned(shape: tuple[int, ...], inner: tuple[int, ...], per_node: int) -> int:
    """The most nodes one group over the mesh dimensions ``inner`` spans, devices numbered in
    row-major order over ``shape`` and ``per_node`` to a node."""
    outer = [i for i in range(len(shape)) if i not in inner]
    size = math.prod(shape[i] for i in inner)
    ids = np.arange(math.prod(shape)).reshape(shape)
    rows = np.sort(ids.transpose(outer + list(inner)).reshape(-1, size) // per_node, axis=1)
    return int((np.diff(rows, axis=1) != 0).sum(axis=1).max(initial=0)) + 1


class TopologyError(TargetError):
    """A mesh that cannot be laid on the target: another device count, or unknown axes."""


@dataclass(frozen=True)
class Link:
    """A link a collective runs over: bandwidth per direction per device, latency per hop."""

    name: str
    bandwidth: float  # bytes/s
    latency: float  # s


@dataclass(frozen=True)
class Group:
    """The devices one collective over ``axes`` runs among, and the link it is priced at.

    ``nodes`` is the most nodes one group spans (1: ``inside_node``); ``per_node`` its devices on
    each node. ``link`` is what each device's own traffic crosses (a permute's or all-to-all's
    bytes leave by the device's own NIC), ``ring_link`` what a ring collective sustains per
    device: its channels leave a node by the group's ``per_node`` NICs at once (rails).
    """

    axes: tuple[str, ...]
    size: int
    nodes: int
    link: Link
    ring_link: Link

    @property
    def inside_node(self) -> bool:
        return self.nodes == 1

    @property
    def per_node(self) -> int:
        return max(1, self.size // self.nodes)


@dataclass(frozen=True)
class Target:
    """``nodes`` nodes of ``per_node`` devices of one `DeviceSpec`; build it with `target`.

    Example:
        >>> t = target("h100:2x8")
        >>> t.devices, t.nodes, t.per_node
        (16, 2, 8)
    """

    name: str
    device: DeviceSpec
    nodes: int
    per_node: int

    def __post_init__(self) -> None:
        most = self.device.devices_per_node
        if not (_count(self.nodes) and _count(self.per_node)) or self.per_node > most:
            raise TargetSizeError(
                f"target {self.name!r}: {self.nodes!r} node(s) of {self.per_node!r} devices; "
                f"both must be positive integers and a {self.device.name} node holds at most "
                f"{most} devices"
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def intra_link(self) -> Link:
        d = self.device
        return Link(d.intra_link, d.intra_bw, d.intra_latency)

    @property
    def inter_link(self) -> Link:
        d = self.device
        return Link(d.inter_link, d.inter_bw, d.inter_latency)

    def topology(self, mesh: MeshSpec | str | dict[str, int]) -> Topology:
        """The mesh laid on this target's nodes (see `Topology`)."""
        return Topology(self, mesh)

    def describe(self) -> str:
        """One line: the devices, their peaks and memory, the links."""
        d = self.device
        nodes = f"{self.nodes} nodes of {self.per_node}" if self.nodes > 1 else "one node"
        return (
            f"{self.name}: {self.devices} x {d.name} on {nodes}; {d.peak_bf16 / 1e12:g} TFLOP/s "
            f"bf16 and {d.hbm_bytes / GIB:g} GiB HBM at {d.hbm_bw / 1e9:g} GB/s per device; "
            f"{d.intra_link} {d.intra_bw / 1e9:g} GB/s within a node, {d.inter_link} "
            f"{d.inter_bw / 1e9:g} GB/s between nodes (per direction per device)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices": self.devices,
            "nodes": self.nodes,
            "per_node": self.per_node,
            "device": self.device.to_dict(),
        }


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def target(text: str | Target) -> Target:
    """Parse a target: ``"h100:2x8"``, ``"h100"``, ``"h100:8"`` or ``"my.toml"`` (``":2x8"``).

    Raises:
        MalformedTargetError: not one of the forms above.
        UnknownTargetError: NAME is no shipped profile (the message lists them).
        TargetSizeError: a zero count, or more devices per node than the device's node holds.
        TargetProfileError: a .toml profile that cannot be read.

    Example:
        >>> target("h100:2x8").describe()  # doctest: +ELLIPSIS
        'h100:2x8: 16 x h100 on 2 nodes of 8; 989.4 TFLOP/s bf16 and 80 GiB HBM at 3350 GB/s ...'
    """
    if isinstance(text, Target):
        return text
    if isinstance(text, os.PathLike):
        text = os.fspath(text)
    if not isinstance(text, str) or not text.strip():
        raise MalformedTargetError(f"target {text!r}: write {FORMS}")
    text = text.strip()
    base, size = text, None
    if not text.lower().endswith(".toml") and ":" in text:
        base, _, size = text.rpartition(":")
        if not _SIZE.match(size):
            raise MalformedTargetError(
                f"target {text!r}: cannot read the size {size!r}; write {FORMS}"
            )
    device = _device(base)
    nodes, per = _sizes(text, base, size, device)
    label = f"{base if base.lower().endswith('.toml') else device.name}:{nodes}x{per}"
    return Target(label, device, nodes, per)


def _device(base: str) -> DeviceSpec:
    if base.lower().endswith(".toml"):
        return load_profile(pathlib.Path(base))
    key = ALIASES.get(base.lower(), base.lower())
    if key in PROFILES:
        return PROFILES[key]
    names = [*PROFILES, *ALIASES]
    close = difflib.get_close_matches(base.lower(), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownTargetError(
        f"unknown target {base!r}{hint}; known devices: {', '.join(PROFILES)} (also "
        f"{', '.join(ALIASES)}), or a path to a .toml device profile (keys in sharding.targets)"
    )


def _sizes(text: str, base: str, size: str | None, device: DeviceSpec) -> tuple[int, int]:
    """(nodes, devices per node) of a target's size text."""
    most = device.devices_per_node
    if size is None:
        return 1, device.default_devices
    m = _SIZE.match(size)
    nodes, per = int(m.group(1) or 1), int(m.group(2))
    if nodes == 0 or per == 0:
        raise TargetSizeError(f"target {text!r}: counts must be at least 1, e.g. '{base}:1x8'")
    if m.group(1) is None and per > most:
        fix = f"'{base}:{per // most}x{most}'" if per % most == 0 else f"'{base}:NODESx{most}'"
        raise TargetSizeError(
            f"target {text!r}: {per} devices do not fit one {device.name} node ({most} per "
            f"node); write the nodes out, e.g. {fix}"
        )
    if per > most:
        raise TargetSizeError(
            f"target {text!r}: a {device.name} node holds at most {most} devices, not {per}; "
            f"write e.g. '{base}:{math.ceil(nodes * per / most)}x{most}'"
        )
    return nodes, per


class Topology:
    """A mesh laid on a target's nodes: collective groups, their links, cross-node warnings.

    Example:
        >>> topo = target("h100:2x8").topology("data=2,tensor=8")
        >>> topo.group(("tensor",)).inside_node, topo.group(("data",)).link.name
        (True, 'InfiniBand')
    """

    def __init__(self, tgt: Target, mesh: MeshSpec | str | dict[str, int]):
        self.target = tgt
        try:
            spec = MeshSpec.of(mesh).resolve(tgt.devices)
        except MeshSpecError as err:
            raise TopologyError(
                f"mesh {mesh!r} on target {tgt.name} ({tgt.devices} devices): {err}"
            ) from None
        self.sizes: dict[str, int] = spec.sizes
        self._groups: dict[tuple[str, ...], Group] = {}

    def group(self, axes: tuple[str, ...] | list[str] | str) -> Group:
        """The group a collective over ``axes`` runs in (axes of size 1 change nothing)."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise TopologyError(
                f"collective axes {axes}: unknown axis {unknown[0]!r}; the axes are "
                f"{', '.join(AXES)}"
            )
        if axes not in self._groups:
            inner = tuple(AXES.index(a) for a in AXES if a in axes)
            size = math.prod(self.sizes[AXES[i]] for i in inner)
            nodes = _nodes_spanned(tuple(self.sizes.values()), inner, self.target.per_node)
            t = self.target
            link = ring = t.intra_link if nodes == 1 else t.inter_link
            if nodes > 1:  # rings over k rails: k NICs per node, never above the intra link
                rails = link.bandwidth * max(1, size // nodes)  # Group.per_node
                ring = Link(link.name, min(t.intra_link.bandwidth, rails), link.latency)
            self._groups[axes] = Group(axes, size, nodes, link, ring)
        return self._groups[axes]

    @cached_property
    def warnings(self) -> list[str]:
        """Tensor or fsdp groups that cross nodes: the guides' cross-switch warning."""
        t, out = self.target, []
        intra = t.intra_link

        def links(g: Group) -> str:
            rails = f" over {g.per_node} rails" if g.per_node > 1 else ""
            return (f"{g.ring_link.name}{rails} at {g.ring_link.bandwidth / 1e9:g} GB/s instead "
                    f"of {intra.name} at {intra.bandwidth / 1e9:g} GB/s per direction, "
                    f"{g.ring_link.latency / intra.latency:.3g}x the latency per hop")  # fmt: skip

        tensor, fsdp = self.group("tensor"), self.group("fsdp")
        if tensor.size > 1 and not tensor.inside_node:
            out.append(
                f"tensor={tensor.size} spans {tensor.nodes} nodes: tensor-parallel collectives "
                f"run inside every layer, forward and backward, and would cross {links(tensor)}; "
                f"keep tensor within a node (at most {t.per_node}) and put data, fsdp or stage "
                f"across nodes"
            )
        if fsdp.size > 1 and not fsdp.inside_node:
            out.append(
                f"fsdp={fsdp.size} spans {fsdp.nodes} nodes: every layer's weights are gathered "
                f"and its gradients reduce-scattered through {links(fsdp)}; consider fsdp "
                f"within a node and data across nodes (hybrid sharding)"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        groups = {a: self.group(a) for a in AXES if self.sizes[a] > 1}
        return {
            "target": self.target.name,
            "mesh": mesh_text(self.sizes),
            "groups": {
                a: {"size": g.size, "nodes": g.nodes, "link": g.link.name}
                for a, g in groups.items()
            },
            "warnings": self.warnings,
        }


__all__ = [
    "FORMS",
    "Group",
    "Link",
    "MalformedTargetError",
    "Target",
    "TargetSizeError",
    "Topology",
    "TopologyError",
    "UnknownTargetError",
    "target",
]

"""Every family under every preset on 8 devices: placement goldens, born-sharded init, and a
sharded forward equal to the single-device one."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import jax
import numpy as np
import pytest
from closeness import assert_close
from flax import nnx
from jax import sharding as jshard

import models
from partition_rules import STRATEGIES, preset
from partition_rules.strategies import EXAMPLE_MESHES_8
from sharding import MeshSpec, abstract_params, explain, init_sharded, make_mesh

GOLDEN = Path(__file__).parent / "golden" / "explain_tiny.json"
CASES = [(fam, strat) for fam in models.FAMILIES for strat in STRATEGIES]
BATCH = 8


def tiny_model(family: str):
    fam = models.get_family(family)
    cfg = fam.config("tiny")
    return fam, cfg, lambda: fam.Model(cfg, rngs=nnx.Rngs(0))


def explain_tiny(family: str, strategy: str) -> dict:
    _, _, make = tiny_model(family)
    _, params = abstract_params(make)
    spec = MeshSpec.parse(EXAMPLE_MESHES_8[strategy])
    return explain(
        *preset(family, strategy), params, spec, title=f"{family} tiny / {strategy}"
    ).to_dict()


def test_explain_tables_match_golden():
    """The placement of every parameter under every preset, exactly as snapshotted.

    Regenerate after an intended change with SPMDKIT_UPDATE_GOLDEN=1 and review the diff.
    """
    tables = {f"{fam}/{strat}": explain_tiny(fam, strat) for fam, strat in CASES}
    if os.environ.get("SPMDKIT_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(tables)
    for key, table in tables.items():
        assert json.loads(json.dumps(table)) == golden[key], key


@cache
def reference(family: str):
    """Unsharded params (jitted init, one device) and logits on a fixed batch."""
    fam, cfg, make = tiny_model(family)
    params = jax.jit(lambda: nnx.state(make(), nnx.Param))()
    batch = fam.make_batch(cfg, BATCH, 16 if fam.INPUT == "inputs" else None, key=jax.random.key(1))
    gdef, _ = abstract_params(make)
    logits = jax.jit(lambda p, x: nnx.merge(gdef, p)(x))(params, batch[fam.INPUT])
    return params, batch, np.asarray(logits)


@pytest.mark.parametrize(("family", "strategy"), CASES)
def test_sharded_init_and_forward_equal_single_device(family: str, strategy: str):
    fam, _, make = tiny_model(family)
    ref_params, batch, ref_logits = reference(family)
    mesh = make_mesh(EXAMPLE_MESHES_8[strategy])
    graphdef, params, shardings = init_sharded(make, *preset(family, strategy), mesh)

    # Born sharded, with exactly the single-device values.
    for (path, got), want, sharding in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(ref_params),
        jax.tree.leaves(shardings),
        strict=True,
    ):
        assert got.sharding == sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))

    batch_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec(("data", "fsdp")))
    x = jax.device_put(batch[fam.INPUT], batch_sharding)
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
    assert_close(np.asarray(logits), ref_logits)

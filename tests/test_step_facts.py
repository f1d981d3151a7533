"""Facts of the compiled step, read from the executable: what each strategy communicates and keeps.

Numbers are derived from the model's shapes here, never copied from a run.
"""

from __future__ import annotations

from functools import cache

import optax
import pytest

from models import llama
from partition_rules import preset
from sharding import compile_train_step, make_mesh, state_bytes
from sharding.inspection import inspect_compiled

CFG = llama.config("tiny")
BATCH, SEQ = 8, 32
F32 = 4


@cache
def program(strategy: str, mesh: str, optimizer: str = "sgd"):
    tx = optax.sgd(1e-3) if optimizer == "sgd" else optax.adamw(1e-3)
    return compile_train_step(
        lambda rngs: llama.Model(CFG, rngs=rngs),
        llama.loss,
        tx,
        *preset("llama", strategy),
        make_mesh(mesh),
        llama.batch_shapes(CFG, BATCH, SEQ),
    )


def param_bytes() -> int:
    return llama.param_count(CFG) * F32


def layer_matrix_bytes() -> int:
    """Bytes of one layer's weight matrices (what FSDP gathers per layer), norms aside."""
    d, f, dh = CFG.d_model, CFG.d_ff, CFG.head_dim
    attn = d * dh * (2 * CFG.n_heads + 2 * CFG.n_kv_heads)
    return (attn + 3 * d * f) * F32


def test_data_parallel_all_reduces_every_gradient_byte_once():
    report = program("dp", "data=8").report()
    # Every gradient byte once, plus the 4-byte loss, over `data` only; never a weight gather.
    assert report.collective_bytes("all-reduce", "data") == param_bytes() + F32
    assert report.collective_bytes("all-reduce") == param_bytes() + F32
    assert report.count("all-gather") == 0
    assert report.count("collective-permute") == 0


def test_fsdp_shards_params_and_adam_state_evenly():
    prog = program("fsdp", "fsdp=8", "adamw")
    params = state_bytes(prog.abstract_state["params"], prog.param_shardings)
    assert params == pytest.approx(param_bytes() / 8, rel=0.01)
    state = state_bytes(prog.abstract_state, prog.state_shardings)
    scalars = 2 * 4  # the step counter and Adam's count stay whole on every device
    assert state - scalars == pytest.approx(3 * param_bytes() / 8, rel=0.01)


def test_fsdp_gathers_each_layer_weight_once_forward_and_once_backward():
    report = program("fsdp", "fsdp=8").report()
    in_layers = [
        op
        for op in report.collectives
        if op.kind == "all-gather" and op.multiplicity == CFG.n_layers and op.axes == ("fsdp",)
    ]
    gathered = sum(op.bytes * op.multiplicity for op in in_layers)
    norms = 2 * CFG.d_model * F32  # attn_norm and mlp_norm scales, also sharded under ZeRO-3
    per_pass = CFG.n_layers * (layer_matrix_bytes() + norms)
    assert gathered in (2 * per_pass, 2 * per_pass - CFG.n_layers * norms)
    # Gradients of the stacked layers are reduced once, inside the backward scan, layer by layer.
    reduced = sum(
        op.bytes * op.multiplicity
        for op in report.collectives
        if op.kind == "all-reduce" and op.multiplicity == CFG.n_layers
    )
    assert reduced == CFG.n_layers * (layer_matrix_bytes() + norms)


def test_forward_of_fsdp_gathers_each_layer_once():
    compiled = program("fsdp", "fsdp=8").lower_eval().compile()
    report = inspect_compiled(compiled, mesh=make_mesh("fsdp=8"))
    layer_gathers = [op for op in report.collectives if op.multiplicity == CFG.n_layers]
    assert all(op.kind == "all-gather" and op.axes == ("fsdp",) for op in layer_gathers)
    norms = 2 * CFG.d_model * F32
    assert sum(op.bytes for op in layer_gathers) in (
        layer_matrix_bytes() + norms,
        layer_matrix_bytes(),
    )


def test_tensor_parallel_forward_all_reduces_two_activations_per_layer():
    mesh = make_mesh("data=2,tensor=4")
    compiled = program("tp", "data=2,tensor=4").lower_eval().compile()
    report = inspect_compiled(compiled, mesh=mesh)
    activation = (BATCH // 2) * SEQ * CFG.d_model * F32  # [B/data, S, D] per device
    per_layer = [op for op in report.collectives if op.multiplicity == CFG.n_layers]
    assert [(op.kind, op.axes, op.bytes) for op in per_layer] == [
        ("all-reduce", ("tensor",), activation),  # attention output (row-parallel o)
        ("all-reduce", ("tensor",), activation),  # MLP output (row-parallel down)
    ]
    assert report.count("all-gather") == 0  # no weight is ever gathered whole


def test_tensor_parallel_step_never_gathers_a_weight():
    report = program("tp", "data=2,tensor=4").report()
    assert report.count("all-gather") == 0
    # Gradients of tensor-split weights are reduced over data only: each device keeps its slice.
    grads_over_data = report.collective_bytes("all-reduce", "data")
    tensor = 4
    sharded = CFG.n_layers * layer_matrix_bytes() + 2 * CFG.vocab_size * CFG.d_model * F32
    replicated = param_bytes() - sharded
    assert grads_over_data == sharded // tensor + replicated + F32

"""Compiled-program reports: collective kinds, counts, bytes and axes; memory; FLOPs; JSON; rich.

Every expected number is derived from the shapes in the test; per-device shapes are the global
shape divided along the sharded dimensions.
"""

import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_versions import NEWER_PARTITIONER
from rich.console import Console

from sharding import make_mesh
from sharding.inspection import (
    CollectiveSummary,
    MemoryStats,
    ProgramReport,
    compile_and_inspect,
    inspect_compiled,
    parse_collectives,
    widened_bytes,
)

F32 = 4


def spec(mesh, shape, *axes):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*axes)))


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


@pytest.fixture(scope="module")
def dp_grad():
    """Data-parallel gradient of a replicated [1024, 1024] weight on data=8."""
    mesh = make_mesh("data=8")
    w, x = spec(mesh, (1024, 1024)), spec(mesh, (64, 1024), "data")
    grad = jax.jit(jax.grad(lambda w, x: jnp.mean((x @ w) ** 2)))
    return compile_and_inspect(grad, w, x)[1]


def test_data_parallel_gradient_is_one_all_reduce_of_every_weight_byte(dp_grad):
    weight_bytes = 1024 * 1024 * F32
    (op,) = dp_grad.collectives
    assert (op.kind, op.axes, op.group_size, op.multiplicity) == ("all-reduce", ("data",), 8, 1)
    assert op.operand_bytes == op.output_bytes == weight_bytes
    assert dp_grad.summary() == {"all-reduce": CollectiveSummary(1, 1, *[weight_bytes] * 3)}
    assert dp_grad.collective_bytes("all-reduce", axes="data") == weight_bytes
    assert dp_grad.count("all-gather") == 0
    assert dp_grad.collective_bytes() == weight_bytes
    assert dp_grad.mesh == {
        "stage": 1,
        "data": 8,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }


def test_megatron_mlp_forward_all_reduces_the_activation_once_over_tensor():
    mesh = make_mesh("data=2,tensor=4")
    batch, d_model, d_ff = 64, 1024, 4096
    x = spec(mesh, (batch, d_model), "data")
    w1, w2 = spec(mesh, (d_model, d_ff), None, "tensor"), spec(mesh, (d_ff, d_model), "tensor")
    _, report = compile_and_inspect(jax.jit(lambda x, a, b: jax.nn.relu(x @ a) @ b), x, w1, w2)
    (op,) = report.collectives
    assert (op.kind, op.axes, op.group_size) == ("all-reduce", ("tensor",), 4)
    assert op.operand_bytes == batch // 2 * d_model * F32  # the partial [B/data, D] output
    assert op.groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # partition p = 4 * data + tensor


def test_ppermute_in_scan_counts_once_per_iteration():
    mesh, length = make_mesh("data=8"), 11
    x = spec(mesh, (64, 1024), "data")
    block_bytes = 64 // 8 * 1024 * F32

    def body(carry, _):
        return lax.ppermute(carry, "data", ring(8)) * 2, None

    shifted = jax.shard_map(
        lambda a: lax.scan(body, a, None, length=length)[0],
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    _, report = compile_and_inspect(jax.jit(shifted), x)
    summary = report.summary()["collective-permute"]
    assert (summary.static_count, summary.count) == (1, length)
    assert summary.bytes == summary.operand_bytes == length * block_bytes
    (op,) = report.collectives
    assert (op.axes, op.multiplicity, op.group_size, op.exact) == (("data",), length, None, True)
    assert sorted(op.groups) == ring(8)


def test_nested_scans_multiply_trip_counts():
    mesh, outer, inner = make_mesh("data=8"), 3, 4
    x = spec(mesh, (64, 1024), "data")

    def inner_body(c, _):
        return c + lax.psum(c, "data"), None

    def outer_body(c, _):
        return lax.scan(inner_body, c, None, length=inner)[0], None

    f = jax.shard_map(
        lambda a: lax.scan(outer_body, a, None, length=outer)[0],
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    _, report = compile_and_inspect(jax.jit(f), x)
    assert report.count("all-reduce") == report.count("all-reduce", ("data",)) == outer * inner
    assert report.summary()["all-reduce"].static_count == 1
    assert report.collective_bytes() == outer * inner * 64 // 8 * 1024 * F32


def test_resharding_fsdp_to_replicated_all_gathers_the_full_array():
    mesh = make_mesh("fsdp=8")
    x = spec(mesh, (64, 1024), "fsdp")
    gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
    _, report = compile_and_inspect(gather, x)
    (op,) = report.collectives
    assert (op.kind, op.axes, op.group_size) == ("all-gather", ("fsdp",), 8)
    assert op.operand_bytes == 64 // 8 * 1024 * F32
    assert op.bytes == op.output_bytes == report.collective_bytes("all-gather") == 64 * 1024 * F32


def test_conditional_branches_count_as_taken_and_are_marked_inexact():
    mesh = make_mesh("data=8")
    x = spec(mesh, (64, 1024), "data")
    f = jax.shard_map(
        lambda a: lax.cond(a.sum() > 0, lambda b: lax.psum(b, "data"), lambda b: b * 2, a),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        check_vma=False,
    )
    _, report = compile_and_inspect(jax.jit(f), x)
    (op,) = report.collectives
    assert (op.kind, op.multiplicity, op.exact) == ("all-reduce", 1, False)


def test_iota_replica_groups():
    # iota over [2,2,2] transposed (1,0,2): element [j,i,k] is device 4i + 2j + k.
    line = "%ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=[4,2]<=[2,2,2]T(1,0,2)"
    (op,) = parse_collectives(line)
    expected = tuple(tuple(4 * i + 2 * j + k for k in range(2)) for j in range(2) for i in range(2))
    assert op.groups == expected == ((0, 1), (4, 5), (2, 3), (6, 7))
    assert (op.group_size, op.operand_bytes, op.axes) == (2, 8 * F32, None)
    gather = "%g = f32[16]{0} all-gather(f32[8]{0} %p), replica_groups=[2,4]<=[8], dimensions={0}"
    (untransposed,) = parse_collectives(gather)
    assert untransposed.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (untransposed.operand_bytes, untransposed.bytes) == (8 * F32, 16 * F32)


def test_mesh_replica_groups_and_axes():
    mesh = make_mesh("data=2,tensor=4")  # partition p = 4 * data + tensor
    line = "%ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=mesh['a'=2,'b'=4] {AXES}"
    (over_a,) = parse_collectives(line.replace("AXES", "'a'"), mesh)
    assert over_a.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert over_a.axes == ("data",)
    (over_b,) = parse_collectives(line.replace("AXES", "'b'"), mesh)
    assert over_b.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert over_b.axes == ("tensor",)
    # Sub-axis b:(1)2 is the major half of b: pairs {t, t + 2}. No mesh axis set is that.
    (sub,) = parse_collectives(line.replace("AXES", "'b':(1)2"), mesh)
    assert sub.groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert sub.axes is None


def test_memory_and_flops_of_a_sharded_matmul():
    mesh = make_mesh("data=8")
    m, k, n = 64, 1024, 512
    x, w = spec(mesh, (m, k), "data"), spec(mesh, (k, n))
    compiled, report = compile_and_inspect(jax.jit(lambda x, w: x @ w), x, w)
    assert report.collectives == []
    assert report.flops == 2 * (m // 8) * n * k
    mem = report.memory
    assert all(type(v) is int for v in (mem.argument, mem.output, mem.temp, mem.alias, mem.peak))
    assert mem.argument == (m // 8 * k + k * n) * F32
    assert mem.output == m // 8 * n * F32
    assert mem.peak >= mem.argument + mem.output - mem.alias
    assert report.compile_time_s > 0
    # Without a mesh nothing names the axes; inspect_compiled reads it from the shardings.
    assert inspect_compiled(compiled).mesh == report.mesh


def test_report_to_dict_and_rich(dp_grad):
    dp_grad = dataclasses.replace(dp_grad, extra={"bubble": 0.25})
    data = json.loads(json.dumps(dp_grad.to_dict()))
    assert data["collectives"]["all-reduce"]["bytes"] == 1024 * 1024 * F32
    assert data["collectives_by_axes"] == [
        {"kind": "all-reduce", "axes": ["data"], **data["collectives"]["all-reduce"]}
    ]
    assert data["ops"][0]["axes"] == ["data"] and data["extra"] == {"bubble": 0.25}
    assert set(data["memory"]) == {
        "argument",
        "output",
        "temp",
        "alias",
        "generated_code",
        "peak",
        "widened",
        "platform",
    }
    assert data["memory"]["platform"] == "cpu"
    console = Console(file=io.StringIO(), width=160)
    console.print(dp_grad)
    text = console.file.getvalue()
    assert "all-reduce" in text and "4.00 MiB" in text and "bubble: 0.25" in text


def test_unknown_kind_is_rejected(dp_grad):
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'; the kinds are"):
        dp_grad.count("allreduce")


def test_async_starts_count_results_net_of_operands_and_contexts():
    text = """HloModule m, num_partitions=8
ENTRY %main (a: f32[8,128], b: f32[4]) -> f32[64,128] {
  %a = f32[8,128]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %ags = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%a), replica_groups={}, dimensions={0}
  %agd = f32[64,128]{1,0} all-gather-done(%ags)
  %cps = (f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}
  %ags.1 = ((f32[8,128]{1,0}, f32[4]{0}), (f32[64,128]{1,0}, f32[32]{0})) all-gather-start(%a, %b), replica_groups=[1,8]<=[8], dimensions={0}
  %rss = ((f32[8,128]{1,0}), f32[1,128]{1,0}, u32[]) reduce-scatter-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %ars = (f32[8,128]{1,0}, f32[4]{0}) all-reduce-start(%a, %b), replica_groups={}, to_apply=%add
}"""
    block, small = 8 * 128 * F32, 4 * F32
    ops = parse_collectives(text, make_mesh("data=8"))
    assert [op.kind for op in ops] == [
        "all-gather",
        "collective-permute",
        "all-gather",
        "reduce-scatter",
        "all-reduce",
    ]
    gather, permute, gather2, scatter, reduce = ops
    assert (gather.operand_bytes, gather.output_bytes) == (block, 8 * block)
    assert (gather.group_size, gather.axes) == (8, ("data",))  # `{}`: every partition
    assert permute.operand_bytes == permute.output_bytes == block  # u32[] contexts dropped
    assert (gather2.operand_bytes, gather2.output_bytes) == (block + small, 8 * (block + small))
    assert (scatter.operand_bytes, scatter.output_bytes, scatter.bytes) == (
        block,
        block // 8,
        block,
    )
    assert reduce.operand_bytes == reduce.output_bytes == block + small


def test_loops_in_hand_written_hlo():
    # Nested known trip counts multiply; a loop without one counts once and is marked inexact;
    # comments and metadata (which may say "calls=") are not read as structure.
    text = """HloModule loops, num_partitions=4

%inner (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}

%cond (c: f32[8]) -> pred[] {
  %c = f32[8]{0} parameter(0)
  ROOT %true = pred[] constant(true)
}

%outer (p.1: f32[8]) -> f32[8] {
  %p.1 = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%p.1), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"5"}}
}

%unknown (p.2: f32[8]) -> f32[8] {
  %p.2 = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%p.2), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (x: f32[8]) -> (f32[8], f32[8], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %w.1 = f32[8]{0} while(%x), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
  %w.2 = f32[8]{0} while(%x), condition=%cond, body=%unknown
  ROOT %t = (f32[8]{0}, f32[8]{0}, /*index=2*/f32[8]{0}) tuple(%w.1, %w.2, /*index=2*/%x), metadata={op_name="calls=%inner"}
}"""
    reduce, permute = parse_collectives(text)
    assert (reduce.computation, reduce.multiplicity, reduce.exact) == ("inner", 3 * 5, True)
    assert (reduce.group_size, reduce.operand_bytes) == (4, 8 * F32)
    assert (permute.computation, permute.multiplicity, permute.exact) == ("unknown", 1, False)
    report = ProgramReport(collectives=[reduce, permute])
    assert report.collective_bytes() == 3 * 5 * 8 * F32 + 8 * F32


def test_allocated_memory_counts_the_temporaries_that_cpu_peak_leaves_out():
    cpu = MemoryStats(argument=10, output=8, temp=100, alias=8, generated_code=0, peak=11)
    assert cpu.allocated == 110  # arguments + outputs not aliased to them + temporaries
    donated_less = MemoryStats(
        argument=10, output=8, temp=100, alias=0, generated_code=0, peak=None
    )
    assert donated_less.allocated == 118


@pytest.mark.parametrize(("dtype", "remat", "per_token"), [
    ("bfloat16", "dots", 2 * 64 + 384),  # input, o, and the column outputs q, k, v, gate, up
    ("bfloat16", "full", 64),  # the layer inputs alone
    ("float32", "dots", 0),  # nothing to widen
])  # fmt: skip
def test_float32_copies_of_bfloat16_stacks_are_found_and_left_out_of_native_memory(
    dtype, remat, per_token
):
    """XLA:CPU slices no bfloat16: a layer stack's saved activations, stacked in bfloat16 by the
    forward loop, reach the backward loop as float32 copies. `widened_bytes` counts what the
    copies add (their bfloat16 size): exactly what the remat policy keeps, per layer and token
    (llama tiny, 4 layers, 8 x 32 tokens on one device), and ``native`` leaves it out."""
    import models
    from sharding import Workload, build_program

    cfg = models.llama.config("tiny")
    prog = build_program(Workload.from_family(models.llama, cfg), "dp", "data=1", batch=8,
                         seq=32, remat=remat, compute_dtype=dtype,
                         devices=jax.devices()[:1])  # fmt: skip
    memory = prog.report().memory
    assert memory.widened == widened_bytes(prog.compiled.as_text())
    # jax 0.12's XLA:CPU slices bfloat16 itself: no copies (tests/jax_versions.py)
    per_token = 0 if NEWER_PARTITIONER else per_token
    assert memory.widened == cfg.n_layers * 8 * 32 * 2 * per_token
    assert memory.native == memory.allocated - memory.widened


def test_gpu_compiles_get_the_overlap_options_and_cpu_none():
    """XLA's latency-hiding scheduler and pipelined collectives are given to GPU compiles only,
    and an option the user set in their own flags keeps the user's value."""
    from sharding.inspection import GPU_OVERLAP_OPTIONS, overlap_options, overlap_text

    assert overlap_options("cpu") == {} and overlap_options("tpu") == {}
    given = overlap_options("gpu", "--xla_gpu_enable_pipelined_all_gather=false")
    assert given == {
        k: True for k in GPU_OVERLAP_OPTIONS if k != "xla_gpu_enable_pipelined_all_gather"
    }
    assert overlap_options("gpu", "") == GPU_OVERLAP_OPTIONS
    assert "xla_gpu_enable_latency_hiding_scheduler" in given
    assert overlap_text("cpu") == "XLA overlap options: none (cpu compiles as XLA's defaults)"
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in overlap_text("gpu")

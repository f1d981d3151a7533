"""Loop-aware matmul FLOPs of compiled programs: dots (fused ones too) and convolutions.

Every expected number is derived from the shapes in the test: a dot is 2 x its output elements
x its contracting size, a convolution 2 x its output elements x (kernel window x input
features), each times the runs of its computation per program run.
"""

import dataclasses
import io
import json
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from models import llama
from sharding import make_mesh
from sharding.inspection import (
    FlopCount,
    FlopCounter,
    ProgramReport,
    compile_and_inspect,
    count_flops,
)


def flops_of(f, *args):
    return count_flops(jax.jit(f).lower(*args).compile().as_text())


def zeros(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_a_dot_is_twice_its_output_times_its_contracting_size():
    m, k, n = 64, 128, 256
    compiled = jax.jit(jnp.dot).lower(zeros(m, k), zeros(k, n)).compile()
    count = count_flops(compiled.as_text())
    assert count == FlopCount(2 * m * k * n, {"dot": 2 * m * k * n, "convolution": 0}, True)
    assert compiled.cost_analysis()["flops"] == 2 * m * k * n  # XLA agrees without a loop


def test_a_dot_in_a_scan_counts_once_per_iteration():
    # The dot reads each step's slice of xs: a loop-invariant dot would be hoisted out of the
    # loop by XLA, and run (and count) once.
    length, m, k, n = 7, 64, 128, 256
    scan = lambda xs, w: lax.scan(lambda c, x: (c, x @ w), 0.0, xs)[1]  # noqa: E731
    count = flops_of(scan, zeros(length, m, k), zeros(k, n))
    assert count.total == count.by_op["dot"] == length * 2 * m * k * n and count.exact


def test_nested_scans_multiply_trip_counts():
    outer, inner, m, d = 3, 4, 64, 128

    def f(c, w):
        step = lambda c, _: (jnp.tanh(c @ w), None)  # noqa: E731
        loop = lambda c, _: (lax.scan(step, c, None, length=inner)[0], None)  # noqa: E731
        return lax.scan(loop, c, None, length=outer)[0]

    count = flops_of(f, zeros(m, d), zeros(d, d))
    assert count.total == outer * inner * 2 * m * d * d and count.exact


def test_an_edited_loop_or_branch_list_counts_as_the_edited_text_does():
    """FlopCounter parses once and answers for one edited calling line (a trip count one more,
    a branch listed twice) exactly what count_flops says of the edited text."""
    outer, inner, m, d = 3, 4, 16, 32

    def f(p, c, w):
        step = lambda c, _: (jnp.tanh(c @ w), None)  # noqa: E731
        loop = lambda c, _: (lax.scan(step, c, None, length=inner)[0], None)  # noqa: E731
        c = lax.cond(p, lambda: c @ w, lambda: (c @ w) @ w)
        return lax.scan(loop, c, None, length=outer)[0]

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((), jnp.bool_), zeros(m, d), zeros(d, d))
    text = text.compile().as_text()
    counter, dot = FlopCounter(text), 2 * m * d * d
    assert (
        counter.count() == count_flops(text)
        and counter.count().total == (1 + 2 + outer * inner) * dot
    )
    whiles = [x for x in text.splitlines() if " while(" in x and f'"n":"{outer}"' in x]
    conds = [x for x in text.splitlines() if " conditional(" in x]
    assert len(whiles) == 1 and len(conds) == 1
    more = whiles[0].replace(f'"n":"{outer}"', f'"n":"{outer + 1}"')
    branches = re.search(r"branch_computations=\{([^}]*)\}", conds[0])
    twice = conds[0].replace(
        branches.group(1), branches.group(1) + ", " + branches.group(1).split(",")[-1].strip()
    )
    for line, edited in ((whiles[0], more), (conds[0], twice)):
        assert counter.count(edit=(line, edited)) == count_flops(text.replace(line, edited, 1))
    assert counter.count(edit=(whiles[0], more)).total == counter.count().total + inner * dot
    assert counter.count() == count_flops(text)  # an edit leaves the counter as it was


def test_a_batched_einsum_counts_every_output_times_the_contracted_size():
    b, s, d, h, k = 2, 8, 32, 4, 16
    einsum = lambda x, w: jnp.einsum("bsd,dhk->bshk", x, w)  # noqa: E731
    assert flops_of(einsum, zeros(b, s, d), zeros(d, h, k)).total == 2 * b * s * d * h * k
    # A true batch dimension (lhs_batch_dims) multiplies through the output.
    bmm = lambda x, y: jnp.einsum("bij,bjk->bik", x, y)  # noqa: E731
    assert flops_of(bmm, zeros(b, s, d), zeros(b, d, k)).total == 2 * b * s * d * k
    # A matrix-vector product stays a dot.
    assert flops_of(jnp.dot, zeros(s, d), zeros(d)).total == 2 * s * d


def test_a_convolution_counts_its_window_and_input_features_per_output():
    n, hw, c_in, c_out, win = 2, 16, 8, 16, 3

    def conv(x, kernel, groups=1):
        dims = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(
            x, kernel, (1, 1), "SAME", dimension_numbers=dims, feature_group_count=groups
        )

    count = flops_of(conv, zeros(n, hw, hw, c_in), zeros(win, win, c_in, c_out))
    # SAME padding keeps 16x16 outputs; padded taps count (cost_analysis leaves them out).
    assert count.by_op == {"dot": 0, "convolution": 2 * n * hw * hw * c_out * win * win * c_in}
    # Grouped: each output feature reads c_in / groups input features.
    grouped = lambda x, k: conv(x, k, groups=4)  # noqa: E731
    count = flops_of(grouped, zeros(n, hw, hw, c_in), zeros(win, win, c_in // 4, c_out))
    assert count.total == 2 * n * hw * hw * c_out * win * win * (c_in // 4)


def test_a_sharded_matmul_counts_per_device_flops_in_the_report():
    mesh = make_mesh("data=8")
    m, k, n = 64, 1024, 512
    x = jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=NamedSharding(mesh, P()))
    compiled, report = compile_and_inspect(jax.jit(lambda x, w: x @ w), x, w)
    assert count_flops(compiled.as_text()).total == 2 * m * k * n // 8
    assert report.matmul_flops == 2 * m * k * n // 8 == report.flops


def test_conditional_branches_all_count_and_are_marked_inexact():
    m, k, n = 16, 32, 64

    def f(p, x, w, v):
        return lax.cond(p, lambda: x @ w, lambda: (x @ w) @ v + 1.0)

    count = flops_of(f, jax.ShapeDtypeStruct((), jnp.bool_), zeros(m, k), zeros(k, n), zeros(n, n))
    assert count.total == 2 * (2 * m * k * n) + 2 * m * n * n and not count.exact


def llama_forward(n_layers, batch, seq):
    cfg = llama.config("tiny", n_layers=n_layers)
    graphdef, state = nnx.split(llama.Model(cfg, rngs=nnx.Rngs(0)))
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    compiled = forward.lower(state, jnp.zeros((batch, seq), jnp.int32)).compile()
    kernels = [x.size for path, x in nnx.to_flat_state(state) if path[-1] == "kernel"]
    return cfg, count_flops(compiled.as_text()), sum(kernels)


def test_llama_forward_counts_every_scanned_layer():
    batch, seq = 2, 16
    tokens = batch * seq
    cfg2, two, kernel_params2 = llama_forward(2, batch, seq)
    cfg4, four, kernel_params4 = llama_forward(4, batch, seq)
    assert cfg2.n_layers == 2 and cfg4.n_layers == 4 and two.exact and four.exact
    d, f, v = cfg4.d_model, cfg4.d_ff, cfg4.vocab_size
    n, kv, h = cfg4.n_heads, cfg4.n_kv_heads, cfg4.head_dim
    # Per layer: q, o ([D, N*H]); k, v ([D, K*H]); gate, up, down ([D, F]) on every token;
    # then scores q.k and probs.v, each 2*B*S*S*N*H (kv heads repeated to N).
    layer_params = 2 * d * n * h + 2 * d * kv * h + 3 * d * f
    layer = 2 * tokens * layer_params + 2 * (2 * batch * seq * seq * n * h)
    head = 2 * tokens * d * v  # the embedding is a gather, no matmul
    # The shapes read back from the model: 2 more layers hold 2 more layers' kernels.
    assert kernel_params4 == 4 * layer_params + d * v == kernel_params2 + 2 * layer_params
    assert four.total >= 2 * kernel_params4 * tokens
    assert four.total - two.total == 2 * layer
    assert (two.total, four.total) == (head + 2 * layer, head + 4 * layer)


def test_hand_written_hlo_loops_fusions_and_gemm_custom_calls():
    # A dot fused inside a body of 5 known iterations; a loop of unknown trip count counts once,
    # inexact; a GPU cuBLAS gemm keeps its contracting dims in backend_config (a tuple result
    # with its workspace); comments and metadata are not read as structure.
    text = """HloModule flops

%fused_dot (a: f32[4,8], b: f32[8,16]) -> f32[4,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[4,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %k = f32[8,16]{1,0} constant({...})
  %f = f32[4,16]{1,0} fusion(%p, %k), kind=kOutput, calls=%fused_dot
  ROOT %s = f32[4,8]{1,0} slice(%f), slice={[0:4], [0:8]}
}

%cond (c: f32[4,8]) -> pred[] {
  %c = f32[4,8]{1,0} parameter(0)
  ROOT %true = pred[] constant(true)
}

%unknown (q: f32[4,8]) -> f32[4,8] {
  %q = f32[4,8]{1,0} parameter(0)
  %qt = f32[8,4]{1,0} transpose(%q), dimensions={1,0}
  ROOT %dq = f32[4,8]{1,0} dot(%q, %qt), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="dot calls=%fused_dot"}
}

ENTRY %main (x: f32[4,8], y: f32[32,64]) -> (f32[4,8], f32[4,8], f32[32,32]) {
  %x = f32[4,8]{1,0} parameter(0)
  %y = f32[32,64]{1,0} parameter(1)
  %w.1 = f32[4,8]{1,0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w.2 = f32[4,8]{1,0} while(%x), condition=%cond, body=%unknown
  %g = (f32[32,32]{1,0}, s8[1024]{0}) custom-call(%y, %y), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gte = f32[32,32]{1,0} get-tuple-element(%g), index=0
  ROOT %t = (f32[4,8]{1,0}, f32[4,8]{1,0}, /*index=2*/f32[32,32]{1,0}) tuple(%w.1, %w.2, %gte)
}"""
    count = count_flops(text)
    assert count.by_op["dot"] == 5 * 2 * 4 * 16 * 8 + 2 * 4 * 8 * 8 + 2 * 32 * 32 * 64
    assert not count.exact


def test_report_carries_matmul_flops_to_dict_and_rich():
    m, k, n, length = 32, 64, 128, 5
    scan = lambda xs, w: lax.scan(lambda c, x: (c, x @ w), 0.0, xs)[1]  # noqa: E731
    _, report = compile_and_inspect(jax.jit(scan), zeros(length, m, k), zeros(k, n))
    assert report.matmul_flops == length * 2 * m * k * n
    data = json.loads(json.dumps(report.to_dict()))
    assert data["matmul_flops"] == length * 2 * m * k * n
    console = Console(file=io.StringIO(), width=160)
    console.print(report)
    assert "matmul FLOPs/device (loop-aware):" in console.file.getvalue()
    # Reports built by hand leave it None, and rich leaves the line out.
    bare = ProgramReport(collectives=[])
    assert bare.matmul_flops is None and bare.to_dict()["matmul_flops"] is None
    console = Console(file=io.StringIO(), width=160)
    console.print(dataclasses.replace(bare))
    assert "matmul FLOPs" not in console.file.getvalue()

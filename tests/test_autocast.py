"""autocast: per-op dtypes in the jaxpr, numerics against float32, composition, errors."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import primitives as jex_primitives
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lite as jmp
from jmp_lite._src.autocast import fp8_rule as autocast_fp8
from jmp_lite._src.autocast import interpret as interp
from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src import jaxpr_utils

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF_TOL = {F16: 1e-2, BF16: 5e-2}
half_dtypes = pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])


def out_dtypes(fn, *args, names):
  """{primitive name: set of output dtype names} over the jaxpr of ``fn`` and its sub-jaxprs."""
  found: dict[str, set[str]] = {}
  for eqn in jaxpr_utils.walk(jax.make_jaxpr(fn)(*args).jaxpr):
    if eqn.primitive.name in names:
      found.setdefault(eqn.primitive.name, set()).update(
          str(jaxpr_utils.dtype_of(v)) for v in eqn.outvars)
  return found


def assert_close(actual, expected, rtol):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual)), actual
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def key(i):
  return jax.random.key(i)


# --- Per-op dtypes in the jaxpr ---------------------------------------------------------


@half_dtypes
def test_matmuls_and_convs_in_half_exp_log_reductions_in_float32(dtype):
  def f(w, x, img, kernel, labels):
    h = jnp.log1p(jnp.exp(x @ w))                                     # dot, exp, log1p
    conv = jax.lax.conv(img, kernel, (1, 1), "SAME")
    total = jnp.sum(h) + jnp.mean(conv) + jnp.cumsum(h, axis=1)[:, -1].sum()
    counts = jnp.bincount(labels, length=3) * 2 + jnp.argmax(h, axis=1)  # ints
    return total, counts, jax.random.normal(key(0), (2,))

  args = (jnp.ones((8, 4)), jnp.ones((3, 8)), jnp.ones((2, 3, 6, 6)), jnp.ones((5, 3, 3, 3)),
          jnp.array([0, 1, 1, 2]))
  names = {"dot_general", "conv_general_dilated", "exp", "log1p", "reduce_sum", "cumsum"}
  found = out_dtypes(jmp.autocast(f, dtype), *args, names=names)
  assert found == {"dot_general": {dtype.name}, "conv_general_dilated": {dtype.name},
                   "exp": {"float32"}, "log1p": {"float32"}, "reduce_sum": {"float32"},
                   "cumsum": {"float32"}}
  # Integer ops and their dtypes are exactly those of the plain function.
  def int_eqns(fn):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return sorted((e.primitive.name, str(jaxpr_utils.dtype_of(e.outvars[0])))
                  for e in jaxpr_utils.walk(jaxpr)
                  if all(not jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))
                         for v in [*e.invars, *e.outvars]))
  assert int_eqns(jmp.autocast(f, dtype)) == int_eqns(f)
  total, counts, normal = jmp.autocast(f, dtype)(*args)
  assert total.dtype == F32 and counts.dtype == jnp.int32 and normal.dtype == F32
  np.testing.assert_array_equal(counts, f(*args)[1])


def test_half_inputs_float32_list_ops_widen_and_matmul_inputs_narrow():
  def f(x16, w32):
    return (jnp.exp(x16), x16 @ w32.astype(jnp.float16), jnp.tanh(x16), x16 * 2.0,
            x16 + w32[0], x16 + w32[:2])

  x, w = jnp.ones((2, 3), jnp.float16), jnp.ones((3, 3), jnp.float32)
  outs = jmp.autocast(f, jnp.float16)(x, w)
  # exp widens; the matmul is f16; tanh (promote list) stays f16; a Python scalar
  # does not promote; a float32 row broadcast onto f16 (a bias) does not either;
  # f16 + float32 data of the same size is f32.
  assert [a.dtype for a in outs] == [F32, F16, F16, F16, F16, F32]


def test_float32_matmul_runs_in_half_and_deliberate_preferred_element_type_is_kept():
  x32, x16 = jnp.ones((2, 8)), jnp.ones((2, 8), jnp.float16)
  plain, wide = jmp.autocast(
      lambda a, b: (a @ a.T, jnp.einsum("ij,kj->ik", b, b, preferred_element_type=jnp.float32)),
      jnp.bfloat16)(x32, x16)
  assert plain.dtype == BF16  # jnp.matmul passes preferred_element_type=float32: follows.
  assert wide.dtype == F32    # asked for on f16 operands: kept.
  mixed = jmp.autocast(lambda a, b: jnp.einsum("ij,kj->ik", a, b), jnp.float16)(x16, x32)
  assert mixed.dtype == F16   # f16 x f32 einsum: promotion, not a request


def test_narrowing_converts_keep_statistics_wide_and_narrow_float32_data():
  def f(x16, x32):
    # Statistics: jnp reduces in f32 and narrows; autocast keeps them f32 (sums overflow).
    return (jnp.sum(x16), jnp.mean(x16), jnp.var(x16), jnp.std(x16), jnp.linalg.norm(x16),
            x16.astype(jnp.float32),            # widening: done
            x32.astype(jnp.float16),            # float32 data -> f16: done, as written
            x16.astype(jnp.bfloat16),           # f16 -> bf16: done
            (x16 > 0).astype(jnp.float16),      # bool -> f16: done
            x32.astype(jnp.int32))              # float -> int: done

  x16, x32 = jnp.arange(8, dtype=jnp.float16), jnp.arange(8, dtype=jnp.float32)
  outs = jmp.autocast(f, jnp.float16)(x16, x32)
  assert [o.dtype for o in outs] == [F32] * 6 + [F16, BF16, F16, np.dtype(jnp.int32)]
  assert [o.dtype for o in f(x16, x32)][:5] == [F16] * 5  # what the program asked for
  ones = jnp.ones(100_000, jnp.float16)
  assert float(jmp.autocast(lambda v: v.sum() * 2, jnp.float16)(ones)) == 200_000.0


def test_casts_come_before_broadcasts_so_the_backward_sums_in_float32():
  # All f16 as traced; under autocast exp(x) is f32, so the broadcast scale is needed in f32.
  f = lambda scale, x: jnp.sum(jnp.exp(x) * scale)
  scale, x = jnp.ones(4, jnp.float16), jnp.ones((64, 4), jnp.float16)
  jaxpr = jax.make_jaxpr(jax.grad(jmp.autocast(f, jnp.float16)))(scale, x).jaxpr
  converts = [(e.invars[0].aval.shape, str(e.params["new_dtype"]))
              for e in jaxpr_utils.walk(jaxpr) if e.primitive.name == "convert_element_type"]
  # x up for exp; the scale up at its own size (not broadcast first), its gradient down;
  # each once in the forward pass and once where the backward pass recomputes the region.
  assert set(converts) == {((64, 4), "float32"), ((4,), "float32"), ((4,), "float16")}
  sums = [str(jaxpr_utils.dtype_of(e.outvars[0])) for e in jaxpr_utils.walk(jaxpr)
          if e.primitive.name == "reduce_sum"]
  assert sums and set(sums) == {"float32"}


def test_mul_of_a_value_by_itself_is_a_square():
  x = jnp.full((4,), 300.0, jnp.float16)
  found = out_dtypes(jmp.autocast(lambda v: v * v + v * 2, jnp.float16), x, names={"mul"})
  assert found == {"mul": {"float32", "float16"}}
  assert float(jmp.autocast(lambda v: (v * v)[0], jnp.float16)(x)) == 90000.0


# --- Overflow cases: plain float16 fails, autocast matches float32 ------------------------


def naive_softmax(logits):
  return jnp.exp(logits) / jnp.sum(jnp.exp(logits), axis=-1, keepdims=True)


def naive_attention(q, k, v):
  return naive_softmax(q @ k.T) @ v


OVERFLOWS = {
    "exp(11.5)": (jnp.exp, (jnp.full((3,), 11.5),), 1e-6),
    "sum of 100000 ones": (jnp.sum, (jnp.ones(100_000),), 0.0),
    "300**2": (lambda x: x ** 2, (jnp.full((3,), 300.0),), 0.0),
    "naive softmax, 30 logits": (naive_softmax, (jnp.linspace(-5.0, 25.0, 30)[None],), 1e-6),
    "attention, scores above 11": (
        naive_attention,
        (jnp.linspace(-2.0, 2.0, 32).reshape(4, 8), jnp.linspace(-2.0, 3.0, 48).reshape(6, 8),
         jnp.linspace(-1.0, 1.0, 48).reshape(6, 8)),
        HALF_TOL[F16]),
}


@pytest.mark.parametrize("case", list(OVERFLOWS))
def test_overflow_cases_fail_in_float16_and_match_float32_under_autocast(case, maybe_jit):
  fn, args, rtol = OVERFLOWS[case]
  half = [a.astype(jnp.float16) for a in args]
  expected = fn(*[h.astype(jnp.float32) for h in half])
  assert not np.all(np.isfinite(np.asarray(fn(*half), np.float32)))
  out = maybe_jit(jmp.autocast(fn, jnp.float16))(*half)
  assert out.dtype in (F32, F16)
  assert_close(out, expected, rtol)


def test_bfloat16_sum_is_exact_under_autocast(maybe_jit):
  ones = jnp.ones(100_000, jnp.bfloat16)
  assert float(jnp.sum(ones)) != 100_000.0  # rounded to bf16's 8 bits
  assert float(maybe_jit(jmp.autocast(jnp.sum, jnp.bfloat16))(ones)) == 100_000.0


def _segment_mean(v, ids):  # jraph's: a sum over a count, both scatter-adds.
  count = jax.ops.segment_sum(jnp.ones_like(v), ids, num_segments=3)
  return jax.ops.segment_sum(v, ids, num_segments=3) / jnp.maximum(count, 1.0)


# Sums by scatter (graph networks' aggregations): the scatter-add of 100000 values.
SCATTER_SUMS = {
    "segment_sum": lambda v, ids: jax.ops.segment_sum(v, ids, num_segments=3),
    "sorted_segment_sum": lambda v, ids: jax.ops.segment_sum(v, ids, 3, indices_are_sorted=True),
    "segment_mean": _segment_mean,
    "at_add": lambda v, ids: jnp.zeros(3, v.dtype).at[ids].add(v),
}


@half_dtypes
@pytest.mark.parametrize("case", list(SCATTER_SUMS))
def test_sums_by_scatter_accumulate_in_float32_as_reductions_do(case, dtype, maybe_jit):
  # A float16 segment_sum of 100000 values of 8.0 was 16384 (bfloat16: 2048) under
  # autocast too, where jnp.sum accumulates in float32; a sum stops growing at 2048
  # (bfloat16: 256) times its terms.
  fn = SCATTER_SUMS[case]
  ids = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, 100_000)), jnp.int32)
  v = jnp.asarray(np.random.default_rng(1).uniform(0.0, 16.0, 100_000), dtype)
  expected = np.asarray(fn(v.astype(F32), ids))
  assert not np.allclose(np.asarray(fn(v, ids), F32), expected, rtol=0.1)  # Half alone is off.
  out = maybe_jit(jmp.autocast(fn, dtype))(v, ids)
  assert out.dtype == F32
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)
  grad = jax.grad(lambda v: jmp.autocast(fn, dtype)(v, ids).sum())(v)
  assert grad.dtype == dtype
  assert_close(grad, jax.grad(lambda v: fn(v, ids).sum())(v.astype(F32)), HALF_TOL[dtype])
  found = out_dtypes(jmp.autocast(fn, dtype), v, ids, names={"scatter-add"})
  assert found == {"scatter-add": {"float32"}}


@half_dtypes
def test_mlp_with_layernorm_and_softmax_matches_float32(dtype, maybe_jit):
  def f(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
    return jax.nn.log_softmax(h @ params["w2"])

  k1, k2, k3 = jax.random.split(key(0), 3)
  params = {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 10)) / 6}
  x = jax.random.normal(k3, (8, 16))
  out = maybe_jit(jmp.autocast(f, dtype))(params, x)
  assert out.dtype == dtype  # log_softmax returns its input's dtype; its logsumexp is f32
  assert_close(out, jax.jit(f)(params, x), HALF_TOL[dtype])
  loss = maybe_jit(jmp.autocast(lambda p, v: -jnp.mean(f(p, v)[:, 0]), dtype))(params, x)
  assert loss.dtype == F32
  assert_close(loss, -jnp.mean(jax.jit(f)(params, x)[:, 0]), HALF_TOL[dtype])


# --- Custom derivative rules --------------------------------------------------------------


@half_dtypes
def test_custom_jvp_rules_are_kept(dtype, maybe_jit):
  grad_relu = maybe_jit(jax.grad(jmp.autocast(jax.nn.relu, dtype)))
  assert float(grad_relu(jnp.float32(0.0))) == 0.0
  assert float(grad_relu(jnp.float32(2.0))) == 1.0

  @jax.custom_jvp
  def f(x):
    return jnp.exp(x)

  f.defjvp(lambda primals, tangents: (f(*primals), 3.0 * tangents[0] * jnp.exp(primals[0])))
  x = jnp.full((2,), 12.0, dtype)
  out, tangent = jax.jvp(maybe_jit(jmp.autocast(f, dtype)), (x,), (jnp.ones_like(x),))
  assert out.dtype == tangent.dtype == F32  # exp ran in float32, and so did the rule
  assert_close(tangent, 3 * np.exp(np.float32(12.0)) * np.ones(2), 1e-6)


def test_custom_vjp_forward_and_backward_run_under_autocast(maybe_jit):
  trace = []

  @jax.custom_vjp
  def f(x, n):
    return jnp.exp(x) * n

  def fwd(x, n):
    y = jnp.exp(x)
    return y * n, (y, n)

  def bwd(res, g):
    trace.append("bwd")
    y, n = res
    return (42.0 * g * y * n, None)

  f.defvjp(fwd, bwd)
  x = jnp.array([1.0, 12.0], jnp.float16)  # exp(12) overflows float16
  loss = lambda v: jnp.sum(f(v, jnp.int32(2)) * 2.0**-20)
  assert not np.isfinite(np.asarray(jax.grad(loss)(x), np.float32)).all()
  trace.clear()
  grad = maybe_jit(jax.grad(jmp.autocast(loss, jnp.float16)))(x)
  assert trace == ["bwd"]  # the user's backward rule ran
  assert grad.dtype == F16  # cotangents come back in the input's dtype
  assert_close(grad, 84 * 2.0**-20 * np.exp(np.float32([1.0, 12.0])), 1e-3)


# --- Control flow -------------------------------------------------------------------------


CONTROL_FLOW = {
    "scan": lambda x: jax.lax.scan(
        lambda c, r: (c + jnp.sum(jnp.exp(r)), jnp.exp(r)), 0.0 * x[0, 0], x),
    "fori_loop": lambda x: jax.lax.fori_loop(
        0, 3, lambda i, c: c + jnp.exp(x[i]), jnp.zeros_like(x[0])),
    "while_loop": lambda x: jax.lax.while_loop(
        lambda c: c[0] < x.shape[0], lambda c: (c[0] + 1, c[1] + jnp.sum(x[c[0]] ** 4)),
        (jnp.int32(0), 0.0 * x[0, 0]))[1],
    "cond": lambda x: jax.lax.cond(jnp.sum(x) > 0, lambda v: jnp.exp(v), lambda v: v * 2, x),
    "switch": lambda x: jax.lax.switch(jnp.int32(x[0, 0] > 0), [lambda v: v * 2, jnp.exp], x),
    "checkpoint": lambda x: jax.checkpoint(lambda v: jnp.sum(jnp.exp(v)) * v)(x),
    "jit": lambda x: jax.jit(lambda v: jnp.exp(v) / jnp.sum(jnp.exp(v)))(x),
}


@pytest.mark.parametrize("name", list(CONTROL_FLOW))
def test_control_flow_bodies_are_autocast(name, maybe_jit):
  fn = CONTROL_FLOW[name]
  x = jnp.linspace(9.0, 12.0, 12).reshape(3, 4)  # exp overflows float16 above 11.1
  half = x.astype(jnp.float16)
  assert not all(np.isfinite(np.asarray(o, np.float32)).all() for o in jax.tree.leaves(fn(half)))
  out = maybe_jit(jmp.autocast(fn, jnp.float16))(half)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(fn(x))):
    assert got.dtype == F32, name
    assert_close(got, want, 1e-3)


def test_loop_carries_widen_to_a_fixed_point_and_cond_outputs_agree():
  # The carry starts f16 and its update is f32: the whole loop carries f32.
  x = jnp.full((4,), 300.0, jnp.float16)
  scan = lambda v: jax.lax.scan(lambda c, r: (c + r ** 2, c), jnp.float16(0), v)
  carry, history = jmp.autocast(scan, jnp.float16)(x)
  assert carry.dtype == history.dtype == F32 and float(carry) == 360_000.0
  # One branch computes in f32, the other in f16: both return f32.
  cond = lambda p, v: jax.lax.cond(p, lambda u: jnp.exp(u), lambda u: u + 1, v)
  f = jax.jit(jmp.autocast(cond, jnp.float16))
  assert f(True, x[:1] / 25).dtype == f(False, x[:1] / 25).dtype == F32
  assert float(f(False, x[:1] / 25)[0]) == 13.0


def test_scan_over_prng_keys_keeps_the_keys():
  def dropout_layers(x, key):
    def layer(h, k):
      keep = jax.random.bernoulli(k, 0.75, h.shape)
      return jnp.where(keep, jnp.exp(h) / 0.75, 0.0), keep
    return jax.lax.scan(layer, x, jax.random.split(key, 2))

  x = jnp.linspace(1.0, 3.0, 8)
  out, masks = jax.jit(jmp.autocast(dropout_layers, jnp.float16))(x.astype(jnp.float16), key(10))
  ref_out, ref_masks = dropout_layers(x.astype(jnp.float16).astype(jnp.float32), key(10))
  np.testing.assert_array_equal(masks, ref_masks)  # the same random bits
  assert out.dtype == F32
  assert_close(out, ref_out, 1e-2)


def test_closed_call_body_is_autocast():
  inner = jax.make_jaxpr(lambda v: jnp.sum(jnp.exp(v)))(jnp.ones(3, jnp.float16))
  prim = jex_primitives.closed_call_p
  f = lambda v: prim.bind(v, **prim.get_bind_params({"call_jaxpr": inner}))[0]
  x = jnp.full((3,), 12.0, jnp.float16)
  assert "closed_call" in str(jax.make_jaxpr(f)(x))
  assert_close(jmp.autocast(f, jnp.float16)(x), 3 * np.exp(np.float32(12.0)), 1e-6)


def test_shard_map_body_is_autocast_and_sharding_constraints_are_kept(maybe_jit):
  mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
  sharding = NamedSharding(mesh, P("d"))

  def f(x):
    y = jax.lax.with_sharding_constraint(jnp.exp(x), sharding)
    total = jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b), "d"), mesh=mesh,
                          in_specs=P("d"), out_specs=P())(y)
    return y, total

  x = jnp.full((4, 2), 12.0, jnp.float16)
  y, total = maybe_jit(jmp.autocast(f, jnp.float16))(x)
  assert y.dtype == total.dtype == F32
  assert_close(total, 8 * np.exp(np.float32(12.0)), 1e-6)
  constraints = [e.params["sharding"] for e in jaxpr_utils.walk(
      jax.make_jaxpr(jmp.autocast(f, jnp.float16))(x).jaxpr)
      if e.primitive.name == "sharding_constraint"]
  assert constraints == [sharding]


def cascade_step(carry):
  """A pipelined cascade: carry 0 goes through exp (so it widens to f32), carry k
  multiplies by carry k-1's previous value (so it widens one iteration later)."""
  return (jnp.exp(carry[0]) * 0.5,) + tuple(c * p for c, p in zip(carry[1:], carry[:-1]))


CASCADES = {
    "scan": lambda c: jax.lax.scan(lambda c, _: (cascade_step(c), None), c, None, length=3)[0],
    "fori_loop": lambda c: jax.lax.fori_loop(0, 3, lambda i, c: cascade_step(c), c),
    "while_loop": lambda c: jax.lax.while_loop(
        lambda s: s[0] < 3, lambda s: (s[0] + 1, cascade_step(s[1])), (0, c))[1],
}


@pytest.mark.parametrize("name", list(CASCADES))
def test_carries_that_widen_one_after_another_reach_their_fixed_point(name, maybe_jit):
  # Issue 22 item 4: 7 carries need 8 rounds (the old cap was 4, then lax.mul failed).
  init = tuple(jnp.float16(v) for v in np.linspace(0.5, 1.0, 7))
  out = maybe_jit(jmp.autocast(CASCADES[name], jnp.float16))(init)
  want = CASCADES[name](tuple(c.astype(jnp.float32) for c in init))
  assert [o.dtype for o in out] == [F32] * 7
  for got, ref in zip(out, want):
    assert_close(got, ref, 1e-6)


def layers_scan(ws, x):
  def layer(carry, w):
    h, acc = carry
    h = jnp.tanh(h @ w)
    return (h, acc + jnp.sum(jnp.exp(h), axis=-1)), None
  return jax.lax.scan(layer, (x, 0.0 * x[:, 0]), ws)[0]


def layers_fori(ws, x):
  return jax.lax.fori_loop(0, ws.shape[0], lambda i, h: jnp.tanh(h @ ws[i]), x), None


def layers_while(ws, x):
  def body(s):
    i, h, acc = s
    h = jnp.tanh(h @ ws[i])
    return i + 1, h, acc + jnp.sum(jnp.exp(h), axis=-1)
  init = (jnp.int32(0), x, 0.0 * x[:, 0])  # acc varies along "d", as x does
  return jax.lax.while_loop(lambda s: s[0] < ws.shape[0], body, init)[1:]


@jax.custom_vjp
def matmul_psum_grad(x, w):
  return x @ w


matmul_psum_grad.defvjp(
    lambda x, w: (x @ w, (x, w)),
    lambda res, g: (g @ res[1].T, jax.lax.psum(res[0].T @ g, "d")))  # w is replicated


# name: (per-shard fn(ws, x) -> (h, acc or None), h's dtype under autocast, differentiable)
SHARDED_LOOPS = {
    "scan": (layers_scan, F32, True),  # h: the carry started f32, and a carry never narrows
    "fori_loop": (layers_fori, F32, True),
    "while_loop": (layers_while, F32, False),
    # In half as traced: in float32, relu's 0.0 (a pvary'd literal) would widen it.
    "custom_jvp": (lambda ws, x: (jax.nn.relu(x.astype(jnp.float16) @ ws[0].astype(jnp.float16)),
                                  None), F16, True),
    "custom_vjp": (lambda ws, x: (jnp.tanh(matmul_psum_grad(x, ws[0])), None), F16, True),
}


def check_loop_in_shard_map(mesh, loop, outside):
  """``loop(ws, x)`` on a batch split over ``mesh``'s axis "d", with replicated weights,
  as ``autocast(shard_map(loop))`` (``outside``) or ``shard_map(autocast(loop))``."""
  body, h_dtype, differentiable = SHARDED_LOOPS[loop]
  specs = dict(mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))
  plain = jax.shard_map(body, **specs)
  run = (jmp.autocast(plain, jnp.float16) if outside
         else jax.shard_map(jmp.autocast(body, jnp.float16), **specs))
  ws = jax.random.normal(key(11), (3, 8, 8)) * 0.4
  x = jax.random.normal(key(12), (4 * mesh.size, 8))
  assert out_dtypes(run, ws, x, names={"dot_general"}) == {"dot_general": {"float16"}}
  (h, acc), (want_h, want_acc) = run(ws, x), plain(ws, x)
  assert h.dtype == h_dtype
  assert_close(h, want_h, HALF_TOL[F16])
  if acc is not None:
    assert acc.dtype == F32
    assert_close(acc, want_acc, HALF_TOL[F16])
  if differentiable:
    grad = lambda f: jax.grad(lambda w: jnp.sum(f(w, x)[0].astype(jnp.float32) ** 2))(ws)
    assert_close(grad(run), grad(plain), HALF_TOL[F16])


SHARD_MAP_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
from jax.sharding import Mesh
import test_autocast as t
assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("d",))
for loop in t.SHARDED_LOOPS:
  for outside in (True, False):
    t.check_loop_in_shard_map(mesh, loop, outside)
print("ok")
"""


# Issue 22 item 5: the fixpoint traced carries without their varying manual axes (and
# custom_jvp/custom_vjp traced their rules without them). Every loop, inside and outside
# autocast, on a mesh of 4 devices (a copy on one device repeated it, and was dropped).
@pytest.mark.slow
def test_loops_inside_shard_map_on_four_cpu_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  child = SHARD_MAP_CHILD.format(tests=str(pathlib.Path(__file__).parent))
  proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout


def test_unknown_primitives_run_in_their_traced_dtypes_and_effects_are_kept(maybe_jit):
  seen = []

  def double(a):
    seen.append(a.dtype)
    return np.asarray(a) * 2

  def f(x):
    big = jnp.sum(x) * x  # f32 under autocast, declared f16
    out = jax.pure_callback(double, jax.ShapeDtypeStruct(x.shape, x.dtype), big)
    jax.debug.callback(lambda v: seen.append(("debug", v.dtype)), jnp.exp(x))
    return out

  x = jnp.full((3,), 2.0, jnp.float16)
  out = maybe_jit(jmp.autocast(f, jnp.float16))(x)
  jax.effects_barrier()
  assert out.dtype == F16 and np.all(np.asarray(out) == 24.0)
  # The callbacks got the dtypes they were traced with.
  assert sorted(map(str, seen)) == sorted(map(str, [F16, ("debug", F16)]))


# --- Composition with grad, vmap and jit ----------------------------------------------------


def mlp_loss(params, x):
  h = jax.nn.relu(x @ params["w1"])
  return jnp.mean(jax.nn.logsumexp(h @ params["w2"], axis=-1))


@pytest.fixture
def mlp():
  k1, k2, k3 = jax.random.split(key(1), 3)
  params = {"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 4))}
  return params, jax.random.normal(k3, (5, 8)) * 3


@half_dtypes
def test_grad_runs_backward_matmuls_in_half_and_returns_float32(dtype, mlp, maybe_jit):
  params, x = mlp
  grad_fn = jax.grad(jmp.autocast(mlp_loss, dtype))
  grads = maybe_jit(grad_fn)(params, x)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
  expected = jax.jit(jax.grad(mlp_loss))(params, x)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert_close(got, want, 5 * HALF_TOL[dtype])
  found = out_dtypes(grad_fn, params, x, names={"dot_general", "exp", "log"})
  assert found == {"dot_general": {dtype.name}, "exp": {"float32"}, "log": {"float32"}}


def test_autocast_of_grad_agrees_with_grad_of_autocast(mlp):
  params, x = mlp
  inside = jax.jit(jmp.autocast(jax.grad(mlp_loss), jnp.float16))(params, x)
  outside = jax.jit(jax.grad(jmp.autocast(mlp_loss, jnp.float16)))(params, x)
  expected = jax.jit(jax.grad(mlp_loss))(params, x)
  for a, b, want in zip(*map(jax.tree.leaves, (inside, outside, expected))):
    assert_close(a, want, 5 * HALF_TOL[F16])
    assert_close(b, want, 5 * HALF_TOL[F16])


def test_vmap_of_autocast_equals_autocast_of_vmap(mlp):
  params, x = mlp
  per_example = lambda p, row: mlp_loss(p, row[None])
  outside = jax.vmap(jmp.autocast(per_example, jnp.float16), in_axes=(None, 0))(params, x)
  inside = jmp.autocast(jax.vmap(per_example, in_axes=(None, 0)), jnp.float16)(params, x)
  assert outside.dtype == inside.dtype == F32
  np.testing.assert_array_equal(outside, inside)
  assert_close(outside, jax.vmap(per_example, in_axes=(None, 0))(params, x), HALF_TOL[F16])


def test_jit_traces_once_and_eager_calls_reuse_nested_jits(mlp):
  params, x = mlp
  traces = []

  def loss(p, v):
    traces.append(1)
    return mlp_loss(p, v)

  step = jax.jit(jax.value_and_grad(jmp.autocast(loss, jnp.float16)))
  for i in range(3):
    step(params, x + i)
  assert len(traces) == 1
  traces.clear()
  eager = jmp.autocast(jax.jit(loss), jnp.float16)
  first = eager(params, x)
  compiles = []
  listener = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    second = eager(params, x)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert len(traces) == 1 and not compiles  # jax.jit's trace cache, then autocast's
  assert second == first


def test_pytrees_keyword_arguments_static_leaves_and_keys():
  def f(tree, *, scale, act, rng):
    noise = jax.random.normal(rng, tree["x"].shape)
    return {"y": act(tree["x"] @ tree["w"]) * scale, "n": noise, "tag": "ok"}, rng

  tree = {"x": jnp.ones((2, 3)), "w": jnp.ones((3, 3))}
  out, rng = jmp.autocast(f, jnp.float16)(tree, scale=0.5, act=jnp.tanh, rng=key(3))
  assert out["tag"] == "ok" and out["y"].dtype == F16 and out["n"].dtype == F32
  assert jax.random.key_data(rng).tolist() == jax.random.key_data(key(3)).tolist()


# --- Flax, NNX and Equinox models -------------------------------------------------------


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3, 3))(x)
    h = nn.LayerNorm()(nn.relu(h)).reshape(x.shape[0], -1)
    return nn.Dense(10)(h)


@half_dtypes
def test_flax_linen_apply_unchanged_model(dtype):
  model, x = LinenNet(), jax.random.normal(key(4), (2, 6, 6, 3))
  variables = model.init(key(5), x)
  apply = jmp.autocast(model.apply, dtype)
  found = out_dtypes(apply, variables, x,
                     names={"dot_general", "conv_general_dilated", "reduce_sum", "rsqrt"})
  assert found == {"dot_general": {dtype.name}, "conv_general_dilated": {dtype.name},
                   "reduce_sum": {"float32"}, "rsqrt": {"float32"}}
  out = jax.jit(apply)(variables, x)
  assert out.dtype == dtype  # the half matmul plus a float32 bias stays half, as torch's linear
  assert_close(out, jax.jit(model.apply)(variables, x), 2 * HALF_TOL[dtype])
  half_params = jmp.Policy(F32, dtype, F32).cast_to_compute(variables)
  assert jax.jit(apply)(half_params, x.astype(dtype)).dtype == dtype  # as in the train step


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.norm(jax.nn.relu(self.l1(x))))


def test_flax_nnx_module_and_functional_split():
  model, x = NNXNet(nnx.Rngs(0)), jax.random.normal(key(6), (3, 8))
  graphdef, state = nnx.split(model)
  functional = jmp.autocast(lambda s, v: nnx.merge(graphdef, s)(v), jnp.float16)
  direct = jmp.autocast(lambda m, v: m(v), jnp.float16)
  found = out_dtypes(functional, state, x, names={"dot_general", "reduce_sum", "rsqrt"})
  assert found == {"dot_general": {"float16"}, "reduce_sum": {"float32"}, "rsqrt": {"float32"}}
  out = jax.jit(functional)(state, x)
  assert out.dtype == F16  # float32 params: the bias add after the half matmul stays half
  assert_close(out, nnx.jit(lambda m, v: m(v))(model, x), HALF_TOL[F16])
  np.testing.assert_array_equal(nnx.jit(direct)(model, x), out)


def test_equinox_module_with_function_leaves():
  mlp = eqx.nn.MLP(8, 4, 32, 2, activation=jax.nn.gelu, key=key(7))
  x = jax.random.normal(key(8), (5, 8))
  run = jmp.autocast(lambda m, v: jax.vmap(m)(v), jnp.float16)
  out = eqx.filter_jit(run)(mlp, x)  # the activation is a leaf: static, as in filter_jit
  assert out.dtype == F16  # vmapped, the float32 biases are broadcast: they do not widen
  assert_close(out, eqx.filter_jit(lambda m, v: jax.vmap(m)(v))(mlp, x), HALF_TOL[F16])
  assert out_dtypes(lambda v: run(mlp, v), x, names={"dot_general"}) == {"dot_general": {"float16"}}
  grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(run(m, x) ** 2)))(mlp)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


def test_equinox_python_number_fields_stay_static_eagerly():
  # MaxPool2d holds init=-inf and Dropout p=0.5 as Python numbers: autocast traces only
  # the arrays (filtering.py), as the step does, also without eqx.filter_jit around it.
  k1, k2 = jax.random.split(key(9))
  conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
  pool, drop, head = eqx.nn.MaxPool2d(2, stride=2), eqx.nn.Dropout(0.5), eqx.nn.Linear(16, 2, key=k2)
  model = (conv, pool, drop, head)

  def f(model, x, k):
    conv, pool, drop, head = model
    return head(drop(pool(jax.nn.relu(conv(x))).reshape(-1), key=k))

  x = jax.random.normal(key(10), (1, 4, 4))
  out = jmp.autocast(f, jnp.float16)(model, x, key(11))
  assert out.dtype == F32 and pool.init == -np.inf and drop.p == 0.5
  assert_close(out, f(model, x, key(11)), HALF_TOL[F16])


# --- Lint and the train step ----------------------------------------------------------------


def naive_loss(params, batch):
  logits = batch["x"] @ params["w"]
  probs = naive_softmax(logits)
  return -jnp.mean(jnp.log(jnp.take_along_axis(probs, batch["y"][:, None], axis=1)))


def classification(seed=0, n=64, d=16, classes=4):
  kx, kw = jax.random.split(key(seed))
  x = jax.random.normal(kx, (n, d))
  teacher = jax.random.normal(kw, (d, classes)) * 3
  return {"x": x, "y": jnp.argmax(x @ teacher, axis=1)}, teacher


def test_lint_under_autocast_keeps_only_the_alignment_findings():
  batch, teacher = classification(d=12, classes=5)
  params = {"w": teacher}
  plain = {f.op for f in jmp.precision_lint(naive_loss, params, batch, policy="mixed_float16")}
  assert {"softmax/logsumexp", "reduce_sum", "dot_general"} <= plain
  flag = [f.op for f in jmp.precision_lint(naive_loss, params, batch, policy="mixed_float16",
                                           autocast=True)]
  wrapped = [f.op for f in jmp.precision_lint(jmp.autocast(naive_loss, jnp.float16), params,
                                              batch, policy="mixed_float16")]
  assert flag == wrapped == ["dot_general"]  # contracting size 12, 5 output features


def train(policy, *, autocast, steps, batch, params, bad_step=None):
  traces = []

  def loss_fn(p, b):
    traces.append(1)
    return naive_loss(p, b)

  tx = optax.adam(0.1)
  if policy.compute_dtype == F16:
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**10)
  state = jmp.TrainState.create(params=params, tx=tx)
  step = jmp.make_train_step(loss_fn, policy, autocast=autocast)
  losses, finite = [], []
  for i in range(steps):
    b = batch if i != bad_step else {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)}
    before = np.array(state.params["w"])
    state, metrics = step(state, b)
    if i == bad_step:  # skipped: the params are bit-for-bit unchanged
      np.testing.assert_array_equal(state.params["w"], before)
    losses.append(float(metrics["loss"]))
    finite.append(bool(metrics["grads_finite"]))
  return np.array(losses), np.array(finite), len(traces), state


def test_train_step_issue_example_nan_under_mixed_float16_trains_under_autocast():
  batch, _ = classification()
  params = {"w": jax.random.normal(key(9), (16, 4)) * 3}  # logits ~ N(0, 12^2): exp overflows f16
  steps = 40
  f32_losses, f32_finite, _, _ = train(jmp.get_policy("f32"), autocast=False, steps=steps,
                                       batch=batch, params=params)
  mixed_losses, mixed_finite, _, mixed = train(jmp.get_policy("mixed_float16"), autocast=False,
                                               steps=steps, batch=batch, params=params)
  assert not mixed_finite.any() and np.isnan(mixed_losses).all()  # every step skipped
  np.testing.assert_array_equal(mixed.params["w"], params["w"])
  auto_losses, auto_finite, traces, _ = train(jmp.get_policy("mixed_float16"), autocast=True,
                                              steps=steps, batch=batch, params=params)
  assert auto_finite.all() and traces == 1  # one compilation
  assert f32_losses[-1] < 0.5 * f32_losses[0]
  np.testing.assert_allclose(auto_losses, f32_losses, rtol=0.05, atol=1e-3)


def test_train_step_autocast_skip_is_exact():
  batch, teacher = classification(seed=1)
  policy = jmp.get_policy("mixed_bfloat16")
  losses, finite, traces, _ = train(policy, autocast=True, steps=4, batch=batch,
                                    params={"w": teacher}, bad_step=2)
  assert finite.tolist() == [True, True, False, True] and traces == 1


# --- Bad input ---------------------------------------------------------------------------------


def test_bad_arguments_name_the_value():
  with pytest.raises(TypeError, match="fun must be callable, got 3"):
    jmp.autocast(3, jnp.float16)
  with pytest.raises(ValueError, match="float16 or jnp.bfloat16, got <class 'jax.numpy.float32'>"):
    jmp.autocast(jnp.exp, jnp.float32)
  with pytest.raises(ValueError, match="got 'int8'"):
    jmp.autocast(jnp.exp, "int8")
  with pytest.raises(TypeError, match="got 'banana'"):
    jmp.autocast(jnp.exp, "banana")
  with pytest.raises(TypeError, match="lists must be a jmp_lite.AutocastLists, got"):
    jmp.autocast(jnp.exp, jnp.float16, lists={"half": ()})
  policy = jmp.get_policy("f32")
  with pytest.raises(ValueError, match="float16 or jnp.bfloat16, got dtype\\('float32'\\)"):
    jmp.make_train_step(naive_loss, policy, autocast=True)
  with pytest.raises(TypeError, match="autocast must be True or False, got 'yes'"):
    jmp.make_train_step(naive_loss, policy, autocast="yes")


def test_op_list_overrides_and_their_errors():
  lists = jmp.AutocastLists().move("tanh", jax.lax.logistic_p, to="float32")
  assert {"tanh", "logistic"} <= lists.float32 and "tanh" not in lists.promote
  x = jnp.ones(3, jnp.float16)
  assert jmp.autocast(jnp.tanh, jnp.float16, lists=lists)(x).dtype == F32
  assert jmp.autocast(jnp.tanh, jnp.float16)(x).dtype == F16
  original = jmp.AutocastLists().move("exp", to="original")
  assert jmp.autocast(jnp.exp, jnp.float16, lists=original)(x).dtype == F16
  assert lists == jmp.AutocastLists().move("tanh", "logistic", to="float32")
  with pytest.raises(ValueError, match=r"unknown primitive name\(s\) \['softmax'\] for "
                                       r"AutocastLists.float32"):
    jmp.AutocastLists().move("softmax", to="float32")
  with pytest.raises(ValueError, match=r"\['layer_norm'\] for AutocastLists.original"):
    jmp.AutocastLists().move("layer_norm", to="original")
  with pytest.raises(ValueError, match=r"\['sofmax'\] for AutocastLists.promote"):
    jmp.AutocastLists(promote={"add", "sofmax"})
  with pytest.raises(ValueError, match=r"\['exp'\] appear in both AutocastLists.half and "
                                       r"AutocastLists.float32"):
    jmp.AutocastLists(half={"dot_general", "exp"})
  with pytest.raises(ValueError, match=r"\['scan'\] for AutocastLists.promote: autocast has"):
    jmp.AutocastLists().move("scan", to="promote")
  with pytest.raises(ValueError, match="to must be one of .* got 'fp32'"):
    jmp.AutocastLists().move("exp", to="fp32")
  with pytest.raises(TypeError, match="half must be a collection of primitive names"):
    jmp.AutocastLists(half="dot_general")


def test_default_lists_name_real_primitives():
  lists = jmp.AutocastLists()
  names = lists.half | lists.float32 | lists.promote
  assert not names - jaxpr_utils.primitive_names()
  assert lists.rule("dot_general") == "half" and lists.rule("reduce_sum") == "float32"
  assert lists.rule("add") == "promote" and lists.rule("pure_callback") == "original"


# --- Extension points: handlers and per-op half rules (issue 20) ---------------------------


def test_every_own_rule_is_a_registered_handler_or_convert():
  assert set(interp.HANDLERS) | {"convert_element_type"} == autocast_lists.OWN_RULES
  with pytest.raises(ValueError, match="a handler for 'exp' needs the name in "
                                       "autocast_lists.OWN_RULES"):
    interp.register_handler("exp", lambda eqn, ins, cfg: ins, ())


def test_a_half_rule_runs_for_half_list_ops_only_and_inside_nested_jit_and_scan():
  calls = []

  def doubled(eqn, ins, cfg):  # A rule that changes the result, so its use shows in the numbers.
    calls.append((eqn.primitive.name, tuple(str(x.dtype) for x in ins), cfg.fp8))
    if eqn.params["dimension_numbers"][1][0]:  # Batched matmuls: the ordinary bind.
      return None
    return [2 * out for out in jaxpr_utils.bind(eqn, ins)]

  def f(w, x, mult):
    h = jax.jit(lambda a: jnp.tanh(a @ w))(x)                                   # 1 matmul
    h = jax.lax.scan(lambda c, m: (c @ m, None), h, mult)[0]                    # 1 per step
    return jnp.exp(h).sum() + jnp.einsum("bij,bjk->bik", mult, mult).sum()    # exp, batched

  w = jax.random.normal(key(13), (4, 4)) * 0.5
  x = jax.random.normal(key(14), (3, 4))
  mult = jax.random.normal(key(15), (2, 4, 4)) * 0.5

  def reference(w, x, mult):  # The same program with the unbatched matmuls doubled.
    h = jnp.tanh(2 * (x @ w))
    h = jax.lax.scan(lambda c, m: (2 * (c @ m), None), h, mult)[0]
    return jnp.exp(h).sum() + jnp.einsum("bij,bjk->bik", mult, mult).sum()

  previous = interp.HALF_RULES["dot_general"]  # autocast's FP8 rule
  interp.register_half_rule("dot_general", doubled)
  try:
    got = jmp.autocast(f, jnp.float16)(w, x, mult)
    assert {c[0] for c in calls} == {"dot_general"}
    assert {c[1] for c in calls} == {("float16", "float16")} and {c[2] for c in calls} == {None}
    assert_close(got, reference(w, x, mult), HALF_TOL[F16])
    assert not np.isclose(float(got), float(f(w, x, mult)), rtol=0.1)
    calls.clear()  # Moved out of the half list, the matmul is no longer the rule's.
    lists = jmp.AutocastLists().move("dot_general", to="float32")
    got = jmp.autocast(lambda a, b: a @ b, jnp.float16, lists=lists)(w, x.T)
    assert not calls and got.dtype == F32
  finally:
    interp.register_half_rule("dot_general", previous)
  assert interp.HALF_RULES["dot_general"] is autocast_fp8.rule

"""fp8: the recipe, per-tensor current scaling, and the quantised dot and its VJP.

XLA:CPU emulates the float8 dots (it rounds to float8 and multiplies in the
half dtype), so the numbers here are the ones an FP8 GEMM gives, up to the
accumulation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.fp8 import (FLOAT8_DTYPES, Float8Recipe, as_recipe, dequantize,
                               fp8_dot_general, quantize, scale_inv)

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))  # (m, k) @ (k, n)
DEFAULT = Float8Recipe()


def normal(seed, shape, scale, dtype=BF16):
  return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


def rel_error(actual, expected):
  """Relative Frobenius error, in float64; NaN if ``actual`` has a NaN."""
  a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def dot8(a, b, dn=MATMUL, recipe=DEFAULT, **kw):
  return fp8_dot_general(a, b, dn, recipe=recipe, **kw)


def qdq(x, fmt, dtype=None, recipe=DEFAULT):
  return dequantize(*quantize(x, fmt, margin=recipe.margin, power_of_two=recipe.power_of_two,
                              dtype=dtype))


# ------------------------------------------------------------------ (a) the jaxpr


def _jaxprs(jaxpr):
  yield jaxpr
  for eqn in jaxpr.eqns:
    for sub in jaxpr_utils.subjaxprs(eqn):
      yield from _jaxprs(sub)


_COMMUTING = frozenset({"transpose", "broadcast_in_dim", "reshape", "copy"})


def _f8_source(var, producers):
  """The float8 dtype ``var`` is dequantised from: mul(convert(f8), broadcast(scalar))."""
  def producer(v):
    return None if isinstance(v, jex_core.Literal) else producers.get(v)
  eqn = producer(var)
  while eqn is not None and eqn.primitive.name in _COMMUTING:
    eqn = producer(eqn.invars[0])
  if eqn is None or eqn.primitive.name != "mul":
    return None
  ins = [producer(v) for v in eqn.invars]
  converts = [e for e in ins if e is not None and e.primitive.name == "convert_element_type"]
  scalars = [e for e in ins if e is not None and e.primitive.name == "broadcast_in_dim"
             and e.invars[0].aval.shape == ()]
  if len(converts) != 1 or len(scalars) != 1:
    return None
  src = jaxpr_utils.dtype_of(converts[0].invars[0])
  return src.name if src in FLOAT8_DTYPES else None


def dot_sources(fn, *args):
  """For each dot_general in ``fn``'s jaxpr (and sub-jaxprs): the float8 dtypes of its operands."""
  found = []
  for jaxpr in _jaxprs(jax.make_jaxpr(fn)(*args).jaxpr):
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    found += [tuple(_f8_source(v, producers) for v in eqn.invars)
              for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]
  return sorted(found, key=str)


@pytest.mark.parametrize("forward,backward", [(E4M3, E5M2), (E5M2, E4M3)])
def test_every_gemm_reads_dequantised_float8(forward, backward):
  recipe = Float8Recipe(forward, backward)
  a, b = normal(0, (8, 16), 1.0), normal(1, (16, 4), 1.0)
  loss = lambda a, b: jnp.sum(dot8(a, b, recipe=recipe).astype(F32) ** 2)
  f, g = forward.name, backward.name
  expected = sorted([(f, f), (g, f), (g, f)], key=str)  # forward, d_lhs = g.rhs, d_rhs = lhs.g
  assert dot_sources(jax.value_and_grad(loss, (0, 1)), a, b) == expected
  # Inside jit, scan and remat: the same pattern in the sub-jaxprs.
  layered = jax.jit(lambda a, ws: lax.scan(
      jax.checkpoint(lambda h, w: (dot8(h, w, recipe=recipe), None)), a, ws)[0].sum())
  ws = jnp.stack([normal(2, (16, 16), 1.0)] * 2)
  sources = dot_sources(jax.grad(layered, (0, 1)), a, ws)
  assert sources and set(sources) == {(f, f), (g, f)}
  # The quantisation saturates: each f8 operand comes from a clamp to +-fmax.
  jaxpr = jax.make_jaxpr(jax.grad(loss))(a, b).jaxpr
  clamps = {float(e.invars[2].val) for e in jaxpr_utils.walk(jaxpr) if e.primitive.name == "clamp"}
  assert clamps == {float(jnp.finfo(forward).max), float(jnp.finfo(backward).max)}


def test_plain_dot_has_no_float8():
  """The walker can fail: a bf16 dot is not dequantised float8."""
  a, b = normal(0, (8, 16), 1.0), normal(1, (16, 4), 1.0)
  loss = lambda a, b: jnp.sum(a @ b)
  assert dot_sources(jax.value_and_grad(loss, (0, 1)), a, b) == [(None, None)] * 3
  # Nor is a plain cast to float8 without a scale.
  cast = lambda a, b: jnp.sum(a.astype(E4M3).astype(BF16) @ b)
  assert dot_sources(cast, a, b) == [(None, None)]


# ------------------------------------------------------------- (b) numerics


@pytest.mark.parametrize("mag", [1e-6, 1.0, 1e3])
def test_product_and_grads_against_float32(mag, maybe_jit):
  a, b = normal(0, (64, 128), mag), normal(1, (128, 32), mag)
  g = normal(2, (64, 32), mag)
  ref, ref_vjp = jax.vjp(lambda a, b: a @ b, a.astype(F32), b.astype(F32))
  out, vjp = maybe_jit(lambda a, b: jax.vjp(dot8, a, b))(a, b)
  err = rel_error(out, ref)
  assert 0 < err < 0.08
  for got, want in zip(vjp(g), ref_vjp(g.astype(F32))):
    assert 0 < rel_error(got, want) < 0.12
  plain = (a.astype(E4M3).astype(BF16) @ b.astype(E4M3).astype(BF16))
  plain_err = rel_error(plain, ref)
  if mag == 1.0:
    assert plain_err < 0.08  # In e4m3's range: a plain cast works, and so does scaling.
  else:
    assert not plain_err < 0.5, plain_err  # Flushed to zero (1e-6) or NaN past 448 (1e3).


def test_margin_and_power_of_two_cost_a_little_precision():
  a, b = normal(0, (64, 128), 1.0), normal(1, (128, 32), 1.0)
  ref = a.astype(F32) @ b.astype(F32)
  errs = [rel_error(dot8(a, b, recipe=Float8Recipe(margin=m, power_of_two=p)), ref)
          for m, p in [(0, False), (0, True), (4, False)]]
  assert all(0 < e < 0.08 for e in errs), errs


# --------------------------------------------------------- (c) zeros, (d) non-finite


def test_all_zero_operand_gives_exact_zeros(maybe_jit):
  a, b = jnp.zeros((8, 16), BF16), normal(1, (16, 4), 1.0)
  g = normal(2, (8, 4), 1.0)
  out, vjp = maybe_jit(lambda a, b: jax.vjp(dot8, a, b))(a, b)
  d_a, d_b = vjp(g)
  assert np.array_equal(out, np.zeros((8, 4))) and np.array_equal(d_b, np.zeros((16, 4)))
  assert np.all(np.isfinite(d_a)) and np.any(d_a != 0)
  assert all(np.array_equal(d, np.zeros(d.shape)) for d in vjp(jnp.zeros_like(g)))
  q, s = quantize(a, E4M3)
  assert float(s) == 1.0 and np.array_equal(q.astype(F32), np.zeros(a.shape))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["lhs", "rhs", "cotangent"])
def test_non_finite_values_stay_non_finite(bad, where, maybe_jit):
  a, b, g = normal(0, (8, 16), 1.0), normal(1, (16, 4), 1.0), normal(2, (8, 4), 1.0)
  a = a.at[3, 5].set(bad) if where == "lhs" else a
  b = b.at[2, 1].set(bad) if where == "rhs" else b
  g = g.at[0, 0].set(bad) if where == "cotangent" else g
  out, vjp = maybe_jit(lambda a, b: jax.vjp(dot8, a, b))(a, b)
  d_a, d_b = vjp(g)
  if where == "cotangent":  # Both gradients read the cotangent.
    assert np.all(np.isfinite(out)) and np.all(np.isnan(d_a)) and np.all(np.isnan(d_b))
  else:  # d_lhs = g . rhs and d_rhs = lhs . g: the one that reads the bad operand.
    assert np.all(np.isnan(out))
    bad_grad, clean_grad = (d_b, d_a) if where == "lhs" else (d_a, d_b)
    assert np.all(np.isnan(bad_grad)) and np.all(np.isfinite(clean_grad))


def test_saturates_finite_values_and_uses_the_whole_range():
  x = normal(0, (1000,), 3.0, F32)
  for fmt in FLOAT8_DTYPES:
    q, s = quantize(x, fmt)
    fmax = float(jnp.finfo(fmt).max)
    assert float(jnp.max(jnp.abs(q.astype(F32)))) == fmax, fmt
    assert rel_error(dequantize(q, s), x) < 2.0 ** -jnp.finfo(fmt).nmant, fmt


# ------------------------------------------------------- (e) jit, grad, vmap, scan, remat


def test_vmap_scales_each_example_on_its_own():
  a = jnp.stack([normal(0, (8, 16), 1.0), normal(1, (8, 16), 1e3)])
  b = normal(2, (16, 4), 1.0)
  g = normal(3, (2, 8, 4), 1.0)
  loss = lambda a, b, g: jnp.sum(dot8(a, b).astype(F32) * g)
  batched = jax.vmap(jax.value_and_grad(loss, (0, 1)), (0, None, 0))(a, b, g)
  for i in range(2):
    one = jax.value_and_grad(loss, (0, 1))(a[i], b, g[i])
    np.testing.assert_array_equal(batched[0][i], one[0])
    np.testing.assert_array_equal(batched[1][0][i], one[1][0])
    np.testing.assert_array_equal(batched[1][1][i], one[1][1])
  assert rel_error(batched[1][0][1], jax.grad(lambda a: loss(a, b, g[1]))(a[1])) == 0


def test_scan_remat_and_jit_match_the_unrolled_loop():
  h0, ws = normal(0, (8, 16), 1.0), jnp.stack([normal(i, (16, 16), 0.3) for i in (1, 2, 3)])
  def layer(h, w):
    return jnp.tanh(dot8(h, w)), None
  def scanned(h, ws):
    return jnp.sum(lax.scan(jax.checkpoint(layer), h, ws)[0].astype(F32))
  def unrolled(h, ws):
    for w in ws:
      h, _ = layer(h, w)
    return jnp.sum(h.astype(F32))
  want = jax.value_and_grad(unrolled, (0, 1))(h0, ws)
  for fn in (scanned, jax.jit(scanned), jax.checkpoint(unrolled)):
    got = jax.value_and_grad(fn, (0, 1))(h0, ws)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(x, F32), np.asarray(y, F32), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dn,lhs_shape,rhs_shape", [
    (MATMUL, (8, 16), (16, 4)),
    ((((0,), (1,)), ((), ())), (16, 8), (4, 16)),               # transposed operands
    ((((2,), (1,)), ((0,), (0,))), (3, 8, 16), (3, 16, 4)),     # a batched matmul
    ((((1, 3), (2, 0)), ((2,), (1,))), (5, 6, 3, 4), (4, 3, 6, 2)),  # two contracting dims
])
def test_any_dimension_numbers_against_a_model(dn, lhs_shape, rhs_shape, maybe_jit):
  """The product and the VJP equal plain dots on quantise-dequantised values, bit for bit."""
  a, b = normal(0, lhs_shape, 2.0), normal(1, rhs_shape, 1e-2)
  out, vjp = maybe_jit(lambda a, b: jax.vjp(functools.partial(dot8, dn=dn), a, b))(a, b)
  g = normal(2, out.shape, 50.0)
  @jax.jit
  def model(a, b, g):
    plain = functools.partial(lax.dot_general, dimension_numbers=dn)
    want, want_vjp = jax.vjp(plain, qdq(a, E4M3), qdq(b, E4M3))
    return want, want_vjp(qdq(g, E5M2))
  want, want_grads = model(a, b, g)
  np.testing.assert_array_equal(out, want)
  for got, expected in zip(vjp(g), want_grads):
    np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------- (f) the recipe and its scales


def test_recipe_is_a_hashable_value():
  r = Float8Recipe("float8_e4m3fn", jnp.float8_e4m3fn, margin=np.int64(2), power_of_two=True)
  assert (r.forward, r.backward, r.margin, r.power_of_two) == (E4M3, E4M3, 2, True)
  assert type(r.margin) is int and isinstance(r.forward, np.dtype)
  assert r == Float8Recipe(E4M3, E4M3, 2, True) and {r: 1}[Float8Recipe(E4M3, E4M3, 2, True)] == 1
  assert (DEFAULT.forward, DEFAULT.backward, DEFAULT.margin, DEFAULT.power_of_two) == (
      E4M3, E5M2, 0, False)
  traces = []
  @functools.partial(jax.jit, static_argnums=2)
  def f(a, b, recipe):
    traces.append(recipe)
    return dot8(a, b, recipe=recipe)
  a, b = normal(0, (4, 8), 1.0), normal(1, (8, 2), 1.0)
  f(a, b, Float8Recipe()), f(a, b, Float8Recipe()), f(a, b, r)
  assert traces == [DEFAULT, r]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(forward=3), TypeError, r"forward must be a float8 dtype, got 3; allowed formats: "
                                 r"float8_e4m3fn, float8_e5m2"),
    (dict(backward="bogus"), TypeError, "backward must be a float8 dtype, got 'bogus'"),
    (dict(forward=jnp.bfloat16), ValueError, "forward must be a float8 dtype, got bfloat16; allowed"),
    (dict(backward=jnp.float8_e8m0fnu), ValueError, "got float8_e8m0fnu; allowed"),
    (dict(margin=-1), ValueError, r"margin must be an int >= 0, got -1"),
    (dict(margin=1.5), TypeError, r"margin must be an int >= 0, got 1.5"),
    (dict(margin=True), TypeError, r"margin must be an int >= 0, got True"),
    (dict(power_of_two=1), TypeError, r"power_of_two must be a bool, got 1"),
])
def test_recipe_validation(kwargs, error, match):
  with pytest.raises(error, match=match):
    Float8Recipe(**kwargs)


def test_every_listed_format_is_accepted():
  assert {E4M3, E5M2} <= set(FLOAT8_DTYPES)
  for fmt in FLOAT8_DTYPES:
    assert Float8Recipe(fmt, fmt).forward == fmt and jnp.finfo(fmt).min < 0


def test_as_recipe():
  r = Float8Recipe(margin=1)
  assert as_recipe(None) is None and as_recipe(False) is None
  assert as_recipe(True) == DEFAULT and as_recipe(r) is r
  for bad in ["e4m3", 1, 0, jnp.float8_e4m3fn]:
    with pytest.raises(TypeError, match="fp8 must be None, False, True or a Float8Recipe, got"):
      as_recipe(bad)


def test_dot_argument_errors():
  a = normal(0, (4, 8), 1.0)
  with pytest.raises(TypeError, match="recipe must be a Float8Recipe, got True"):
    fp8_dot_general(a, a.T, MATMUL, recipe=True)
  with pytest.raises(TypeError, match="two floating operands of one dtype, got bfloat16 and float16"):
    dot8(a, a.T.astype(F16))
  with pytest.raises(TypeError, match="two floating operands of one dtype, got int32 and int32"):
    dot8(jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2), jnp.int32))
  with pytest.raises(TypeError, match=r"dimension_numbers must be \(\(lhs_contracting"):
    dot8(a, a.T, dn=(1, 0))


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_power_of_two_scales(dtype):
  for i, mag in enumerate([1e-3, 0.7, 3.0, 200.0]):
    x = normal(i, (64,), mag, dtype)
    for fmt in (E4M3, E5M2):
      s = scale_inv(x, fmt, power_of_two=True)
      mantissa, _ = np.frexp(np.float64(s))
      assert s.dtype == dtype and mantissa == 0.5, (s, mag, fmt)
      q, s2 = quantize(x, fmt, power_of_two=True)
      top = float(jnp.max(jnp.abs(q.astype(F32))))
      fmax = float(jnp.finfo(fmt).max)
      assert s2 == s
      if float(jnp.max(jnp.abs(x))) / fmax >= jnp.finfo(dtype).tiny:
        assert fmax / 2 < top <= fmax  # Rounded down by less than 2.
      else:  # float16: scale_inv stops at its smallest normal, 2**-14.
        assert dtype == F16 and float(s) == 2.0 ** -14 and top < fmax
      # Exact scaling: the dequantised values are the float8 values times 2**k.
      np.testing.assert_array_equal(dequantize(q, s).astype(F32), q.astype(F32) * np.float32(s))


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_leaves_headroom(margin):
  x = normal(0, (256,), 5.0)
  q, s = quantize(x, E4M3, margin=margin)
  assert float(jnp.max(jnp.abs(q.astype(F32)))) == 448.0 / 2 ** margin
  np.testing.assert_allclose(float(s), float(jnp.max(jnp.abs(x))) * 2 ** margin / 448, rtol=2 ** -8)


# ------------------------------------------------------------- (g) bf16 and f16


@pytest.mark.parametrize("dtype,mags", [(BF16, (1e-6, 1e3)), (F16, (1e-2, 30.0))])
@pytest.mark.parametrize("pet", [None, F32])
def test_half_dtypes(dtype, mags, pet, maybe_jit):
  a, b = normal(0, (32, 64), mags[0], dtype), normal(1, (64, 16), mags[1], dtype)
  g = normal(2, (32, 16), 1.0, pet or dtype)
  out, vjp = maybe_jit(lambda a, b: jax.vjp(
      functools.partial(dot8, preferred_element_type=pet), a, b))(a, b)
  d_a, d_b = vjp(g)
  assert (out.dtype, d_a.dtype, d_b.dtype) == (pet or dtype, dtype, dtype)
  ref, ref_vjp = jax.vjp(lambda a, b: a @ b, a.astype(F32), b.astype(F32))
  assert 0 < rel_error(out, ref) < 0.08
  for got, want in zip((d_a, d_b), ref_vjp(g.astype(F32))):
    assert 0 < rel_error(got, want) < 0.12


def test_quantize_argument_errors():
  x = normal(0, (4,), 1.0)
  with pytest.raises(TypeError, match="x and dtype must be floating, got int32 and int32"):
    quantize(jnp.ones(3, jnp.int32), E4M3)
  with pytest.raises(TypeError, match="x and dtype must be floating, got bfloat16 and int8"):
    scale_inv(x, E4M3, dtype=jnp.int8)
  with pytest.raises(ValueError, match="format must be a float8 dtype, got float16; allowed"):
    quantize(x, jnp.float16)
  with pytest.raises(ValueError, match="margin must be an int >= 0, got -2"):
    scale_inv(x, E5M2, margin=-2)
  with pytest.raises(TypeError, match="power_of_two must be a bool, got 'yes'"):
    quantize(x, E5M2, power_of_two="yes")

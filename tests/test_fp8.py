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

from jmp_lite._src.fp8 import dot as fp8_dot
from jmp_lite._src import jaxpr_utils
from jmp_lite._src.fp8.recipe import FLOAT8_DTYPES, Float8Recipe, as_recipe
from jmp_lite._src.fp8.dot import dequantize, fp8_dot_general, quantize, scale_inv

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


def qdq(x, fmt, axes=None, recipe=DEFAULT):
  """``x`` quantised (amax over ``axes``, default all) and dequantised, in float32."""
  axes = tuple(range(x.ndim)) if axes is None else tuple(axes)
  q, s = fp8_dot._quantize(x, np.dtype(fmt), recipe.margin, recipe.power_of_two, axes)
  return dequantize(q, s)


# ------------------------------------------------------------------ (a) the jaxpr


def _jaxprs(jaxpr):
  yield jaxpr
  for eqn in jaxpr.eqns:
    for sub in jaxpr_utils.subjaxprs(eqn):
      yield from _jaxprs(sub)


def dot_operands(fn, *args):
  """For each dot_general in ``fn``'s jaxpr (and sub-jaxprs): its operands' dtype names."""
  found = [tuple(jaxpr_utils.dtype_of(v).name for v in eqn.invars)
           for jaxpr in _jaxprs(jax.make_jaxpr(fn)(*args).jaxpr)
           for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]
  return sorted(found)


@pytest.mark.parametrize("forward,backward", [(E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_every_gemm_multiplies_float8_operands(forward, backward, scaling):
  """The GEMMs are float8 dots (what XLA:GPU runs as FP8 GEMMs), never dequantised half dots."""
  recipe = Float8Recipe(forward, backward, scaling=scaling)
  a, b = normal(0, (8, 16), 1.0), normal(1, (16, 4), 1.0)
  loss = lambda a, b: jnp.sum(dot8(a, b, recipe=recipe).astype(F32) ** 2)
  f, g = forward.name, backward.name
  expected = sorted([(f, f), (g, f), (g, f)])  # forward, d_lhs = g.rhs, d_rhs = g.lhs
  assert dot_operands(jax.value_and_grad(loss, (0, 1)), a, b) == expected
  # Inside jit, scan and remat: the same GEMMs in the sub-jaxprs.
  layered = jax.jit(lambda a, ws: lax.scan(
      jax.checkpoint(lambda h, w: (dot8(h, w, recipe=recipe), None)), a, ws)[0].sum())
  ws = jnp.stack([normal(2, (16, 16), 1.0)] * 2)
  operands = dot_operands(jax.grad(layered, (0, 1)), a, ws)
  assert operands and set(operands) == {(f, f), (g, f)}
  # The quantisation saturates: each f8 operand comes from a clamp to +-fmax.
  jaxpr = jax.make_jaxpr(jax.grad(loss))(a, b).jaxpr
  clamps = {float(e.invars[2].val) for e in jaxpr_utils.walk(jaxpr) if e.primitive.name == "clamp"}
  assert clamps == {float(jnp.finfo(forward).max), float(jnp.finfo(backward).max)}


def test_plain_dot_has_no_float8():
  """The walker can fail: a bf16 dot, or one on dequantised values, is no float8 GEMM."""
  a, b = normal(0, (8, 16), 1.0), normal(1, (16, 4), 1.0)
  loss = lambda a, b: jnp.sum(a @ b)
  assert dot_operands(jax.value_and_grad(loss, (0, 1)), a, b) == [("bfloat16", "bfloat16")] * 3
  cast = lambda a, b: jnp.sum(a.astype(E4M3).astype(BF16) @ b)
  assert dot_operands(cast, a, b) == [("bfloat16", "bfloat16")]


def test_product_dtype_and_float32_product_for_float16():
  """bfloat16 GEMMs return bfloat16; float16 ones float32, scaled before the cast."""
  for dtype, raw in [(BF16, "bfloat16"), (F16, "float32")]:
    a, b = normal(0, (8, 16), 1.0, dtype), normal(1, (16, 4), 1.0, dtype)
    eqn, = [e for e in jaxpr_utils.walk(jax.make_jaxpr(dot8)(a, b).jaxpr)
            if e.primitive.name == "dot_general"]
    assert eqn.params["preferred_element_type"] == np.dtype(raw)


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
  """An example 1e5 times larger than its neighbour does not starve it (a shared scale would).

  Batched and unbatched programs may round the bf16 product once or twice (XLA
  may keep excess precision between fused ops), so they agree to a bf16 ulp,
  not bit for bit.
  """
  a = jnp.stack([normal(0, (8, 16), 1.0), normal(1, (8, 16), 1e5)])
  b = normal(2, (16, 4), 1.0)
  g = normal(3, (2, 8, 4), 1.0)
  f = lambda a, b, g: jax.vjp(dot8, a, b)[1](g) + (dot8(a, b),)
  batched = jax.vmap(f, (0, None, 0))(a, b, g)
  ref = jax.vmap(lambda a, b, g: jax.vjp(lambda x, y: x @ y, a, b)[1](g) + (a @ b,), (0, None, 0))(
      a.astype(F32), b.astype(F32), g.astype(F32))
  for i in range(2):
    one = f(a[i], b, g[i])
    for k, name in enumerate(["d_lhs", "d_rhs", "product"]):
      np.testing.assert_allclose(np.asarray(batched[k][i], F32), np.asarray(one[k], F32),
                                 rtol=2 ** -7, atol=0, err_msg=name)
      assert rel_error(batched[k][i], ref[k][i]) < 0.12, (i, name)


def test_scan_remat_and_jit_match_the_unrolled_loop():
  """The same layers through scan, remat and jit: the same values, to rounding."""
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
  ref = jax.value_and_grad(lambda h, ws: unrolled(h.astype(F32), ws.astype(F32)), (0, 1))
  for fn in (scanned, jax.jit(scanned), jax.checkpoint(unrolled)):
    got = jax.value_and_grad(fn, (0, 1))(h0, ws)
    for x, y, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(ref(h0, ws))):
      # Rounding differences can flip a float8 rounding downstream: a few
      # elements move by a float8 step, the whole by far less than FP8's error.
      assert rel_error(x, y) < 0.05 and rel_error(x, r) < 0.15, (rel_error(x, y), rel_error(x, r))


DIMENSION_NUMBERS = [
    (MATMUL, (8, 16), (16, 4)),
    ((((0,), (1,)), ((), ())), (16, 8), (4, 16)),               # transposed operands
    ((((2,), (1,)), ((0,), (0,))), (3, 8, 16), (3, 16, 4)),     # a batched matmul
    ((((1, 3), (2, 0)), ((2,), (1,))), (5, 6, 3, 4), (4, 3, 6, 2)),  # two contracting dims
]


def _free(ndim, contracting, batch):
  return [d for d in range(ndim) if d not in contracting and d not in batch]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dn,lhs_shape,rhs_shape", DIMENSION_NUMBERS)
def test_any_dimension_numbers_against_a_model(dn, lhs_shape, rhs_shape, scaling, maybe_jit):
  """Product and VJP equal float32 dots of the dequantised values, rounded once, bit for bit.

  Power-of-two scales make every dequantised value exact in float32 and every
  product of float8 values exact, so the model and the FP8 GEMM agree exactly.
  Rowwise, each operand's amax is over its contracting dims in each GEMM; the
  backward GEMMs contract the forward's free dims, so they requantise there.
  """
  recipe = Float8Recipe(power_of_two=True, scaling=scaling)
  rowwise = scaling == "rowwise"
  a, b = normal(0, lhs_shape, 2.0), normal(1, rhs_shape, 1e-2)
  out, vjp = maybe_jit(lambda a, b: jax.vjp(
      functools.partial(dot8, dn=dn, recipe=recipe), a, b))(a, b)
  g = normal(2, out.shape, 50.0)
  (lc, rc), (lb, rb) = dn
  nb, n_lf = len(lb), len(_free(len(lhs_shape), lc, lb))
  g_lfree = range(nb, nb + n_lf)
  g_rfree = range(nb + n_lf, len(out.shape))

  def model(a, b, g):
    q = functools.partial(qdq, recipe=recipe)
    plain = functools.partial(lax.dot_general, dimension_numbers=dn, preferred_element_type=F32)
    want = plain(q(a, E4M3, lc if rowwise else None), q(b, E4M3, rc if rowwise else None))
    # d_a reads g and b, contracting g's rhs-free dims with b's free dims;
    # d_b reads g and a, contracting g's lhs-free dims with a's free dims.
    _, vjp_a = jax.vjp(lambda x: plain(x, q(b, E4M3, _free(b.ndim, rc, rb) if rowwise else None)),
                       q(a, E4M3))
    _, vjp_b = jax.vjp(lambda y: plain(q(a, E4M3, _free(a.ndim, lc, lb) if rowwise else None), y),
                       q(b, E4M3))
    d_a, = vjp_a(q(g, E5M2, g_rfree if rowwise else None))
    d_b, = vjp_b(q(g, E5M2, g_lfree if rowwise else None))
    return want.astype(BF16), (d_a.astype(BF16), d_b.astype(BF16))

  want, want_grads = jax.jit(model)(a, b, g)
  np.testing.assert_array_equal(out, want)
  for got, expected in zip(vjp(g), want_grads):
    np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------- rowwise scaling


@pytest.mark.parametrize("outlier,factor", [(1e4, 1.15), (1e5, 5.0)])
@pytest.mark.parametrize("operand", ["lhs", "rhs"])
def test_rowwise_is_clearly_more_accurate_with_outlier_rows(operand, outlier, factor):
  """One lhs row (or rhs column) much larger than the rest.

  With one scale per tensor the other rows land in e4m3's subnormals (1e4:
  about 1.5x rowwise's error) or below them (1e5: about 13x); rowwise keeps
  every row at e4m3's own precision (measured: 1e4 gives 1.2-1.5x, 1e5 13x).
  """
  a, b = normal(0, (64, 128), 1.0), normal(1, (128, 32), 1.0)
  if operand == "lhs":
    a = a.at[7].multiply(outlier)
  else:
    b = b.at[:, 5].multiply(outlier)
  g = normal(2, (64, 32), 1.0)
  ref, ref_vjp = jax.vjp(lambda a, b: a @ b, a.astype(F32), b.astype(F32))
  errors = {}
  for scaling in ("tensorwise", "rowwise"):
    out, vjp = jax.vjp(functools.partial(dot8, recipe=Float8Recipe(scaling=scaling)), a, b)
    # Away from the outlier: the rows (or columns) that tensorwise scaling starves.
    keep = np.ones(out.shape, bool)
    keep[7 if operand == "lhs" else slice(None), 5 if operand == "rhs" else slice(None)] = False
    errors[scaling] = rel_error(np.asarray(out, F32)[keep], np.asarray(ref)[keep])
    for i, (got, want) in enumerate(zip(vjp(g), ref_vjp(g.astype(F32)))):
      errors[scaling, i] = rel_error(got, want)
  assert errors["rowwise"] < 0.08 and errors["tensorwise"] > factor * errors["rowwise"], errors
  assert all(errors["rowwise", i] < 0.12 for i in range(2)), errors


def test_rowwise_scales_are_per_row_of_lhs_and_per_column_of_rhs():
  a = jnp.stack([jnp.full(16, 1.0), jnp.full(16, 1e-3)]).astype(BF16)
  b = jnp.ones((16, 3), BF16).at[:, 2].set(100.0)
  out = dot8(a, b, recipe=Float8Recipe(scaling="rowwise"))
  np.testing.assert_allclose(np.asarray(out, F32), np.asarray(a, F32) @ np.asarray(b, F32),
                             rtol=2 ** -7)
  _, s = fp8_dot._quantize(a, E4M3, 0, False, (1,))
  assert s.shape == (2, 1) and float(s[0, 0]) == float(np.float32(1 / 448))
  assert float(s[1, 0]) == float(np.float32(1e-3 / 448)) or abs(float(s[1, 0]) * 448e3 - 1) < 2 ** -7


# ------------------------------------------------- the float16 range and derivatives


def test_float16_operand_near_its_max_does_not_overflow():
  """[[65504, 1]] @ [[1e-3], [1]] is 66.5: the scales are float32, the product scaled once."""
  x, w = jnp.array([[65504.0, 1.0]], F16), jnp.array([[1e-3], [1.0]], F16)
  out = dot8(x, w)
  assert out.dtype == F16 and np.isfinite(out).all()
  assert abs(float(out[0, 0]) - 66.5) < 0.05 * 66.5
  grads = jax.grad(lambda x, w: jnp.sum(dot8(x, w).astype(F32)), (0, 1))(x, w)
  assert all(np.isfinite(np.asarray(g, F32)).all() for g in grads)


def test_second_derivatives_are_refused_with_our_message():
  a = normal(0, (4, 8), 1.0)
  first = jax.grad(lambda a: jnp.sum(dot8(a, a.T).astype(F32)))
  assert np.isfinite(np.asarray(first(a), F32)).all()
  with pytest.raises(TypeError, match="second derivatives through an FP8 matmul"):
    jax.grad(lambda a: jnp.sum(first(a).astype(F32)))(a)
  with pytest.raises(TypeError, match="second derivatives through an FP8 matmul"):
    jax.jacrev(first)(a)
  with pytest.raises(TypeError, match="second derivatives through an FP8 matmul"):
    jax.hessian(lambda a: jnp.sum(dot8(a, a.T).astype(F32)))(a)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_is_refused_with_our_message(transform):
  a = normal(0, (4, 8), 1.0, F32)
  f = lambda a: jnp.sum(dot8(a, a.T))
  with pytest.raises(TypeError, match="forward-mode differentiation .* of an FP8 matmul"):
    if transform == "jvp":
      jax.jvp(f, (a,), (a,))
    else:
      getattr(jax, transform)(f)(a)


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
    (dict(power_of_two=1), TypeError, r"power_of_two must be a bool, got 1 of type int"),
    (dict(scaling="blockwise"), ValueError,
     r"scaling must be one of \('tensorwise', 'rowwise'\), got 'blockwise'"),
    (dict(scaling=None), TypeError, r"scaling must be one of .*, got None"),
    (dict(min_size=-16), ValueError, r"min_size must be an int >= 0, got -16"),
    (dict(min_size=16.0), TypeError, r"min_size must be an int >= 0, got 16.0"),
    (dict(keep=3), TypeError, r"a keep rule must be a regex string or a callable .*, got 3"),
    (dict(keep=["ok", None]), TypeError, r"a keep rule must be .*, got None"),
    (dict(keep="Dense_[0"), ValueError, r"keep rule 'Dense_\[0' is not a valid regular expression"),
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
  assert as_recipe(np.True_) == DEFAULT and as_recipe(np.False_) is None
  for bad, kind in [("e4m3", "str"), (1, "int"), (0, "int"), (jnp.float8_e4m3fn, ".*")]:
    with pytest.raises(TypeError, match=f"fp8 must be None, False, True or a Float8Recipe, got .* of type {kind}"):
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
      assert s.dtype == F32 and mantissa == 0.5, (s, mag, fmt)
      q, s2 = quantize(x, fmt, power_of_two=True)
      top = float(jnp.max(jnp.abs(q.astype(F32))))
      fmax = float(jnp.finfo(fmt).max)
      assert s2 == s and fmax / 2 < top <= fmax  # Rounded down by less than 2.
      # Exact scaling: the dequantised values are the float8 values times 2**k.
      np.testing.assert_array_equal(dequantize(q, s), q.astype(F32) * np.float32(s))


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
  with pytest.raises(TypeError, match="x must be floating, got int32"):
    quantize(jnp.ones(3, jnp.int32), E4M3)
  with pytest.raises(ValueError, match="format must be a float8 dtype, got float16; allowed"):
    quantize(x, jnp.float16)
  with pytest.raises(ValueError, match="margin must be an int >= 0, got -2"):
    scale_inv(x, E5M2, margin=-2)
  with pytest.raises(TypeError, match="power_of_two must be a bool, got 'yes' of type str"):
    quantize(x, E5M2, power_of_two="yes")

"""Issue 29 item 2: activations stay in half where torch keeps them in half, and better.

jax.nn activations run in their input's dtype; normalisation layers compute
their statistics in float32 and return the input's half dtype; a bias add after
a half matmul stays half with float32 params; Python-scalar constants never
widen. And where half would overflow or lose a loss, float32 stays.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
TOL = {F16: 2e-3, BF16: 1.6e-2}  # about two roundings of the output
half_dtypes = pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])


def ops_by_dtype(fn, *args):
  """{primitive name: set of its output dtype names} over ``fn``'s jaxpr and sub-jaxprs."""
  found: dict[str, set[str]] = {}
  for eqn in jaxpr_utils.walk(jax.make_jaxpr(fn)(*args).jaxpr):
    for v in eqn.outvars:
      found.setdefault(eqn.primitive.name, set()).add(str(jaxpr_utils.dtype_of(v)))
  return found


def assert_close(actual, expected, tol):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert np.all(np.isfinite(actual))
  np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * np.abs(expected).max())


def normal(seed, shape, scale=1.0):
  return jax.random.normal(jax.random.key(seed), shape) * scale


# --- jax.nn activations -----------------------------------------------------------------------

ACTIVATIONS = {
    "gelu": jax.nn.gelu,  # x * 0.5 * (1 + tanh(c * (x + 0.044715 * x**3))): an integer_pow
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "softplus": jax.nn.softplus,  # log1p(exp(-|x|)) + max(x, 0)
    "elu": jax.nn.elu,  # expm1
    "selu": jax.nn.selu,
    "celu": jax.nn.celu,
    "mish": jax.nn.mish,
    "log_sigmoid": jax.nn.log_sigmoid,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "leaky_relu": jax.nn.leaky_relu,
    "squareplus": jax.nn.squareplus,  # (x + sqrt(x**2 + 4)) / 2
    "standardize": jax.nn.standardize,
}


@half_dtypes
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_jax_nn_activations_return_their_input_dtype(name, dtype, maybe_jit):
  fn = ACTIVATIONS[name]
  x = normal(0, (4, 64), 3.0).astype(dtype)
  out = maybe_jit(jmp.autocast(fn, dtype))(x)
  assert out.dtype == dtype
  assert_close(out, fn(x.astype(F32)), TOL[dtype])  # computed in float32, rounded once


@half_dtypes
def test_gelu_computes_in_float32_and_rounds_once(dtype):
  x = normal(1, (256,), 4.0).astype(dtype)
  run = jmp.autocast(jax.nn.gelu, dtype)
  found = ops_by_dtype(run, x)
  assert found["integer_pow"] == found["tanh"] == found["add"] == found["mul"] == {"float32"}
  narrowing = [e for e in jaxpr_utils.walk(jax.make_jaxpr(run)(x).jaxpr)
               if e.primitive.name == "convert_element_type"
               and np.dtype(e.params["new_dtype"]) == dtype]
  assert len(narrowing) == 1  # one rounding, of the result
  # Traced with half arguments, gelu's constants are half literals: the same in float32.
  ref = jax.jit(jax.nn.gelu)(x).dtype == dtype and jax.nn.gelu(x.astype(F32))
  assert_close(run(x), ref, TOL[dtype])


def test_an_activation_in_float16_keeps_its_large_inputs():
  x = jnp.array([-300.0, -3.0, 0.5, 120.0, 300.0], jnp.float16)  # 300**3 overflows float16
  for fn in (jax.nn.gelu, jax.nn.softplus, jax.nn.mish):
    out = jmp.autocast(fn, jnp.float16)(x)
    assert out.dtype == F16
    np.testing.assert_allclose(np.asarray(out, np.float32), fn(x.astype(F32)), rtol=1e-3)
    grad = jax.grad(lambda v: jnp.sum(jmp.autocast(fn, jnp.float16)(v).astype(F32)))(x)
    assert np.all(np.isfinite(np.asarray(grad, np.float32))), fn


# --- Normalisation layers ----------------------------------------------------------------------


def linen(module, x):
  """``apply(params, rest, x)``, the params and the rest (BatchNorm statistics, not cast)."""
  variables = module.init(jax.random.key(0), x.astype(F32))
  params, stats = variables["params"], variables.get("batch_stats")
  if stats is None:
    return (lambda p, rest, inp: module.apply({"params": p}, inp)), params, None
  return (lambda p, rest, inp: module.apply({"params": p, "batch_stats": rest}, inp,
                                            mutable=["batch_stats"])[0]), params, stats


def nnx_apply(layer, x):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  return (lambda p, r, inp: nnx.merge(graphdef, p, r)(inp)), params, rest


def eqx_apply(layer, x):
  return (lambda m, rest, inp: jax.vmap(m)(inp)), layer, None


NORMS = {
    "linen_layernorm": lambda x: linen(nn.LayerNorm(), x),
    "linen_groupnorm": lambda x: linen(nn.GroupNorm(num_groups=4), x),
    "linen_rmsnorm": lambda x: linen(nn.RMSNorm(), x),
    "linen_batchnorm": lambda x: linen(nn.BatchNorm(use_running_average=False), x),
    "nnx_layernorm": lambda x: nnx_apply(nnx.LayerNorm(16, rngs=nnx.Rngs(0)), x),
    "nnx_rmsnorm": lambda x: nnx_apply(nnx.RMSNorm(16, rngs=nnx.Rngs(0)), x),
    "nnx_groupnorm": lambda x: nnx_apply(nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0)), x),
    "nnx_batchnorm": lambda x: nnx_apply(nnx.BatchNorm(16, rngs=nnx.Rngs(0)), x),
    "eqx_layernorm": lambda x: eqx_apply(eqx.nn.LayerNorm(16), x),
    "eqx_rmsnorm": lambda x: eqx_apply(eqx.nn.RMSNorm(16), x),
    "eqx_groupnorm": lambda x: eqx_apply(eqx.nn.GroupNorm(4, 16, channelwise_affine=True), x),
}


@half_dtypes
@pytest.mark.parametrize("name", list(NORMS))
def test_normalisation_layers_return_the_input_dtype_with_float32_statistics(name, dtype):
  x = (normal(2, (8, 16), 2.0) + 3.0).astype(dtype)  # a mean of 3: x - mean must be exact
  apply, params, rest = NORMS[name](x)
  half_params = jmp.Policy(F32, dtype, F32).cast_to_compute(params)  # as the train step does
  run = jmp.autocast(apply, dtype)
  out = jax.jit(run)(half_params, rest, x)
  assert out.dtype == dtype
  assert_close(out, jax.jit(apply)(params, rest, x.astype(F32)), 2 * TOL[dtype])
  found = ops_by_dtype(run, half_params, rest, x)
  assert found["reduce_sum"] == {"float32"}  # the statistics


@half_dtypes
def test_batchnorm_relu_and_pooling_stay_half_up_to_the_next_conv(dtype):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (3, 3))(x)
      h = nn.relu(nn.BatchNorm(use_running_average=False)(h))
      h = nn.max_pool(h, (2, 2), (2, 2))
      return nn.Conv(4, (3, 3))(h)

  x = normal(3, (4, 8, 8, 3))
  apply, params, stats = linen(Block(), x)
  run = jmp.autocast(lambda p, v: apply(p, stats, v), dtype)  # float32 params, as in the docs
  found = ops_by_dtype(run, params, x)
  assert found["reduce_window_max"] == {dtype.name}
  assert found["conv_general_dilated"] == {dtype.name}
  relus = {str(jaxpr_utils.dtype_of(e.outvars[0]))
           for e in jaxpr_utils.walk(jax.make_jaxpr(run)(params, x).jaxpr)
           if e.primitive.name == "jit" and e.params["name"] == "relu"}
  assert relus == {dtype.name}
  assert_close(run(params, x), apply(params, stats, x), 8 * TOL[dtype])


# --- Bias adds with float32 params ------------------------------------------------------------


@half_dtypes
def test_a_bias_add_after_a_half_matmul_stays_half_with_float32_params(dtype, maybe_jit):
  x = normal(4, (6, 8))
  dense = nn.Dense(5)
  variables = dense.init(jax.random.key(1), x)
  linear = nnx.Linear(8, 5, rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(linear)
  eqx_linear = eqx.nn.Linear(8, 5, key=jax.random.key(2))
  cases = [(dense.apply, variables), (lambda s, v: nnx.merge(graphdef, s)(v), state),
           (lambda m, v: jax.vmap(m)(v), eqx_linear)]
  for apply, params in cases:
    out = maybe_jit(jmp.autocast(apply, dtype))(params, x)
    assert out.dtype == dtype
    assert_close(out, apply(params, x), 4 * TOL[dtype])


# --- Constants ---------------------------------------------------------------------------------

SCALAR_OPS = {
    "where": lambda h: jnp.where(h > 0, h, 0.0),
    "clip": lambda h: jnp.clip(h, -1.0, 1.0),
    "pad": lambda h: jnp.pad(h, 1),
    "tril": jnp.tril,
    "nan_to_num": jnp.nan_to_num,
    "div_sqrt": lambda h: h / jnp.sqrt(8),
    "mul_scalar": lambda h: h * 0.125,
}


@half_dtypes
@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_python_scalar_constants_never_widen(name, dtype, maybe_jit):
  # A float32 program (float32 params): the matmul is half, the scalars are float32 literals.
  fn = lambda w, x: SCALAR_OPS[name](x @ w)
  w, x = normal(5, (8, 8)), normal(6, (4, 8))
  out = maybe_jit(jmp.autocast(fn, dtype))(w, x)
  assert out.dtype == dtype
  assert_close(out, fn(w, x), 4 * TOL[dtype])


def test_nan_to_num_and_masks_saturate_at_the_half_dtypes_largest_value():
  # A float32 program (float32 params): jnp's sentinels are float32's largest values.
  one, x = jnp.ones((1, 1)), jnp.array([[1.0], [1e5], [-1e5], [jnp.nan]])
  out = jmp.autocast(lambda w, v: jnp.nan_to_num(v @ w), jnp.float16)(one, x)  # f16: +-inf
  assert out.dtype == F16 and out.ravel().tolist() == [1.0, 65504.0, -65504.0, 0.0]
  eye = jnp.eye(4)
  # A fully masked row with float32's smallest value: finite, uniform, as in float32.
  scores = normal(7, (2, 4))
  mask = jnp.array([[True, True, False, False], [False] * 4])
  masked = lambda w, s: jax.nn.softmax(jnp.where(mask, s @ w, jnp.finfo(F32).min), axis=-1)
  probs = jmp.autocast(masked, jnp.float16)(eye, scores)
  assert np.all(np.isfinite(np.asarray(probs, np.float32)))
  np.testing.assert_allclose(np.asarray(probs, np.float32), masked(eye, scores), atol=2e-3)


# --- Where half is not safe, float32 stays -----------------------------------------------------


def test_float32_stays_where_half_would_overflow_or_lose_the_loss():
  x = jnp.full((4, 8), 12.0, jnp.float16)
  t = jnp.ones((4, 8), jnp.float16)
  cases = {
      "t * exp(x), another activation's exp": (lambda t, x: t * jnp.exp(x), F32),
      "x * sum(exp(x)), a raw total": (lambda t, x: x * jnp.sum(jnp.exp(x)), F32),
      "exp(x) alone": (lambda t, x: jnp.exp(x), F32),
      "x.astype(float32) * 1e5, a constant float16 cannot hold": (
          lambda t, x: x.astype(F32) * 1e5, F32),
      "x - logsumexp(x), a normalised statistic": (
          lambda t, x: x - jax.nn.logsumexp(x, -1, keepdims=True), F16),
  }
  for name, (fn, want) in cases.items():
    out = jmp.autocast(fn, jnp.float16)(t, x)
    assert out.dtype == want, name
    assert_close(out, fn(t.astype(F32), x.astype(F32)), 1e-3)
  # A per-example loss (a statistic against the label's logit) and float32 targets.
  logits, labels = normal(8, (16, 10), 4.0).astype(jnp.float16), jnp.arange(16) % 10
  per_example = jmp.autocast(optax.softmax_cross_entropy_with_integer_labels, jnp.float16)
  assert per_example(logits, labels).dtype == F32
  targets = jnp.full((16,), 1e5, F32)  # beyond float16's range
  mse = jmp.autocast(lambda p, y: (p[:, 0] - y) ** 2, jnp.float16)(logits, targets)
  assert mse.dtype == F32 and np.all(np.isfinite(mse))

"""autocast(fn, dtype, fp8=...): FP8 matmuls for any function, and make_train_step(fp8=...).

XLA:CPU emulates the float8 dots (values rounded to float8, the dot in the
half dtype), so the numbers are those of an FP8 GEMM up to accumulation order.
Relative errors are Frobenius norms against float32, in float64.
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
from sklearn.datasets import load_digits

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils
from jmp_lite._src.diagnostics import precision_report as report_lib

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FWD_TOL, GRAD_TOL = 0.06, 0.09  # Per-tensor current scaling gives about 4% and 6%.
# Errors add up through a stack of FP8 layers: three layers give about 7%
# forward, and the first layer's weight gradient, after three quantised
# cotangents, about 11% (bf16 autocast: 0.6%).
DEEP_FWD_TOL, DEEP_GRAD_TOL = 0.1, 0.15


def key(i):
  return jax.random.key(i)


# Every matmul in FP8, toy shapes included: the default min_size keeps GEMMs under 4096 in half.
FP8 = jmp.Float8Recipe(min_size=0)


def normal(seed, shape, scale=1.0):
  return jax.random.normal(key(seed), shape) * scale


def rel_error(actual, expected):
  a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def tree_rel_error(actual, expected):
  return max(rel_error(a, e) for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))


def matmul_dtypes(fn, *args):
  """The dtype names of every dot_general in ``fn``'s jaxpr (sub-jaxprs included)."""
  found = []

  def walk(jaxpr):
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(report_lib.matmul_dtype(eqn, producers))
      for sub in jaxpr_utils.subjaxprs(eqn):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def mlp(params, x):
  h = jax.nn.gelu(x @ params["w1"])
  return h @ params["w2"]


def mlp_params(scale=1.0):
  return {"w1": normal(1, (32, 64), scale), "w2": normal(2, (64, 16), scale)}


# --- The jaxpr ----------------------------------------------------------------------------


def test_forward_operands_are_e4m3_and_backward_cotangents_e5m2():
  params, x = mlp_params(0.2), normal(3, (8, 32))
  fn = jmp.autocast(mlp, jnp.bfloat16, fp8=FP8)
  assert matmul_dtypes(fn, params, x) == [E4M3, E4M3]
  loss = lambda p, v: jnp.sum(fn(p, v).astype(F32) ** 2)
  grads = matmul_dtypes(jax.grad(loss), params, x)
  # Two forward GEMMs, then two per matmul backward, each on an e5m2 cotangent.
  assert sorted(grads) == sorted([E4M3] * 2 + [f"{E4M3}+{E5M2}"] * 4)
  recipe = jmp.Float8Recipe(min_size=0, forward=jnp.float8_e5m2, backward=jnp.float8_e4m3fn)
  swapped = jmp.autocast(mlp, jnp.float16, fp8=recipe)
  assert matmul_dtypes(swapped, params, x) == [E5M2, E5M2]
  assert jmp.autocast(mlp, jnp.bfloat16)(params, x).dtype == BF16
  assert matmul_dtypes(jmp.autocast(mlp, jnp.bfloat16, fp8=False), params, x) == ["bfloat16"] * 2


def test_precision_report_counts_fp8_matmuls_forward_and_backward():
  params, x = mlp_params(0.2), normal(3, (8, 32))
  fn = jmp.autocast(mlp, jnp.bfloat16, fp8=FP8)
  report = jmp.precision_report(fn, params, x)
  assert report.count("matmul") == report.count("matmul", E4M3) == 2
  grad = jax.value_and_grad(lambda p, v: jnp.sum(fn(p, v).astype(F32)))
  report = jmp.precision_report(grad, params, x)
  # dgrad and wgrad of the second matmul, wgrad of the first: the custom VJP also
  # computes the first one's dgrad (of x, which nothing differentiates), which XLA
  # drops and the report does not count (as it drops the second forward matmul of
  # jax.grad, which does not return the loss).
  assert report.count("matmul", E4M3) == 2 and report.count("matmul", f"{E4M3}+{E5M2}") == 3
  assert report.count("matmul") == 5


def test_lint_flags_fp8_gemm_dims_not_a_multiple_of_16():
  params = {"w1": normal(1, (32, 24)), "w2": normal(2, (24, 16))}  # 24: a multiple of 8 only
  fn = jmp.autocast(mlp, jnp.bfloat16, fp8=FP8)
  findings = jmp.precision_lint(fn, params, normal(3, (8, 32)), policy="mixed_bfloat16")
  messages = [f.reason for f in findings if f.op == "dot_general"]
  assert messages == [
      "output features 24 not a multiple of 16 in an FP8 matmul (float8_e4m3fn): cuBLASLt's "
      "FP8 GEMMs need multiples of 16 (pad the layer)",
      "contracting size 24 not a multiple of 16 in an FP8 matmul (float8_e4m3fn): cuBLASLt's "
      "FP8 GEMMs need multiples of 16 (pad the layer)"]
  plain = jmp.autocast(mlp, jnp.bfloat16)  # bf16 GEMMs: 24 is a multiple of 8
  assert not jmp.precision_lint(plain, params, normal(3, (8, 32)), policy="mixed_bfloat16")


# --- Numerics against float32 ---------------------------------------------------------------


def matmul_loss(a, b, r):
  return jnp.sum((a @ b).astype(F32) * r)


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e3])
def test_product_and_gradients_match_float32_at_any_magnitude(magnitude):
  a, b = normal(4, (64, 128), magnitude), normal(5, (128, 32), magnitude)
  r = normal(6, (64, 32))
  out = jax.jit(jmp.autocast(lambda u, v: u @ v, jnp.bfloat16, fp8=FP8))(a, b)
  assert out.dtype == BF16
  assert rel_error(out, a @ b) < FWD_TOL
  grads = jax.jit(jax.grad(jmp.autocast(matmul_loss, jnp.bfloat16, fp8=FP8), (0, 1)))(a, b, r)
  assert [g.dtype for g in grads] == [F32, F32]
  assert tree_rel_error(grads, jax.grad(matmul_loss, (0, 1))(a, b, r)) < GRAD_TOL
  # A plain cast to e4m3 flushes 1e-6 to zero and overflows past 448.
  plain = a.astype(jnp.float8_e4m3fn).astype(F32) @ b.astype(jnp.float8_e4m3fn).astype(F32)
  assert magnitude == 1.0 or not rel_error(plain, a @ b) < FWD_TOL


def test_float16_product_and_gradients():
  a, b, r = normal(4, (64, 128)), normal(5, (128, 32)), normal(6, (64, 32))
  out = jax.jit(jmp.autocast(lambda u, v: u @ v, jnp.float16, fp8=FP8))(a, b)
  assert out.dtype == F16 and rel_error(out, a @ b) < FWD_TOL
  grads = jax.jit(jax.grad(jmp.autocast(matmul_loss, jnp.float16, fp8=FP8), (0, 1)))(a, b, r)
  assert tree_rel_error(grads, jax.grad(matmul_loss, (0, 1))(a, b, r)) < GRAD_TOL


def test_zeros_give_zeros_and_inf_gives_non_finite():
  fn = jax.jit(jmp.autocast(lambda u, v: u @ v, jnp.bfloat16, fp8=FP8))
  a, b = normal(4, (16, 32)), normal(5, (32, 16))
  zeros = fn(jnp.zeros_like(a), b)
  np.testing.assert_array_equal(zeros, np.zeros((16, 16)))
  grad = jax.jit(jax.grad(jmp.autocast(matmul_loss, jnp.bfloat16, fp8=FP8), (0, 1)))
  grads = grad(jnp.zeros_like(a), b, normal(6, (16, 16)))
  assert np.all(np.isfinite(grads[0])) and np.all(np.asarray(grads[1]) == 0)
  out = fn(a.at[3, 7].set(jnp.inf), b)
  assert not np.any(np.isfinite(np.asarray(out, F32)))  # never clipped to a finite number
  _, g = grad(a, b, normal(6, (16, 16)).at[0, 0].set(jnp.nan))
  assert not np.any(np.isfinite(g))


# --- Composition ------------------------------------------------------------------------------


def layers(ws, x):
  """A scan over layers, each one rematerialised."""
  body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
  return jax.lax.scan(body, x, ws)[0]


def test_jit_grad_vmap_scan_remat():
  ws, x = normal(7, (3, 32, 32), 0.2), normal(8, (4, 16, 32))
  fn = jmp.autocast(layers, jnp.bfloat16, fp8=FP8)
  assert matmul_dtypes(fn, ws, x[0]) == [E4M3]  # the scan body's one matmul
  batched = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(ws, x)  # one scale per example
  assert batched.dtype == F32  # the carry takes its widest dtype, x's
  assert rel_error(batched, jax.vmap(layers, in_axes=(None, 0))(ws, x)) < DEEP_FWD_TOL
  loss = lambda w, v: jnp.sum(jax.vmap(fn, in_axes=(None, 0))(w, v).astype(F32) ** 2)
  ref = lambda w, v: jnp.sum(jax.vmap(layers, in_axes=(None, 0))(w, v) ** 2)
  grads = jax.jit(jax.grad(loss))(ws, x)
  assert grads.dtype == F32 and rel_error(grads, jax.grad(ref)(ws, x)) < DEEP_GRAD_TOL
  np.testing.assert_array_equal(jax.jit(fn)(ws, x[0]), fn(ws, x[0]))  # eager == jit


# --- Flax, NNX and Equinox models, unchanged ----------------------------------------------------


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(16, (3, 3))(x)).reshape(x.shape[0], -1)
    return nn.Dense(16)(nn.relu(nn.Dense(64)(h)))


def test_flax_linen_model_unchanged():
  model, x = LinenNet(), normal(9, (4, 6, 6, 3))
  variables = model.init(key(10), x)
  apply = jmp.autocast(model.apply, jnp.bfloat16, fp8=FP8)
  report = jmp.precision_report(apply, variables, x)
  assert report.count("matmul", E4M3) == report.count("matmul") == 2
  assert report.count("conv", "bfloat16") == 1  # convolutions follow the half list
  out = jax.jit(apply)(variables, x)  # float32 params: the bias add stays bf16 (issue 29)
  assert out.dtype == jnp.bfloat16 and rel_error(out, model.apply(variables, x)) < FWD_TOL


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(32, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def test_flax_nnx_model_unchanged():
  model, x = NNXNet(nnx.Rngs(0)), normal(11, (8, 32))
  out = nnx.jit(jmp.autocast(lambda m, v: m(v), jnp.bfloat16, fp8=FP8))(model, x)
  assert rel_error(out, model(x)) < FWD_TOL
  graphdef, state = nnx.split(model)
  functional = jmp.autocast(lambda s, v: nnx.merge(graphdef, s)(v), jnp.bfloat16, fp8=FP8)
  assert matmul_dtypes(functional, state, x) == [E4M3, E4M3]


def test_equinox_mlp_unchanged():
  model = eqx.nn.MLP(32, 16, 64, 2, activation=jax.nn.gelu, key=key(12))
  x = normal(13, (8, 32))
  run = jmp.autocast(lambda m, v: jax.vmap(m)(v), jnp.bfloat16, fp8=FP8)
  out = eqx.filter_jit(run)(model, x)
  assert rel_error(out, jax.vmap(model)(x)) < FWD_TOL
  loss = lambda m: jnp.sum(run(m, x) ** 2)
  grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
  ref = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2)))(model)
  assert tree_rel_error(grads, ref) < DEEP_GRAD_TOL


# --- The train step ---------------------------------------------------------------------------


def classifier_loss(params, batch):
  logits = mlp(params, batch["x"]).astype(F32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_train_step_with_fp8_trains_and_compiles_once(policy):
  x = normal(14, (64, 32))
  batch = {"x": x, "y": jnp.argmax(x @ normal(15, (32, 16)), axis=1)}
  traces = []

  def loss_fn(p, b):
    traces.append(1)
    return classifier_loss(p, b)

  tx = optax.adam(1e-2)
  if policy == "mixed_float16":
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**12)
  state = jmp.TrainState.create(params=mlp_params(0.2), tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy(policy), autocast=True, fp8=FP8)
  losses = []
  for _ in range(20):
    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"])
    losses.append(float(metrics["loss"]))
  assert len(traces) == 1  # the second call did not retrace
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {F32}


def test_train_step_skips_a_non_finite_fp8_step():
  x = normal(14, (64, 32))
  batch = {"x": x, "y": jnp.argmax(x @ normal(15, (32, 16)), axis=1)}
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**12)
  state = jmp.TrainState.create(params=mlp_params(0.2), tx=tx)
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0, margin=1), donate=False)
  bad = {**batch, "x": x.at[0, 0].set(jnp.inf)}
  new, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])
  np.testing.assert_array_equal(new.params["w1"], state.params["w1"])
  assert float(jmp.loss_scale_of(new.opt_state)) == 2.0**11


# --- Bad input ---------------------------------------------------------------------------------


def test_bad_input_names_the_value():
  with pytest.raises(ValueError, match="float16 or jnp.bfloat16, got <class 'jax.numpy.float32'>"):
    jmp.autocast(mlp, jnp.float32, fp8=True)
  with pytest.raises(TypeError, match="fp8 must be None, False, True or a Float8Recipe, got 'e4m3'"):
    jmp.autocast(mlp, jnp.bfloat16, fp8="e4m3")
  with pytest.raises(TypeError, match="got 1"):
    jmp.autocast(mlp, jnp.bfloat16, fp8=1)
  with pytest.raises(ValueError, match="forward must be a float8 dtype, got bfloat16"):
    jmp.Float8Recipe(forward=jnp.bfloat16)
  with pytest.raises(TypeError, match="backward must be a float8 dtype, got 'banana'"):
    jmp.Float8Recipe(backward="banana")
  policy = jmp.get_policy("mixed_bfloat16")
  with pytest.raises(ValueError, match="fp8=True needs autocast=True"):
    jmp.make_train_step(classifier_loss, policy, fp8=True)
  with pytest.raises(TypeError, match="fp8 must be None, False, True or a Float8Recipe, got 'yes'"):
    jmp.make_train_step(classifier_loss, policy, autocast=True, fp8="yes")
  with pytest.raises(ValueError, match="float16 or jnp.bfloat16, got dtype\\('float32'\\)"):
    jmp.make_train_step(classifier_loss, jmp.get_policy("f32"), autocast=True, fp8=True)


# --- Digits: FP8 reaches the bf16 run's accuracy ---------------------------------------------------


def train_digits(fp8):
  digits = load_digits()
  x = jnp.asarray(digits.data / 16.0, F32)
  y = jnp.asarray(digits.target, jnp.int32)
  perm = np.random.default_rng(0).permutation(len(x))
  train_idx, test_idx = perm[:1400], perm[1400:]
  params = {"w1": normal(16, (64, 128), 64**-0.5), "w2": normal(17, (128, 16), 128**-0.5)}
  state = jmp.TrainState.create(params=params, tx=optax.adam(3e-3))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=fp8)
  rng = np.random.default_rng(1)
  for _ in range(200):
    idx = rng.choice(train_idx, 128, replace=False)
    state, _ = step(state, {"x": x[idx], "y": y[idx]})
  logits = jmp.autocast(mlp, jnp.bfloat16, fp8=fp8)(state.params, x[test_idx])
  return 100 * float(jnp.mean(jnp.argmax(logits, axis=1) == y[test_idx]))


def test_digits_fp8_reaches_bf16_accuracy():
  bf16, fp8 = train_digits(False), train_digits(FP8)
  assert bf16 > 95
  assert fp8 > bf16 - 1.5, (fp8, bf16)

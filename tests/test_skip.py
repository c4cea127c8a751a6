"""The skip (jmp_lite/_src/scaling/skip.py): one decision, one fused reduction, exact pass-through."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from jmp_lite._src.scaling import skip
from conftest import assert_bitwise_equal


def _leaf_params(n, size=16):
  return {f"l{i:03d}": jax.random.normal(jax.random.key(i), (size,)) * 0.1 for i in range(n)}


def _leaf_loss(params, batch):
  return sum(jnp.mean(jnp.tanh(p * batch["x"])) for p in params.values()).astype(jnp.float32)


def _no_scaling_step(tx):
  """The hand-written f16 step without loss scaling or a skip: the baseline."""

  def step(state, batch):
    params, opt_state = state
    x = batch["x"].astype(jnp.float16)
    loss, grads = jax.value_and_grad(
        lambda p: _leaf_loss(jax.tree.map(lambda v: v.astype(jnp.float16), p), {"x": x}))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, donate_argnums=0)


def _reductions(hlo_text):
  return len(re.findall(r" reduce\(", hlo_text))


@pytest.mark.parametrize("leaves", [8, 32])
def test_compiled_step_has_one_reduction_for_the_skip_whatever_the_leaf_count(leaves):
  # Issue 13: the decision used to cost one reduction (and one -0.0 broadcast
  # for the skipped updates) per leaf. Now it is one reduction over all small
  # leaves, and a skipped step passes params and state through untouched.
  params, batch, tx = _leaf_params(leaves), {"x": jnp.linspace(-1, 1, 16)}, optax.adam(1e-3)
  base = _no_scaling_step(tx).lower((params, tx.init(params)), batch).compile().as_text()
  state = jmp.TrainState.create(params=params, tx=jmp.dynamic_loss_scaling(tx))
  step = jmp.make_train_step(_leaf_loss, jmp.get_policy("mixed_float16"))
  ours = step.lower(state, batch).compile().as_text()
  assert _reductions(base) == leaves  # The loss's own means.
  assert _reductions(ours) == _reductions(base) + 1
  assert "constant(-0)" not in ours


def test_fused_and_per_leaf_sums_agree():
  small = {"a": jnp.arange(5.0), "b": jnp.full((3, 4), -2.0, jnp.bfloat16)}
  large = {"c": jnp.ones(skip.FUSE_MAX_ELEMENTS + 1, jnp.float16)}
  grads = {**small, **large}
  inv = jnp.float32(0.5)
  expected = sum(float(jnp.sum(jnp.square(g.astype(jnp.float32) * 0.5)))
                 for g in jax.tree.leaves(grads))
  for fn in (skip.unscaled_sumsq, jax.jit(skip.unscaled_sumsq)):
    total = fn(grads, inv)
    assert total.dtype == jnp.float32
    assert float(total) == pytest.approx(expected, rel=1e-6)
  assert float(skip.unscaled_sumsq({}, inv)) == 0.0


def test_sums_widen_to_float64_params():
  with jax.enable_x64(True):
    grads = {"w": jnp.array([3e-30], jnp.float32)}
    params = {"w": jnp.zeros(1, jnp.float64)}
    # 9e-60 underflows float32 but not float64.
    assert float(skip.unscaled_sumsq(grads, None)) == 0.0
    total = skip.unscaled_sumsq(grads, None, params)
    assert total.dtype == jnp.float64 and float(total) == pytest.approx(9e-60)
    assert skip.unscale(grads, jnp.float32(2.0), params)["w"].dtype == jnp.float64


@pytest.fixture(params=["cpu", "gpu"])
def skip_form(request, monkeypatch):
  """The skip as XLA:CPU runs it (``lax.cond``), and as XLA:GPU does (a select), here on the CPU."""
  if request.param == "gpu":
    monkeypatch.setattr(jax.lax, "platform_dependent",
                        lambda *args, cpu, default: default(*args))
  return request.param


@pytest.mark.parametrize("apply", [False, True])
@pytest.mark.parametrize("bad", [None, "grad", "value"])
def test_guarded_update_applies_or_passes_through(apply, bad, skip_form):
  params = {"w": jnp.array([1.0, -0.0, 2.0])}
  tx = optax.adam(0.1)
  state = tx.init(params)
  grads = {"w": jnp.array([4.0, 8.0, -4.0], jnp.float16)}
  value = jnp.float32(1.0)
  if bad == "grad":
    grads = {"w": grads["w"].at[1].set(jnp.inf)}
  elif bad == "value":
    value = jnp.float32(jnp.nan)
  guard = jax.jit(lambda g, s, p, v: skip.guarded_update(
      tx.update, g, s, p, inv_scale=jnp.float32(0.25), value=v, apply=apply))(
          grads, state, params, value)
  new_params = guard.params if apply else optax.apply_updates(params, guard.updates)
  assert bool(guard.finite) is (bad is None)
  if bad is None:
    updates, _ = tx.update({"w": grads["w"].astype(jnp.float32) * 0.25}, state, params)
    # Compiled as another program, XLA may fuse differently: the last bit may differ.
    np.testing.assert_allclose(new_params["w"], optax.apply_updates(params, updates)["w"],
                               rtol=1e-6)
    assert float(guard.sumsq) == pytest.approx(1.0 + 4.0 + 1.0)
  else:
    # Bit for bit: -0.0 stays -0.0, and Adam's state does not move.
    assert_bitwise_equal(new_params["w"], params["w"])
    assert_bitwise_equal(guard.state, state)


def _leaf_sized_multiplies(fn, *args):
  """Multiplications in ``fn``'s jaxpr whose output is not a scalar."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [e for e in jaxpr.eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape != ()]


def test_float16_gradients_are_unscaled_after_the_sum():
  # Issue 13 (memory): multiplying every element by 1/scale before squaring made
  # XLA:CPU write an unscaled float32 copy of each large float16 gradient (4 MiB
  # per 1024x1024 kernel, MLP temp 27.6 MiB against 22.5 without scaling). float16
  # squares cannot overflow a float32 sum, so the scale now multiplies the sum.
  inv = jnp.float32(2.0**-15)
  f16 = {"w": jnp.ones((64, 64), jnp.float16), "b": jnp.ones(8, jnp.float16)}
  assert _leaf_sized_multiplies(skip.unscaled_sumsq, f16, inv) == []
  # bfloat16 and float32 squares can overflow before unscaling: they keep the
  # per-element unscale (one multiply over the concatenated small leaves).
  for dtype in (jnp.bfloat16, jnp.float32):
    wide = jax.tree.map(lambda g: g.astype(dtype), f16)
    assert len(_leaf_sized_multiplies(skip.unscaled_sumsq, wide, inv)) == 1


@pytest.mark.parametrize("scale", [2.0**15, 3.0, 2.0**70])
def test_float16_sum_after_unscaling_matches_a_float64_reference(scale):
  g = jax.random.normal(jax.random.key(0), (300, 70)) * 300.0  # Up to ~1e3 in float16.
  grads = {"big": g.astype(jnp.float16), "small": (g[:3, :5] * 1e-3).astype(jnp.float16)}
  inv = jnp.float32(1.0 / scale)
  expected = sum(float(np.sum((np.asarray(v, np.float64) * np.float64(inv)) ** 2))
                 for v in grads.values())
  for fn in (skip.unscaled_sumsq, jax.jit(skip.unscaled_sumsq)):
    assert float(fn(grads, inv)) == pytest.approx(expected, rel=1e-5)
  # The largest float16 squares still sum finitely; a non-finite leaf is still caught.
  top = {"w": jnp.full((1024, 1024), 65504.0, jnp.float16)}
  assert np.isfinite(float(skip.unscaled_sumsq(top, inv)))
  for bad in (jnp.inf, jnp.nan):
    poisoned = {**grads, "big": grads["big"].at[7, 3].set(bad)}
    assert not np.isfinite(float(skip.unscaled_sumsq(poisoned, inv)))


@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_the_select_skip_is_bit_exact_too(bad, skip_form):
  """A train step with the GPU's select skip: applied as the cond's, skipped bit for bit."""
  def loss_fn(params, model_state, batch):
    h = jnp.tanh(batch["x"] @ params["w"]) * batch["poison"]
    return jnp.mean(h ** 2), {"count": model_state["count"] + 1, "avg": model_state["avg"] * 0.5}
  params = {"w": jnp.array([[1.0, -0.0], [0.5, 2.0]]), "b": jnp.array([-0.0, 3.0])}
  model_state = {"count": jnp.int32(0), "avg": jnp.array([1.0, -0.0])}
  poison = {None: 1.0, "nan": jnp.nan, "inf": jnp.inf}[bad]
  batch = {"x": jnp.ones((4, 2)), "poison": jnp.float32(poison)}
  tx = jmp.dynamic_loss_scaling(optax.adam(0.1), init_scale=4.0)
  state = jmp.TrainState.create(params=params, tx=tx, model_state=model_state)
  before = jax.device_get((state.params, state.opt_state.inner_state, state.model_state))
  new, metrics = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), donate=False)(
      state, batch)
  assert bool(metrics["grads_finite"]) is (bad is None)
  after = (new.params, new.opt_state.inner_state, new.model_state)
  if bad is None:
    assert int(new.model_state["count"]) == 1 and float(new.params["w"][0, 0]) != 1.0
  else:
    assert_bitwise_equal(after, before)
    assert float(jmp.loss_scale_of(new.opt_state)) == 2.0

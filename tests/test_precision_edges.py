"""Precision edge cases (issue 7).

What these tests establish (and the README's Guarantees section repeats):

* An ``init_scale`` above float16's max (65504) is fine: the scale is float32,
  the loss is scaled in float32, and a float16 gradient that overflows just
  makes the step skip and the scale back off.
* ``loss_fn`` may return a bf16 (or f16) loss; it is cast to float32 first.
* ``TrainState.create`` upcasts bf16/f16/float8 params to float32 masters.
  Building ``TrainState(...)`` directly with bf16 params bypasses that, and the
  step refuses it: the first call raises a ``TypeError`` at trace time that
  names the leaf and points to ``TrainState.create``, with a loss-scaling
  ``tx`` and with a plain optax one alike. There is no silent bf16 training
  without a float32 master.
* With ``jax_enable_x64`` on, float64 params stay float64 masters, the scale
  stays float32 and the step traces once.
* float8 leaves are floating leaves: they are cast like any other. A float8
  compute dtype works; an overflow in a float8 cast is non-finite (NaN for
  ``float8_e4m3fn``, which has no inf; inf for ``float8_e5m2``), so the
  loss-scaling skip catches it and the scale settles inside float8's range.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import Traces
from conftest import regression_loss
from conftest import regression_params


def make_params(dtype=jnp.float32):
  params = regression_params(6, 4, 16, 1, w1_std=0.5, b1=0.05, w2_std=0.2)
  return jax.tree.map(lambda x: x.astype(dtype), params)


def make_batch():
  x = jax.random.normal(jax.random.key(7), (32, 4))
  return {"x": x, "y": jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]}


def train(step, state, n):
  losses = []
  for _ in range(n):
    state, metrics = step(state, make_batch())
    losses.append(float(metrics["loss"]))
  return state, losses


# ------------------------------------------------------- f16 and big scales


def test_f16_with_init_scale_above_f16_max():
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**17)
  state = jmp.TrainState.create(params=make_params(), tx=tx)
  scale = jmp.loss_scale_of(state.opt_state)
  assert scale.dtype == jnp.float32 and float(scale) == 2.0**17  # not inf
  step = jmp.make_train_step(regression_loss, jmp.get_policy("mixed_float16"), donate=False)
  scales, losses = [], []
  for _ in range(40):
    state, metrics = step(state, make_batch())
    scales.append(float(metrics["loss_scale"]))
    losses.append(float(metrics["loss"]))
    assert metrics["loss_scale"].dtype == jnp.float32
    assert bool(jmp.all_finite(state.params))
  assert scales[0] == 2.0**17
  assert all(np.isfinite(scales)) and max(scales) <= 2.0**17
  # At most a couple of backoffs to reach a scale that f16 gradients fit in.
  assert int(jmp.skipped_steps_of(state.opt_state)) <= 3
  assert losses[-1] < 0.5 * losses[0]


def test_jmp_loss_scales_keep_a_big_scale_out_of_f16():
  ls = jmp.DynamicLossScale(jnp.float32(2.0**17))
  scaled = ls.scale({"g": jnp.ones(2, jnp.float16)})["g"]
  assert scaled.dtype == jnp.float32 and (np.asarray(scaled) == 2.0**17).all()
  # A float16 scale at the top of f16's range never grows to inf (jmp issue #47).
  ls16 = jmp.DynamicLossScale(jnp.float16(2.0**15), period=1)
  for _ in range(3):
    ls16 = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls16)
    assert ls16.loss_scale.dtype == jnp.float16 and float(ls16.loss_scale) == 2.0**15


# ------------------------------------------------------------ low-precision losses


@pytest.mark.parametrize("loss_dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_loss(loss_dtype):
  def loss_fn(params, batch):
    return regression_loss(params, batch).astype(loss_dtype)

  policy = jmp.get_policy("mixed_bfloat16" if loss_dtype == jnp.bfloat16 else "mixed_float16")
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8)
  state = jmp.TrainState.create(params=make_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, policy, donate=False)
  state, metrics = step(state, make_batch())
  assert metrics["loss"].dtype == jnp.float32
  assert bool(metrics["grads_finite"])
  assert jax.tree.map(lambda x: x.dtype, state.params) == {k: jnp.float32 for k in ("w1", "b1", "w2")}
  state, losses = train(step, state, 30)
  assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------ low-precision params


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_create_upcasts_low_precision_params_to_f32_masters(dtype):
  params = dict(make_params(dtype), count=jnp.int32(4))
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2))
  state = jmp.TrainState.create(params=params, tx=tx)
  for name in ("w1", "b1", "w2"):
    assert state.params[name].dtype == jnp.float32
    np.testing.assert_array_equal(state.params[name], params[name].astype(jnp.float32))
  # The state owns a copy of every array (issue 15, item 2).
  assert state.params["count"] is not params["count"]
  assert state.params["count"].dtype == jnp.int32 and int(state.params["count"]) == 4
  adam = state.opt_state.inner_state[0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(jnp.float32)}


@pytest.mark.parametrize("scaled", [True, False], ids=["loss-scaling", "plain-optax"])
def test_direct_bf16_train_state_is_refused_at_trace_time(scaled):
  params = make_params(jnp.bfloat16)
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2)) if scaled else optax.adam(1e-2)
  state = jmp.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), tx=tx)
  step = jmp.make_train_step(regression_loss, jmp.get_policy("mixed_bfloat16"), donate=False)
  with pytest.raises(TypeError, match=r"float32 \(or float64\) master weights.*is bfloat16.*TrainState.create"):
    step(state, make_batch())


# ------------------------------------------------------------ x64


def test_x64_float64_masters_and_float32_scale():
  with jax.enable_x64(True):
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), make_params())
    tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8, growth_interval=5)
    state = jmp.TrainState.create(params=params, tx=tx)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(np.float64)}
    assert jmp.loss_scale_of(state.opt_state).dtype == jnp.float32
    assert state.opt_state.growth_count.dtype == jnp.int32
    traces = Traces()
    step = jmp.make_train_step(traces(regression_loss), jmp.get_policy("mixed_float16"), donate=False)
    batch = jax.tree.map(lambda x: np.asarray(x, np.float64), make_batch())
    losses = []
    for _ in range(20):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
      assert bool(metrics["grads_finite"])
    assert traces.count == 1  # stable dtypes: one trace
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(np.float64)}
    assert metrics["loss"].dtype == jnp.float32
    assert jmp.loss_scale_of(state.opt_state).dtype == jnp.float32
    assert float(jmp.loss_scale_of(state.opt_state)) == 2.0**12
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------ float8


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_leaves_are_cast_like_any_floating_leaf(dtype, maybe_jit):
  tree = {"f8": jnp.array([0.5, -3.0, 448.0 if dtype == jnp.float8_e4m3fn else 57344.0], dtype),
          "i": jnp.arange(3), "key": jax.random.key(0)}
  full = maybe_jit(jmp.cast_to_full)(tree)
  half = maybe_jit(jmp.cast_to_half)(tree)
  assert full["f8"].dtype == jnp.float32 and half["f8"].dtype == jmp.half_dtype()
  np.testing.assert_array_equal(full["f8"], tree["f8"].astype(jnp.float32))  # exact
  np.testing.assert_array_equal(half["f8"].astype(jnp.float32), full["f8"])
  assert bool(jmp.all_finite(tree))
  policy = jmp.get_policy(f"p=f32,c={np.dtype(dtype).name},o=f32")
  assert jmp.get_policy(str(policy)) == policy
  down = maybe_jit(policy.cast_to_compute)({"x": jnp.array([1.0, 0.3, 1e6], jnp.float32)})["x"]
  assert down.dtype == dtype
  assert float(down[0]) == 1.0 and abs(float(down[1]) - 0.3) <= 0.3 * float(jnp.finfo(dtype).eps)
  # Out of range is non-finite: NaN for e4m3fn (no inf), inf for e5m2.
  assert (np.isnan if dtype == jnp.float8_e4m3fn else np.isinf)(float(down[2]))
  assert not bool(jmp.all_finite({"x": down}))


def test_float8_compute_policy_trains_and_the_scale_settles_in_range():
  def loss_fn(params, batch):  # everything arrives in float8; the loss is float8 too
    pred = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - batch["y"]) ** 2)

  policy = jmp.get_policy("p=f32,c=float8_e4m3fn,o=f32")
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10, growth_interval=5)
  state = jmp.TrainState.create(params=make_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, policy, donate=False)
  finite, losses = [], []
  for _ in range(60):
    state, metrics = step(state, make_batch())
    finite.append(bool(metrics["grads_finite"]))
    losses.append(float(metrics["loss"]))
    assert bool(jmp.all_finite(state.params))
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.float32)}
  assert not finite[0]  # 2**10 overflows float8 gradients: skipped, not applied
  assert sum(finite) > 30  # the scale backed off into float8's range and training went on
  assert float(jmp.loss_scale_of(state.opt_state)) < 2.0**10
  assert np.mean(losses[-5:]) < 0.5 * losses[0]

"""Tests for jmp_lite's optax loss-scaling transformations (issue 3)."""

import functools
import math
import os
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import orbax.checkpoint as ocp
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jmp_lite as jmp
from jmp_lite._src.scaling import transform
from conftest import assert_bitwise_equal
from conftest import gradscaler_model

INT32_MAX = int(np.iinfo(np.int32).max)
F32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------- helpers


def assert_trees_close(a, b, rtol=1e-6):
  """Same structure and dtypes, values equal up to float32 rounding.

  Used against a reference run compiled as a different XLA program, where
  fusion may change the last bit.
  """
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


def make_params():
  key_w, key_b = jax.random.split(jax.random.key(0))
  return {
      "w": jax.random.normal(key_w, (4, 3), jnp.float32),
      # -0.0 must survive a skipped step bit for bit (+0.0 updates would flip it).
      "b": jnp.array([1.5, -0.0, 0.0], jnp.float32),
  }


def make_grads(seed, scale=1.0):
  """Gradients with a global norm well above 1 (so clipping is active)."""
  key_w, key_b = jax.random.split(jax.random.key(seed))
  grads = {
      "w": 3.0 * jax.random.normal(key_w, (4, 3), jnp.float32),
      "b": 3.0 * jax.random.normal(key_b, (3,), jnp.float32),
  }
  return jax.tree.map(lambda g: g * jnp.float32(scale), grads)


def poison(grads, value=np.inf, leaf="w"):
  """A copy of ``grads`` with the first element of ``leaf`` set to ``value``."""
  g = grads[leaf]
  return {**grads, leaf: g.ravel().at[0].set(value).reshape(g.shape)}


def counts_in(state):
  """Every ``count`` array in an optimizer state (Adam's, schedules')."""
  return [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(state, "count")]


def _pattern_step(tx):
  """One step of ``run_pattern``: ``(params, state), bad -> carry, (scale, growth count)``."""
  true_grads = {"w": jnp.array([0.25, -0.5, 1.0], jnp.float32)}

  def step(carry, bad):
    params, state = carry
    scaled = jax.tree.map(lambda g: g * jmp.loss_scale_of(state), true_grads)
    scaled = jax.tree.map(lambda g: jnp.where(bad, jnp.float32(np.inf), g), scaled)
    updates, state = tx.update(scaled, state, params)
    return (optax.apply_updates(params, updates), state), (state.loss_scale, state.growth_count)

  return step


@functools.lru_cache(maxsize=64)
def _pattern_scan(tx):
  """The whole pattern in one jitted ``lax.scan``, compiled once per ``tx`` and pattern length."""
  return jax.jit(lambda carry, pattern: jax.lax.scan(_pattern_step(tx), carry, pattern))


def run_pattern(tx, pattern, jit):
  """Feeds ``tx`` gradients of the scaled loss, non-finite where ``pattern`` is True.

  Returns the loss scale and growth count after every step (numpy arrays).
  Under ``jit`` the whole pattern runs in one ``lax.scan``.
  """
  params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32)}
  state = tx.init(params)
  pattern = np.asarray(pattern, bool)
  if jit:
    _, (scales, counts) = _pattern_scan(tx)((params, state), pattern)
    return np.asarray(scales), np.asarray(counts)
  step = _pattern_step(tx)
  scales, counts = [], []
  carry = (params, state)
  for bad in pattern:
    carry, (scale, count) = step(carry, jnp.asarray(bad))
    scales.append(scale)
    counts.append(count)
  return np.asarray(scales), np.asarray(counts)


def model_scales(pattern, config, **floor_and_cap):
  """``gradscaler_model`` on a ``run_pattern`` pattern (True: non-finite).

  Returns the scale and growth count after every step, like ``run_pattern``.
  """
  _, after = gradscaler_model([not bad for bad in pattern], *config, **floor_and_cap)
  return np.float32([a[0] for a in after]), np.array([a[1] for a in after])


# ------------------------------------------------------- schedule against GradScaler

PATTERN_LEN = 48
# Factors exactly representable in float32, so GradScaler's double-precision
# multiply rounds to the same float32 as the float32 model (and jmp_lite).
# A small config space, so that the jitted runners (one per config) are reused:
# _jitted_runner keeps one tx per config and _pattern_scan one compilation per tx.
_CONFIGS = st.tuples(
    st.sampled_from([2.0**15, 3.0 * 2.0**8]),
    st.sampled_from([2.0, 1.5]),
    st.sampled_from([0.5, 0.75]),
    st.sampled_from([1, 3]),
)


@functools.lru_cache(maxsize=None)
def _jitted_runner(config, min_scale, max_scale):
  init_scale, growth_factor, backoff_factor, growth_interval = config
  tx = jmp.dynamic_loss_scaling(
      optax.sgd(0.1),
      init_scale=init_scale,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      growth_interval=growth_interval,
      min_scale=min_scale,
      max_scale=max_scale,
  )
  return functools.partial(run_pattern, tx, jit=True)


@settings(max_examples=30, deadline=None, database=None)
@given(config=_CONFIGS, pattern=st.lists(st.booleans(), min_size=PATTERN_LEN, max_size=PATTERN_LEN))
def test_scale_sequence_equals_grad_scaler(config, pattern):
  # Floor and cap out of reach: 48 backoffs by 1/2 or growths by 2 stay inside.
  min_scale, max_scale = 2.0**-120, 2.0**120
  scales, counts = _jitted_runner(config, min_scale, max_scale)(pattern)
  expected, trackers = model_scales(pattern, config)
  assert min_scale < expected.min() and expected.max() < max_scale  # really out of reach
  np.testing.assert_array_equal(scales, expected)
  np.testing.assert_array_equal(counts, trackers)


@settings(max_examples=15, deadline=None, database=None)
@given(
    config=_CONFIGS,
    pattern=st.lists(st.booleans(), min_size=PATTERN_LEN, max_size=PATTERN_LEN),
)
def test_scale_sequence_with_floor_and_cap_in_reach(config, pattern):
  init_scale = config[0]
  min_scale, max_scale = init_scale / 4, init_scale * 4
  scales, counts = _jitted_runner(config, min_scale, max_scale)(pattern)
  expected, trackers = model_scales(pattern, config, min_scale=min_scale, max_scale=max_scale)
  np.testing.assert_array_equal(scales, expected)
  np.testing.assert_array_equal(counts, trackers)
  assert ((min_scale <= scales) & (scales <= max_scale)).all()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scale_sequence_fixed_pattern(jit):
  """Step by step in Python (eager) and in a scan (jit), hitting the cap and the floor."""
  F, T = False, True
  pattern = [F, F, F, F, F, F, T, T, T, T, T, F, F, F]
  expected = [8, 16, 16, 32, 32, 32, 16, 8, 4, 2, 2, 2, 4, 4]
  config = (8.0, 2.0, 0.5, 2)
  tx = jmp.dynamic_loss_scaling(
      optax.sgd(0.1), init_scale=8.0, growth_factor=2.0, backoff_factor=0.5,
      growth_interval=2, min_scale=2.0, max_scale=32.0,
  )
  scales, counts = run_pattern(tx, pattern, jit)
  model, trackers = model_scales(pattern, config, min_scale=2.0, max_scale=32.0)
  np.testing.assert_array_equal(model, np.float32(expected))  # the model itself
  np.testing.assert_array_equal(scales, model)
  np.testing.assert_array_equal(counts, trackers)


def test_growth_that_overflows_float32_keeps_the_scale():
  """max_scale=inf: like GradScaler, a growth to inf is not taken."""
  tx = jmp.dynamic_loss_scaling(
      optax.sgd(0.1), init_scale=2.0**120, growth_factor=2.0**10, growth_interval=1,
      max_scale=float("inf"),
  )
  scales, _ = run_pattern(tx, [False, False, True], jit=False)
  np.testing.assert_array_equal(scales, np.float32([2.0**120, 2.0**120, 2.0**119]))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("max_scale", [math.inf, 2.0**127, F32_MAX], ids=["inf", "2^127", "f32max"])
def test_growth_without_a_cap_stops_at_2_to_the_126(max_scale, jit):
  """Issue 22 item 2: 2**127 has a subnormal reciprocal that XLA flushes to 0.

  A growth that stays finite (2**117 * 2**10 = 2**127, 1.5 * 2**125 * 2) is
  clipped to 2**126; a growth to inf keeps the scale (previous test).
  """
  for init, factor, expected in [(2.0**125, 2.0, [2.0**126] * 3),
                                 (2.0**117, 2.0**10, [2.0**126] * 3),
                                 (1.5 * 2.0**125, 2.0, [2.0**126] * 3)]:
    tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=init, growth_factor=factor,
                                  growth_interval=1, max_scale=max_scale)
    scales, _ = run_pattern(tx, [False, False, False], jit=jit)
    np.testing.assert_array_equal(scales, np.float32(expected))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_unscale_exactly_at_2_to_the_126(jit):
  """At the largest scale the unscaled gradients are the true ones, and the step is applied."""
  tx = jmp.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**126, max_scale=math.inf)
  params = {"w": jnp.ones(4, jnp.float32), "h": jnp.ones(2, jnp.float16)}
  true = {"w": jnp.array([0.5, -1.5, 1e-3, 3.75], jnp.float32),  # 4 * 2**126 is inf.
          "h": jnp.array([2.0**-20, -1.0], jnp.float32)}
  scaled = {"w": true["w"] * 2.0**126, "h": (true["h"] * 2.0**126).astype(jnp.float32)}
  update = jax.jit(tx.update) if jit else tx.update
  updates, state = update(scaled, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], -true["w"])
  np.testing.assert_array_equal(updates["h"], -true["h"])
  assert int(state.skipped_steps) == 0 and float(state.loss_scale) == 2.0**126


@pytest.mark.parametrize("kwargs", [
    dict(init_scale=2.0**127, max_scale=math.inf),
    dict(init_scale=2.0**127, max_scale=2.0**127),
    dict(init_scale=1.0, min_scale=2.0**127, max_scale=math.inf),
], ids=["init-inf-cap", "init-at-cap", "min"])
def test_scales_above_2_to_the_126_are_refused(kwargs):
  name = "min_scale" if "min_scale" in kwargs else "init_scale"
  with pytest.raises(ValueError, match=rf"{name} must be in \[2\*\*-126, 2\*\*126\].*"
                     rf"so that 1/{name} is a normal float32.*got 1\.7014118346046923e\+38"):
    jmp.dynamic_loss_scaling(optax.sgd(0.1), **kwargs)
  with pytest.raises(ValueError, match=r"scale must be in \[2\*\*-126, 2\*\*126\]"):
    jmp.static_loss_scaling(optax.sgd(0.1), 2.0**127)


# ------------------------------------------------------------------- finite step


def extra_arg_inner(seen_dtypes):
  """An inner transformation that needs an extra arg and records its grads' dtypes."""

  def init(params):
    del params
    return jnp.zeros((), jnp.int32)

  def update(updates, state, params=None, *, multiplier, **extra):
    del params, extra
    seen_dtypes.extend(g.dtype for g in jax.tree.leaves(updates))
    return jax.tree.map(lambda g: g * multiplier.astype(g.dtype), updates), state + 1

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_finite_step_calls_inner_with_unscaled_f32_grads_and_extra_args(maybe_jit, dtype):
  seen = []
  tx = jmp.dynamic_loss_scaling(extra_arg_inner(seen), init_scale=2.0**8, growth_interval=2)
  # Values exact in every dtype, so scaling by 2**8 and unscaling is exact.
  true = {"w": jnp.array([0.25, -1.5, 3.0], jnp.float32), "i": jnp.array([7], jnp.int32)}
  scaled = {"w": (true["w"] * 256.0).astype(dtype), "i": true["i"]}
  state = tx.init({"w": jnp.zeros(3)})
  update = maybe_jit(lambda g, s, m: tx.update(g, s, None, multiplier=m))
  updates, state = update(scaled, state, jnp.float32(-2.0))
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["w"], -2.0 * np.asarray(true["w"]))
  np.testing.assert_array_equal(updates["i"], -2 * np.asarray(true["i"]))  # non-floating leaf untouched
  assert jnp.float32 in seen and not any(d in (jnp.float16, jnp.bfloat16) for d in seen)
  assert int(state.inner_state) == 1
  assert (float(state.loss_scale), int(state.growth_count)) == (256.0, 1)
  _, state = update(scaled, state, jnp.float32(1.0))
  assert (float(state.loss_scale), int(state.growth_count)) == (512.0, 0)
  assert (int(state.skipped_steps), int(state.consecutive_skips)) == (0, 0)


# --------------------------------------------------------------- non-finite step


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_nonfinite_step_is_skipped_bit_for_bit(maybe_jit, dtype):
  schedule = optax.linear_schedule(0.1, 0.01, 10)
  tx = jmp.dynamic_loss_scaling(optax.adam(schedule), init_scale=2.0**4, backoff_factor=0.25)
  params = make_params()
  state = tx.init(params)

  @maybe_jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  good = jax.tree.map(lambda g: g.astype(dtype), make_grads(1, scale=16.0))
  params, _, state = step(params, state, good)  # a real step first: non-trivial Adam state
  assert counts_in(state) == [1, 1]
  params_before, state_before = params, state

  # inf, -inf and nan, in either leaf; the scale backs off 16 -> 4 -> 1 -> 1 (floor).
  bad_steps = [(np.inf, "b", 4.0), (-np.inf, "w", 1.0), (np.nan, "w", 1.0)]
  for n, (bad, leaf, scale) in enumerate(bad_steps, start=1):
    params, updates, state = step(params, state, poison(good, bad, leaf))
    for u in jax.tree.leaves(updates):
      assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))  # -0.0
    assert_bitwise_equal(params, params_before)
    assert np.signbit(np.asarray(params["b"])[1])  # the -0.0 param is still -0.0
    assert_bitwise_equal(state.inner_state, state_before.inner_state)
    assert counts_in(state) == [1, 1]  # neither Adam's count nor the schedule advanced
    assert state.loss_scale.dtype == jnp.float32 and float(state.loss_scale) == scale
    assert (int(state.growth_count), int(state.skipped_steps), int(state.consecutive_skips)) == (0, n, n)

  good = jax.tree.map(lambda g: g.astype(dtype), make_grads(2, scale=1.0))
  params, _, state = step(params, state, good)
  assert not np.array_equal(params["w"], params_before["w"])
  assert counts_in(state) == [2, 2]
  assert (int(state.growth_count), int(state.skipped_steps), int(state.consecutive_skips)) == (1, 3, 0)


def test_counters_saturate_at_int32_max(maybe_jit):
  tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**10, growth_interval=INT32_MAX)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)._replace(
      growth_count=jnp.int32(INT32_MAX - 1),
      skipped_steps=jnp.int32(INT32_MAX - 1),
      consecutive_skips=jnp.int32(INT32_MAX - 1),
  )
  update = maybe_jit(tx.update)
  good, bad = {"w": jnp.ones(2)}, {"w": jnp.array([1.0, np.nan])}

  _, grown = update(good, state, params)  # the growth_interval-th finite step
  assert (float(grown.loss_scale), int(grown.growth_count)) == (2.0**11, 0)

  for expected in (INT32_MAX, INT32_MAX, INT32_MAX):
    _, state = update(bad, state, params)
    assert int(state.skipped_steps) == expected and int(state.consecutive_skips) == expected
    assert state.skipped_steps.dtype == jnp.int32
  _, state = update(good, state, params)
  assert (int(state.skipped_steps), int(state.consecutive_skips)) == (INT32_MAX, 0)

  # A hand-made growth counter at int32 max saturates too instead of wrapping.
  tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**10, growth_interval=INT32_MAX)
  state = tx.init(params)._replace(growth_count=jnp.int32(INT32_MAX))
  _, state = update(good, state, params)
  assert int(state.growth_count) == 0 and float(state.loss_scale) == 2.0**11


# ------------------------------------------------------------------- validation


def test_good_config_edge_values_are_accepted():
  params, grads = {"w": jnp.ones(2)}, {"w": jnp.ones(2)}

  def scales(tx, steps):
    state, out = tx.init(params), []
    for _ in range(steps):
      _, state = tx.update(grads, state, params)
      out.append(float(jmp.loss_scale_of(state)))
    return out

  # A NumPy integer interval: growth after exactly 2 finite steps.
  assert scales(jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0,
                                         growth_interval=np.int64(2)), 4) == [2, 4, 4, 8]
  # No cap: growth continues past the default 2**24.
  assert scales(jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**24, growth_interval=1,
                                         max_scale=float("inf")), 2) == [2.0**25, 2.0**26]
  # A pinned scale never moves.
  assert scales(jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=1.0, min_scale=1.0,
                                         max_scale=1.0, growth_interval=1), 3) == [1.0] * 3
  # A scalar array init_scale is taken as its value.
  state = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=jnp.float32(8.0)).init(params)
  assert float(state.loss_scale) == 8.0 and state.loss_scale.dtype == jnp.float32


# ------------------------------------------------------------------------ state


def test_state_is_a_strongly_typed_namedtuple_stable_across_steps_and_cond():
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10, growth_interval=1)
  params = {"w": jnp.ones((2, 3), jnp.float32)}
  state = tx.init(params)
  assert isinstance(state, jmp.LossScaleState) and isinstance(state, tuple)
  assert state._fields == (
      "loss_scale", "growth_count", "skipped_steps", "consecutive_skips", "inner_state"
  )
  for field, dtype in [("loss_scale", jnp.float32), ("growth_count", jnp.int32),
                       ("skipped_steps", jnp.int32), ("consecutive_skips", jnp.int32)]:
    value = getattr(state, field)
    assert isinstance(value, jax.Array) and value.dtype == dtype and value.shape == ()
    assert not value.weak_type, field

  grads16 = {"w": jnp.ones((2, 3), jnp.float16)}
  expected = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), state)
  out = jax.eval_shape(lambda g, s: tx.update(g, s, params)[1], grads16, state)
  assert out == expected  # same structure, shapes, dtypes and weak types as init
  assert out.loss_scale.dtype == jnp.float32  # f16 grads do not leak into the scale

  # The new state can be selected against the old one by lax.cond.
  def maybe_update(pred, grads, state):
    return jax.lax.cond(pred, lambda s: tx.update(grads, s, params)[1], lambda s: s, state)

  for pred, grads in [(True, grads16), (False, grads16), (True, {"w": grads16["w"].at[0, 0].set(np.inf)})]:
    new = jax.jit(maybe_update)(jnp.array(pred), grads, state)
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.weak_type), new) == jax.tree.map(
        lambda x: (x.shape, x.dtype, x.weak_type), state
    )


def test_jitted_update_does_not_retrace():
  tx = jmp.dynamic_loss_scaling(optax.adam(optax.cosine_decay_schedule(1e-2, 100)), init_scale=2.0**6)
  params = make_params()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)  # built eagerly, outside jit
  grads = make_grads(3, scale=64.0)
  for g in [grads, poison(grads), grads, poison(grads, np.nan), grads]:
    params, state = step(params, state, g)
  assert int(state.skipped_steps) == 2 and counts_in(state) == [3, 3]


# ------------------------------------------------------------------ composition


def test_clipping_in_chain_sees_unscaled_grads(maybe_jit):
  # The scaled gradients always have a norm far above 1; the true ones are
  # below 1 on even steps and above 1 on odd ones. Clipping before unscaling
  # would clip every step (to norm 1 / scale): only the right order matches.
  schedule = optax.linear_schedule(1e-1, 1e-2, 5)
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))
  tx = jmp.dynamic_loss_scaling(chain, init_scale=2.0**12)
  clip = optax.clip_by_global_norm(1.0)
  clip_only = jmp.dynamic_loss_scaling(clip, init_scale=2.0**12)

  @maybe_jit
  def scaled_step(params, state, clip_state, grads):
    scaled = jax.tree.map(lambda g: g * jmp.loss_scale_of(state), grads)
    updates, state = tx.update(scaled, state, params)
    clipped, clip_state = clip_only.update(scaled, clip_state)
    return optax.apply_updates(params, updates), state, clip_state, clipped

  @maybe_jit
  def reference_step(params, state, grads):
    updates, state = chain.update(grads, state, params)
    return optax.apply_updates(params, updates), state, clip.update(grads, ())[0]

  params = ref_params = make_params()
  state, ref_state, clip_state = tx.init(params), chain.init(params), clip_only.init(params)
  for seed in range(2):
    grads = make_grads(seed, scale=0.02 if seed % 2 == 0 else 1.0)
    norm = float(optax.tree.norm(grads))
    assert (norm < 1.0) if seed % 2 == 0 else (norm > 2.0)
    params, state, clip_state, clipped = scaled_step(params, state, clip_state, grads)
    ref_params, ref_state, ref_clipped = reference_step(ref_params, ref_state, grads)
    assert_trees_close(clipped, ref_clipped)  # the clipped gradients themselves
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), min(norm, 1.0), rtol=1e-5)
    assert_trees_close(params, ref_params)
    assert_trees_close(state.inner_state, ref_state)
  assert float(state.loss_scale) == 2.0**12


def test_adamw_schedule_does_not_advance_on_a_skipped_step(maybe_jit):
  schedule = lambda count: 0.1 / (1.0 + count.astype(jnp.float32))  # changes every step
  inner = optax.adamw(schedule, weight_decay=1e-2)
  tx = jmp.dynamic_loss_scaling(inner, init_scale=2.0**3)

  @maybe_jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  @maybe_jit
  def reference_step(params, state, grads):
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = ref_params = make_params()
  state, ref_state = tx.init(params), inner.init(params)
  g1, g2 = make_grads(1), make_grads(2)
  params, state = step(params, state, jax.tree.map(lambda g: g * 8.0, g1))
  params, state = step(params, state, poison(g1, np.nan))
  assert counts_in(state) == [1, 1]
  params, state = step(params, state, jax.tree.map(lambda g: g * 4.0, g2))  # scale backed off to 4
  for g in (g1, g2):
    ref_params, ref_state = reference_step(ref_params, ref_state, g)
  # A skip that advanced the schedule (lr 0.1/3 instead of 0.1/2) would be far off.
  assert_trees_close(params, ref_params)
  assert_trees_close(state.inner_state, ref_state)


def test_inject_hyperparams_state_is_frozen_on_a_skipped_step(maybe_jit):
  schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
  tx = jmp.dynamic_loss_scaling(inner, init_scale=1.0)
  params = make_params()
  state = tx.init(params)
  update = maybe_jit(tx.update)
  _, state = update(make_grads(1), state, params)
  before = state.inner_state
  updates, state = update(poison(make_grads(2)), state, params)
  assert_bitwise_equal(state.inner_state, before)
  assert int(state.inner_state.count) == 1
  assert float(state.inner_state.hyperparams["learning_rate"]) == float(before.hyperparams["learning_rate"])
  _, state = update(make_grads(2), state, params)
  assert int(state.inner_state.count) == 2
  # The learning rate follows the count of applied steps only: 0.1 * 0.5 ** 1.
  np.testing.assert_allclose(state.inner_state.hyperparams["learning_rate"], 0.05, rtol=1e-6)


def test_multisteps_inside_drops_a_poisoned_micro_batch(maybe_jit):
  k = 3
  inner = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=k)
  tx = jmp.dynamic_loss_scaling(inner, init_scale=2.0**5, growth_interval=100)

  @maybe_jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  @maybe_jit
  def reference_step(params, state, grads):
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  params = ref_params = make_params()
  state, ref_state = tx.init(params), inner.init(params)
  micro = [make_grads(seed) for seed in range(2 * k)]
  # Poisoned micro-batches (None) at mini-steps 0, 1 and k - 1 of the accumulation.
  stream = [None, micro[0], None, micro[1], micro[2], micro[3], micro[4], None, micro[5]]
  clean = iter(micro)
  for grads in stream:
    if grads is None:
      before, params_before = state.inner_state, params
      params, updates, state = step(params, state, poison(micro[0], np.inf))
      assert_bitwise_equal(state.inner_state, before)  # accumulator and mini-step untouched
      assert_bitwise_equal(params, params_before)
      continue
    scaled = jax.tree.map(lambda g: g * jmp.loss_scale_of(state), grads)
    params, updates, state = step(params, state, scaled)
    ref_params, ref_updates, ref_state = reference_step(ref_params, ref_state, next(clean))
    assert_trees_close(updates, ref_updates)
    assert_trees_close(params, ref_params)
    assert_trees_close(state.inner_state, ref_state)
  assert int(state.inner_state.gradient_step) == 2  # both k-groups produced an update
  assert (int(state.skipped_steps), float(state.loss_scale)) == (3, 4.0)


# ----------------------------------------------------------- loss_scale_of & co


@pytest.mark.parametrize("where", ["opt_state", "TrainState"])
def test_skipped_steps_of_refuses_a_state_without_a_scaler(where, maybe_jit):
  # Issue 31 item 4: it returned 0 after skipped steps of a plain optax tx.
  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  step = jmp.make_train_step(lambda p, x: jnp.sum(p["w"] * x), jmp.get_policy("f32"))
  state, metrics = step(state, jnp.array([1.0, jnp.nan]))
  assert not bool(metrics["grads_finite"])  # skipped, and counted nowhere
  expected = (r"skipped_steps_of found no loss-scaling state in opt_state \(of type .*\), so no "
              r"skipped steps were counted.*static_loss_scaling\(tx, 1\.0\).*"
              r'metrics\["grads_finite"\]')
  with pytest.raises(ValueError, match=expected):
    maybe_jit(jmp.skipped_steps_of)(state if where == "TrainState" else state.opt_state)
  # loss_scale_of's 1.0 is documented as "no scaling": the scale the step used.
  assert float(maybe_jit(jmp.loss_scale_of)(state.opt_state)) == float(metrics["loss_scale"]) == 1.0
  # The fix the message names counts the skip, and changes nothing else.
  counted = jmp.TrainState.create(params={"w": jnp.ones(2)},
                                  tx=jmp.static_loss_scaling(optax.sgd(0.1), 1.0))
  counted, _ = step(counted, jnp.array([1.0, jnp.nan]))
  assert int(maybe_jit(jmp.skipped_steps_of)(counted.opt_state)) == 1
  assert counted.params["w"].tolist() == state.params["w"].tolist() == [1.0, 1.0]


def _scaled(init_scale=8.0):
  return jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=init_scale)


@pytest.mark.parametrize(
    "make_tx, scale_after_skip",
    [
        (lambda: _scaled(), 4.0),
        (lambda: optax.chain(optax.clip(1.0), _scaled()), 4.0),
        (
            lambda: optax.inject_hyperparams(
                lambda learning_rate: jmp.dynamic_loss_scaling(
                    optax.sgd(learning_rate), init_scale=8.0
                )
            )(learning_rate=0.1),
            4.0,
        ),
        (lambda: optax.MultiSteps(_scaled(), every_k_schedule=1), 4.0),
        (lambda: jmp.static_loss_scaling(optax.sgd(0.1), 8.0), 8.0),
    ],
    ids=["bare", "chain", "inject_hyperparams", "MultiSteps", "static"],
)
def test_loss_scale_of_finds_nested_state(make_tx, scale_after_skip, maybe_jit):
  tx = make_tx()
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  scale = jmp.loss_scale_of(opt_state)
  assert (float(scale), scale.dtype) == (8.0, jnp.float32)
  assert int(jmp.skipped_steps_of(opt_state)) == 0
  _, opt_state = maybe_jit(tx.update)({"w": jnp.array([1.0, np.nan, 1.0])}, opt_state, params)
  assert float(maybe_jit(jmp.loss_scale_of)(opt_state)) == scale_after_skip
  assert int(maybe_jit(jmp.skipped_steps_of)(opt_state)) == 1
  assert transform.find_loss_scale_state(opt_state) is not None

  if not isinstance(tx.init(params), jmp.LossScaleState):
    # The train step only takes an outermost scaler (issue 11, item 1).
    with pytest.raises(ValueError, match=r"not outermost: its state is at opt_state.*"):
      jmp.TrainState.create(params=params, tx=tx)
    return
  train_state = jmp.TrainState.create(params=params, tx=tx)
  assert float(jmp.loss_scale_of(train_state)) == 8.0
  assert float(jmp.loss_scale_of(train_state.opt_state)) == 8.0
  assert int(jmp.skipped_steps_of(train_state)) == 0
  train_state = train_state.replace(opt_state=opt_state)
  assert float(jmp.loss_scale_of(train_state)) == scale_after_skip
  assert int(jmp.skipped_steps_of(train_state)) == 1


@pytest.mark.parametrize(
    "opt_state", [None, (), optax.adam(1e-3).init({"w": jnp.ones(2)}), {"a": jnp.ones(2)}]
)
def test_loss_scale_of_without_loss_scaling_is_one(opt_state):
  scale = jmp.loss_scale_of(opt_state)
  assert (float(scale), scale.dtype, scale.shape) == (1.0, jnp.float32, ())
  assert transform.find_loss_scale_state(opt_state) is None
  with pytest.raises(ValueError, match=r"found no loss-scaling state .*static_loss_scaling"):
    jmp.skipped_steps_of(opt_state)  # No counter: not a 0 (issue 31 item 4).


# ------------------------------------------------------------------------ static


def test_static_loss_scaling_keeps_its_scale_and_skips(maybe_jit):
  tx = jmp.static_loss_scaling(optax.adam(1e-2), 2.0**7)
  params = make_params()
  state = tx.init(params)

  @maybe_jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  inner = optax.adam(1e-2)
  ref_params, ref_state = params, inner.init(params)
  for i, bad in enumerate([False, True, True, False]):
    grads = make_grads(i, scale=2.0**7)
    before = (params, state.inner_state)
    params, state = step(params, state, poison(grads) if bad else grads)
    assert state.loss_scale.dtype == jnp.float32 and float(state.loss_scale) == 2.0**7
    if bad:
      assert_bitwise_equal((params, state.inner_state), before)
    else:
      updates, ref_state = inner.update(make_grads(i), ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, updates)
      np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6)
  assert (int(state.skipped_steps), int(state.consecutive_skips), int(state.growth_count)) == (2, 0, 0)


# ------------------------------------------------------------------------ orbax


def test_orbax_round_trip_continues_bit_for_bit(tmp_path):
  schedule = optax.linear_schedule(1e-1, 1e-3, 10)
  tx = jmp.dynamic_loss_scaling(
      optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule)),
      init_scale=2.0**9, growth_interval=2, min_scale=2.0**-3, max_scale=2.0**20,
  )

  @jax.jit
  def run(params, state, bads):
    def body(carry, xs):
      params, state = carry
      seed, bad = xs
      grads = jax.tree.map(
          lambda g: jnp.where(bad, jnp.float32(np.nan), g * jmp.loss_scale_of(state)),
          make_grads(seed),
      )
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), state.loss_scale

    seeds = jnp.arange(bads.shape[0], dtype=jnp.uint32)
    return jax.lax.scan(body, (params, state), (seeds, bads))

  params = make_params()
  state = tx.init(params)
  (params, state), _ = run(params, state, jnp.array([False, True, False, False, False]))
  assert (float(state.loss_scale), int(state.growth_count), int(state.skipped_steps)) == (2.0**9, 1, 1)

  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  ckptr.wait_until_finished()
  template = jax.eval_shape(lambda: {"params": make_params(), "opt_state": tx.init(make_params())})
  restored = ckptr.restore(tmp_path / "ckpt", template)
  ckptr.close()
  assert isinstance(restored["opt_state"], jmp.LossScaleState)
  assert_bitwise_equal(restored, {"params": params, "opt_state": state})

  rest = jnp.array([False, True, True, False, False, False])
  (p1, s1), scales1 = run(params, state, rest)
  (p2, s2), scales2 = run(restored["params"], restored["opt_state"], rest)
  assert_bitwise_equal((p1, s1, scales1), (p2, s2, scales2))
  assert int(s2.skipped_steps) == 3 and int(s2.growth_count) == 1


# --------------------------------------------------------------------- sharding

_SHARDED_CHILD = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jmp_lite as jmp

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    params = {
        "w": jax.device_put(jnp.arange(16.0, dtype=jnp.float32).reshape(8, 2) - 7.5, rows),
        "b": jax.device_put(jnp.array([0.5, -0.0], jnp.float32), replicated),
    }
    tx = jmp.dynamic_loss_scaling(optax.adam(0.1), init_scale=2.0**8)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = {"w": jnp.ones((8, 2), jnp.float32) * 256.0, "b": jnp.ones(2, jnp.float32) * 256.0}
    grads = {"w": jax.device_put(grads["w"].at[7, 1].set(jnp.inf), rows),  # last device only
             "b": jax.device_put(grads["b"], replicated)}
    shard_devices = {s.device for s in grads["w"].addressable_shards if not np.isfinite(np.asarray(s.data)).all()}
    assert len(shard_devices) == 1, shard_devices

    new_params, new_state = step(params, state, grads)
    for name in params:
        assert new_params[name].sharding.is_equivalent_to(params[name].sharding, 2 if name == "w" else 1)
        old = {s.device: np.asarray(s.data) for s in params[name].addressable_shards}
        new = {s.device: np.asarray(s.data) for s in new_params[name].addressable_shards}
        assert old.keys() == new.keys() and len(new) == 4
        for device in old:
            assert old[device].tobytes() == new[device].tobytes(), (name, device)
    assert float(new_state.loss_scale) == 128.0, new_state.loss_scale
    assert int(new_state.skipped_steps) == 1
    assert int(new_state.inner_state[0].count) == 0

    finite = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 1.0) * 0.5, grads)
    newer_params, newer_state = step(new_params, new_state, finite)
    for s_old, s_new in zip(new_params["w"].addressable_shards, newer_params["w"].addressable_shards):
        assert not np.array_equal(np.asarray(s_old.data), np.asarray(s_new.data))
    assert int(newer_state.inner_state[0].count) == 1 and int(newer_state.consecutive_skips) == 0
    print("SHARDED-OK")
    """
)


@pytest.mark.slow
def test_sharded_step_skips_on_every_device_together():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
      [sys.executable, "-c", _SHARDED_CHILD],
      env=env, capture_output=True, text=True, timeout=240,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert "SHARDED-OK" in result.stdout


# ------------------------------------------- bad input: messages name the value and what is allowed


_F32_RANGE = r"in \[2\*\*-126, 2\*\*126\] \(about 1\.2e-38 to 8\.5e\+37\) so that 1/\w+ is a normal float32"

BAD_SCALER_CONFIGS = [
    (dict(init_scale=0.0), ValueError, r"init_scale must be finite and > 0.*got 0\.0"),
    (dict(init_scale=-4.0), ValueError, r"init_scale must be finite and > 0.*got -4\.0"),
    (dict(init_scale=math.inf), ValueError, r"init_scale must be finite and > 0.*got inf"),
    (dict(init_scale=math.nan), ValueError, r"init_scale must be finite and > 0.*got nan"),
    (dict(init_scale=1e39, max_scale=math.inf), ValueError,  # inf in float32
     rf"init_scale must be {_F32_RANGE}.*got 1e\+39"),
    (dict(init_scale="big"), TypeError, r"init_scale must be a real number, got 'big'"),
    # Concrete jax arrays are checked like numbers (issue 22 item 11).
    (dict(init_scale=jnp.float32(np.inf)), ValueError, r"init_scale must be finite and > 0, got Array\(inf"),
    (dict(init_scale=jnp.float32(np.nan)), ValueError, r"init_scale must be finite and > 0, got Array\(nan"),
    (dict(min_scale=jnp.float32(0.0)), ValueError, r"min_scale must be finite and > 0, got Array\(0\."),
    (dict(growth_factor=1.0), ValueError, r"growth_factor must be finite and > 1, got 1\.0"),
    (dict(growth_factor=0.5), ValueError, r"growth_factor must be finite and > 1, got 0\.5"),
    (dict(growth_factor=math.nan), ValueError, r"growth_factor must be finite and > 1, got nan"),
    (dict(growth_factor=math.inf), ValueError, r"growth_factor must be finite and > 1, got inf"),
    (dict(growth_factor=None), TypeError, r"growth_factor must be a real number, got None"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor must be in the open interval \(0, 1\), got 0\.0"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in the open interval \(0, 1\), got 1\.0"),
    (dict(backoff_factor=2.0), ValueError, r"backoff_factor .*\(0, 1\), got 2\.0"),
    (dict(backoff_factor=-0.5), ValueError, r"backoff_factor .*\(0, 1\), got -0\.5"),
    (dict(backoff_factor=math.nan), ValueError, r"backoff_factor .*\(0, 1\), got nan"),
    (dict(growth_interval=0), ValueError, r"growth_interval must be .*1.*got 0"),
    (dict(growth_interval=-3), ValueError, r"growth_interval must be .*1.*got -3"),
    (dict(growth_interval=2**31), ValueError,
     r"growth_interval must be an int in \[1, 2147483647\], got 2147483648"),
    (dict(growth_interval=2.5), TypeError, r"growth_interval must be an int >= 1, got 2\.5"),
    (dict(growth_interval=True), TypeError, r"growth_interval must be an int >= 1, got True"),
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), ValueError,
     r"min_scale must be <= max_scale, got min_scale=8\.0 > max_scale=4\.0"),
    (dict(min_scale=0.0), ValueError, r"min_scale must be finite and > 0.*got 0\.0"),
    (dict(min_scale=1e-40, init_scale=1.0), ValueError,  # 1 / min_scale overflows float32
     rf"min_scale must be {_F32_RANGE}.*got 1e-40"),
    (dict(min_scale=True), TypeError, r"min_scale must be a real number, got True"),
    (dict(max_scale=math.nan), ValueError, r"max_scale .*got nan"),
    (dict(init_scale=0.5, min_scale=1.0), ValueError,
     r"init_scale must be in \[min_scale, max_scale\] = \[1\.0, 16777216\.0\], got 0\.5"),
    (dict(init_scale=2.0**30), ValueError, r"init_scale must be in \[min_scale, max_scale\].*got 1073741824\.0"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_SCALER_CONFIGS, ids=[str(c[0]) for c in BAD_SCALER_CONFIGS])
def test_bad_scaler_configs(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    jmp.dynamic_loss_scaling(optax.adam(1e-3), **kwargs)


@pytest.mark.parametrize("scale,exc,match", [
    (0.0, ValueError, r"scale must be finite and > 0.*got 0\.0"),
    (-1.0, ValueError, r"scale must be finite and > 0.*got -1\.0"),
    (math.inf, ValueError, r"scale must be finite and > 0.*got inf"),
    (math.nan, ValueError, r"scale must be finite and > 0.*got nan"),
    (1e-40, ValueError, rf"scale must be {_F32_RANGE}.*got 1e-40"),
    (1e39, ValueError, rf"scale must be {_F32_RANGE}.*got 1e\+39"),
    ("x", TypeError, r"scale must be a real number, got 'x'"),
    (None, TypeError, r"scale must be a real number, got None"),
    (True, TypeError, r"scale must be a real number, got True"),
])
def test_bad_static_scale(scale, exc, match):
  with pytest.raises(exc, match=match):
    jmp.static_loss_scaling(optax.adam(1e-3), scale)


@pytest.mark.parametrize(
    "inner",
    [optax.adam, optax.sgd, "adam", None, 3.0, (optax.sgd(0.1),), (lambda p: p, None)],
    ids=["uncalled-adam", "uncalled-sgd", "string", "None", "float", "tuple", "pair-of-functions"],
)
def test_non_transformation_inner(inner):
  match = rf"inner must be an optax transformation .*got {re.escape(repr(inner))}"
  with pytest.raises(TypeError, match=match):
    jmp.dynamic_loss_scaling(inner)
  with pytest.raises(TypeError, match=match):
    jmp.static_loss_scaling(inner, 2.0)

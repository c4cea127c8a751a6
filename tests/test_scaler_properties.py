"""Property tests (issue 7): the loss scalers against plain-Python models of their schedules.

Each scaler configuration is compiled once and runs a batch of random overflow
patterns with ``vmap`` over a ``lax.scan``, so the examples stay cheap.
"""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp
from conftest import gradscaler_model
from conftest import jmp_adjust_model

F32_MAX = float(np.finfo(np.float32).max)
PATTERN_LEN = 48
N_PATTERNS = 6

# Every scaler example compiles its own configuration: keep them few, and do
# not shrink (each shrink step compiles again); a failure still prints its example.
SETTINGS = hypothesis.settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate],
)

# ----------------------------------------------------------- dynamic_loss_scaling


@st.composite
def scaler_configs(draw):
  lo = 2.0 ** draw(st.integers(-40, 8)) * draw(st.floats(1.0, 1.9))
  if draw(st.booleans()):
    hi = math.inf
    init = draw(st.floats(lo, F32_MAX / 4)) if draw(st.booleans()) else draw(st.floats(lo, lo * 64))
  else:
    hi = lo * 2.0 ** draw(st.integers(0, 12)) * draw(st.floats(1.0, 1.5))
    init = draw(st.floats(lo, hi))
  return dict(
      init_scale=init,
      growth_factor=draw(st.floats(1.0, 16.0, exclude_min=True)),
      backoff_factor=draw(st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)),
      growth_interval=draw(st.integers(1, 6)),
      min_scale=lo,
      max_scale=hi,
  )


def overflow_patterns():
  p = st.floats(0.0, 1.0)
  return st.lists(p, min_size=N_PATTERNS, max_size=N_PATTERNS).flatmap(
      lambda rates: st.tuples(
          *[st.lists(st.floats(0, 1).map(lambda u, r=r: u >= r), min_size=PATTERN_LEN,
                     max_size=PATTERN_LEN) for r in rates]
      )
  )


def run_transform(tx, patterns, poison_values):
  """Runs ``tx.update`` over each overflow pattern (vmapped scan, one compilation)."""
  params = {"a": jnp.ones(3, jnp.float32), "b": jnp.ones(2, jnp.float16)}

  def one(finite_row, poison_row):
    def body(state, xs):
      finite, poison = xs
      scale = jmp.loss_scale_of(state)
      bad = jnp.where(finite, jnp.float32(0), poison)
      # Gradients of the scaled loss; the poison lands in one leaf only. The
      # float16 leaf stays in range whatever the scale (its true gradient is
      # 1 / scale), so only the injected poison is non-finite.
      grads = {
          "a": jnp.ones(3, jnp.float32) * scale,
          "b": (jnp.ones(2, jnp.float32) + bad).astype(jnp.float16),
      }
      _, state = tx.update(grads, state, params)
      return state, (scale, state.loss_scale, state.growth_count, state.skipped_steps,
                     state.consecutive_skips)

    return jax.lax.scan(body, tx.init(params), (finite_row, poison_row))[1]

  return jax.tree.map(np.asarray, jax.jit(jax.vmap(one))(patterns, poison_values))


@SETTINGS
@hypothesis.given(config=scaler_configs(), patterns=overflow_patterns(), seed=st.integers(0, 2**16))
def test_dynamic_loss_scaling_matches_gradscaler_model(config, patterns, seed):
  tx = jmp.dynamic_loss_scaling(optax.sgd(1.0), **config)
  patterns = np.array(patterns, bool)
  poison = np.random.default_rng(seed).choice(
      np.array([np.nan, np.inf, -np.inf], np.float32), size=patterns.shape
  )
  used, scale, count, skipped, consecutive = run_transform(tx, jnp.asarray(patterns), poison)
  assert scale.dtype == np.float32 and count.dtype == np.int32
  for i, pattern in enumerate(patterns):
    m_used, m_after = gradscaler_model(
        pattern,
        config["init_scale"],
        config["growth_factor"],
        config["backoff_factor"],
        config["growth_interval"],
        config["min_scale"],
        config["max_scale"],
    )
    np.testing.assert_array_equal(used[i], np.array(m_used, np.float32))
    m_scale, m_count, m_skipped, m_consecutive = (np.array(c) for c in zip(*m_after))
    np.testing.assert_array_equal(scale[i], m_scale.astype(np.float32))
    np.testing.assert_array_equal(count[i], m_count)
    np.testing.assert_array_equal(skipped[i], m_skipped)
    np.testing.assert_array_equal(consecutive[i], m_consecutive)
    assert np.isfinite(scale[i]).all() and (scale[i] > 0).all()
    assert (scale[i] >= np.float32(config["min_scale"])).all()
    if math.isfinite(config["max_scale"]):
      assert (scale[i] <= np.float32(config["max_scale"])).all()


@hypothesis.settings(SETTINGS, max_examples=5)
@hypothesis.given(
    scale=st.floats(2.0**-20, 2.0**40), patterns=overflow_patterns(), seed=st.integers(0, 2**16)
)
def test_static_loss_scaling_never_changes_and_counts_skips(scale, patterns, seed):
  tx = jmp.static_loss_scaling(optax.sgd(1.0), scale)
  patterns = np.array(patterns, bool)
  poison = np.random.default_rng(seed).choice(np.array([np.nan, np.inf], np.float32), patterns.shape)
  used, new_scale, count, skipped, consecutive = run_transform(tx, jnp.asarray(patterns), poison)
  assert (used == np.float32(scale)).all() and (new_scale == np.float32(scale)).all()
  assert (count == 0).all()
  np.testing.assert_array_equal(skipped, np.cumsum(~patterns, axis=1))
  for i, pattern in enumerate(patterns):
    run = 0
    for t, finite in enumerate(pattern):
      run = 0 if finite else run + 1
      assert consecutive[i, t] == run


# ------------------------------------------------------ DynamicLossScale.adjust


@SETTINGS
@hypothesis.given(
    dtype=st.sampled_from([np.float32, np.float16]),
    period=st.integers(1, 6),
    factor=st.sampled_from([2.0, 4.0, 8.0, 1.5, 3.0, 10.0]) | st.floats(1.01, 8.0),
    # Starts below 1, below the floor, and (float32) far above float16's range.
    log_scale=st.integers(-2, 20),
    floor=st.sampled_from([2.0**-10, 2.0**-4, 0.5, 1.0, 4.0, 16.0]),
    patterns=overflow_patterns(),
)
def test_dynamic_loss_scale_adjust_matches_jmp_model(dtype, period, factor, log_scale, floor, patterns):
  if dtype == np.float16:
    log_scale = min(log_scale, 15)  # 2**15 is float16's largest power of two.
  init = jmp.DynamicLossScale(
      jnp.asarray(2.0**log_scale, dtype), period=period, factor=factor,
      min_loss_scale=jnp.asarray(floor, dtype),
  )

  def one(pattern):
    def body(ls, finite):
      ls = ls.adjust(finite)
      return ls, (ls.loss_scale, ls.counter)

    return jax.lax.scan(body, init, pattern)[1]

  scales, counters = jax.tree.map(np.asarray, jax.jit(jax.vmap(one))(jnp.array(patterns)))
  assert scales.dtype == np.dtype(dtype)
  # With a power-of-two factor every operation is exact. Otherwise XLA may
  # divide by multiplying with the rounded reciprocal (1 ulp per backoff).
  exact = math.log2(factor).is_integer()
  rtol = 0 if exact else PATTERN_LEN * float(jnp.finfo(dtype).eps)
  for i, pattern in enumerate(patterns):
    model = jmp_adjust_model(pattern, 2.0**log_scale, period, factor, floor, dtype)
    np.testing.assert_allclose(scales[i], np.array([s for s, _ in model], dtype), rtol=rtol, atol=0)
    np.testing.assert_array_equal(counters[i], np.array([c for _, c in model]))
    assert np.isfinite(scales[i]).all()  # growth never overflows to inf

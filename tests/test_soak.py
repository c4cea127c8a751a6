"""Soak test (issue 7): 5,000 train steps with 20% random overflows.

The real jitted step from ``make_train_step`` runs inside one ``lax.scan``, so
the 5,000 steps cost one compilation. Every step records whether the params
are finite and the scale, so the invariants are checked throughout, not only
at the end.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import regression_loss
from conftest import regression_params

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_soak")

STEPS = 5000
OVERFLOW_RATE = 0.2
MIN_SCALE = 1.0
MAX_SCALE = 2.0**10
GROWTH_INTERVAL = 2


def make_params():
  return regression_params(3, 4, 8, 1, w1_std=0.5, b1=0.01, w2_std=0.1)


def make_data():
  kx, kn = jax.random.split(jax.random.key(4))
  x = jax.random.normal(kx, (128, 4))
  noise = 0.1 * jax.random.normal(kn, (128, 1))  # an irreducible loss of about 0.01
  return x, jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:2]) + 0.3 * x[:, 2:3] + noise


def poison_schedule(seed):
  """20% overflows: mostly isolated, plus bursts long enough to hit the floor."""
  rng = np.random.default_rng(seed)
  bad = rng.random(STEPS) < OVERFLOW_RATE
  for start in rng.choice(STEPS - 40, size=4, replace=False):
    bad[start : start + 15] = True  # 15 backoffs: 2**10 -> floor 1
  poison = np.where(bad, np.where(rng.random(STEPS) < 0.5, np.nan, np.inf), 1.0)
  return bad, poison.astype(np.float32)


@pytest.fixture(scope="module")
def run():
  """``run(poison) -> (final_state, per-step records)``: one compilation for all runs."""
  tx = jmp.dynamic_loss_scaling(
      optax.adam(3e-3),
      init_scale=2.0**6,
      growth_interval=GROWTH_INTERVAL,
      min_scale=MIN_SCALE,
      max_scale=MAX_SCALE,
  )
  step = jmp.make_train_step(regression_loss, jmp.get_policy("mixed_float16"), donate=False)
  x, y = make_data()

  @jax.jit
  def soak(state, poison):
    def body(state, p):
      state, metrics = step(state, {"x": x, "y": y, "poison": p})
      record = {
          "loss": metrics["loss"],
          "grads_finite": metrics["grads_finite"],
          "used_scale": metrics["loss_scale"],
          "scale": jmp.loss_scale_of(state.opt_state),
          "params_finite": jmp.all_finite(state.params),
          "skipped": jmp.skipped_steps_of(state.opt_state),
          "adam_count": state.opt_state.inner_state[0].count,
      }
      return state, record

    return jax.lax.scan(body, state, poison)

  state = jmp.TrainState.create(params=make_params(), tx=tx)
  return lambda poison: jax.tree.map(np.asarray, soak(state, jnp.asarray(poison)))


@pytest.mark.parametrize("seed", [0, 1])
def test_soak_with_random_overflows(run, seed):
  bad, poison = poison_schedule(seed)
  n_bad = int(bad.sum())
  assert 0.19 * STEPS < n_bad < 0.26 * STEPS
  state, rec = run(poison)

  # Throughout: params finite, scale in [min, max], float32.
  assert rec["params_finite"].all()
  assert (rec["scale"] >= MIN_SCALE).all() and (rec["scale"] <= MAX_SCALE).all()
  assert rec["scale"].dtype == np.float32
  # Both ends of the range were exercised.
  assert rec["scale"].min() == MIN_SCALE and rec["scale"].max() == MAX_SCALE
  # Exactly the injected steps were skipped (no natural overflow, none missed).
  np.testing.assert_array_equal(rec["grads_finite"], ~bad)
  np.testing.assert_array_equal(rec["skipped"], np.cumsum(bad))
  assert int(jmp.skipped_steps_of(state.opt_state)) == n_bad
  assert int(state.step) == STEPS
  # Adam advanced on applied steps only.
  np.testing.assert_array_equal(rec["adam_count"], np.cumsum(~bad))

  # The loss falls as in a clean run with the same number of applied updates.
  _, clean = run(np.ones(STEPS, np.float32))
  assert clean["grads_finite"].all()
  clean_loss = clean["loss"]
  assert clean_loss[STEPS - 1] < 0.1 * clean_loss[0]
  applied_before = np.cumsum(~bad) - (~bad)  # updates applied before each step
  good = np.flatnonzero(~bad)
  soak_loss = rec["loss"][good]
  matched_clean = clean_loss[applied_before[good]]
  np.testing.assert_allclose(soak_loss, matched_clean, rtol=0.03)
  assert soak_loss[-1] < 0.1 * soak_loss[0]

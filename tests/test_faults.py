"""Fault injection through the real train step (issue 7).

NaN and inf are injected into the loss, into one gradient leaf, and into one
shard of a sharded batch, in streaks of 1, 10 and 100 steps, on the very first
step and exactly on a growth step. On every bad step the master params and the
inner optimizer state must be bit-for-bit unchanged; afterwards the run must
recover (the loss falls again and the scale grows back).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal
from conftest import regression_loss
from conftest import regression_params

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_faults")

INIT_SCALE = 2.0**8
GROWTH_INTERVAL = 4
MIN_SCALE = 1.0
MAX_SCALE = 2.0**12
POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@jax.custom_vjp
def _poison_grad(x, poison):
  """Identity in the forward pass; adds ``poison`` to the gradient of ``x``."""
  return x


def _poison_grad_fwd(x, poison):
  return x, poison


def _poison_grad_bwd(poison, g):
  return g + poison.astype(g.dtype), jnp.zeros_like(poison)


_poison_grad.defvjp(_poison_grad_fwd, _poison_grad_bwd)


def loss_fn(params, batch):
  """The poisoned regression MLP; ``grad_poison`` also hits w1's grad only."""
  w1 = _poison_grad(params["w1"], batch["grad_poison"])
  return regression_loss(dict(params, w1=w1), batch)


def make_params():
  return regression_params(1, 8, 32, 1, w1_std=0.3, b1=0.01, w2_std=0.1)


def make_batch(loss_poison=1.0, grad_poison=0.0):
  x = jax.random.normal(jax.random.key(2), (64, 8))
  return {
      "x": x,
      "y": jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2],
      "poison": jnp.float32(loss_poison),  # multiplies the loss
      "grad_poison": jnp.float32(grad_poison),
  }


def make_tx():
  return jmp.dynamic_loss_scaling(
      optax.adam(1e-2),
      init_scale=INIT_SCALE,
      growth_interval=GROWTH_INTERVAL,
      min_scale=MIN_SCALE,
      max_scale=MAX_SCALE,
  )


@pytest.fixture(scope="module")
def step():
  # One compilation for the whole module: every scenario reuses this step.
  return jmp.make_train_step(
      loss_fn, jmp.get_policy("mixed_float16"), donate=False, track_nonfinite=True
  )


@pytest.fixture(scope="module")
def fresh_state():
  return jmp.TrainState.create(params=make_params(), tx=make_tx())


def run_clean(step, state, n):
  batch = make_batch()
  losses, scales = [], []
  for _ in range(n):
    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"])
    losses.append(float(metrics["loss"]))
    scales.append(float(jmp.loss_scale_of(state.opt_state)))
  return state, losses, scales


def run_bad_streak(step, state, batches):
  """Runs one poisoned step per batch; each must leave params and inner state bit-identical."""
  before = state
  scale = float(jmp.loss_scale_of(state.opt_state))
  skipped = int(jmp.skipped_steps_of(state.opt_state))
  for k, batch in enumerate(batches, start=1):
    state, metrics = step(state, batch)
    ls = state.opt_state
    assert not bool(metrics["grads_finite"])
    assert float(metrics["loss_scale"]) == scale  # the scale used on this step
    assert_bitwise_equal(state.params, before.params)
    assert_bitwise_equal(ls.inner_state, before.opt_state.inner_state)
    scale = max(scale * 0.5, MIN_SCALE)
    assert float(ls.loss_scale) == scale
    assert ls.loss_scale.dtype == jnp.float32
    assert int(ls.growth_count) == 0
    assert int(ls.skipped_steps) == skipped + k
    assert int(ls.consecutive_skips) == k
    assert int(state.step) == int(before.step) + k
  return state


def assert_recovers(step, state, loss_before):
  """After the bad steps, clean training resumes: loss falls and the scale grows."""
  scale_after_bad = float(jmp.loss_scale_of(state.opt_state))
  state, losses, scales = run_clean(step, state, 6 * GROWTH_INTERVAL)
  assert int(state.opt_state.consecutive_skips) == 0
  assert losses[-1] < losses[0]
  assert losses[-1] < loss_before
  assert max(scales) > scale_after_bad or scale_after_bad == MAX_SCALE
  assert bool(jmp.all_finite(state.params))
  return state


def test_the_clean_run_trains(step, fresh_state):
  state, losses, scales = run_clean(step, fresh_state, 3 * GROWTH_INTERVAL)
  assert losses[-1] < 0.8 * losses[0]
  assert scales[-1] == INIT_SCALE * 2**3  # grew exactly every GROWTH_INTERVAL steps


@pytest.mark.parametrize("poison", list(POISONS))
def test_poisoned_loss_is_skipped_and_recovers(step, fresh_state, poison):
  state, losses, _ = run_clean(step, fresh_state, 3)
  _, metrics = step(state, make_batch(loss_poison=POISONS[poison]))
  assert not np.isfinite(float(metrics["loss"]))
  state = run_bad_streak(step, state, [make_batch(loss_poison=POISONS[poison])])
  assert_recovers(step, state, losses[-1])


@pytest.mark.parametrize("poison", list(POISONS))
def test_poisoned_gradient_leaf_is_skipped_and_recovers(step, fresh_state, poison):
  state, losses, _ = run_clean(step, fresh_state, 3)
  _, clean_metrics = step(state, make_batch())
  _, metrics = step(state, make_batch(grad_poison=POISONS[poison]))
  # Only w1's gradient is poisoned: the loss itself is finite and unchanged.
  assert float(metrics["loss"]) == float(clean_metrics["loss"])
  assert {k: bool(v) for k, v in metrics["nonfinite"].items()} == {
      "w1": True,
      "b1": False,
      "w2": False,
  }
  state = run_bad_streak(step, state, [make_batch(grad_poison=POISONS[poison])])
  assert_recovers(step, state, losses[-1])


@pytest.mark.parametrize("streak", [1, 10, 100])
def test_overflow_streaks(step, fresh_state, streak):
  state, losses, _ = run_clean(step, fresh_state, 5)
  # Alternate the two injection sites within the streak.
  bad = [make_batch(loss_poison=np.nan), make_batch(grad_poison=np.inf)]
  state = run_bad_streak(step, state, [bad[k % 2] for k in range(streak)])
  assert int(state.opt_state.consecutive_skips) == streak
  assert int(jmp.skipped_steps_of(state.opt_state)) == streak
  expected = max(INIT_SCALE * 2 * 0.5**streak, MIN_SCALE)  # it grew once in the 5 clean steps
  assert float(jmp.loss_scale_of(state.opt_state)) == expected
  assert_recovers(step, state, losses[-1])


def test_overflow_on_the_very_first_step(step, fresh_state):
  state = run_bad_streak(step, fresh_state, [make_batch(loss_poison=np.inf)])
  adam_state = state.opt_state.inner_state[0]
  assert int(adam_state.count) == 0  # Adam's bias correction did not advance
  assert float(jmp.loss_scale_of(state.opt_state)) == INIT_SCALE / 2
  _, metrics = step(fresh_state, make_batch())
  assert_recovers(step, state, float(metrics["loss"]))


def test_overflow_exactly_on_a_growth_step(step, fresh_state):
  state, losses, scales = run_clean(step, fresh_state, GROWTH_INTERVAL - 1)
  assert scales == [INIT_SCALE] * (GROWTH_INTERVAL - 1)
  assert int(state.opt_state.growth_count) == GROWTH_INTERVAL - 1
  # The next finite step would grow the scale; an overflow backs off instead.
  state = run_bad_streak(step, state, [make_batch(grad_poison=np.nan)])
  assert float(jmp.loss_scale_of(state.opt_state)) == INIT_SCALE / 2
  # The growth counter restarted: growth comes a full interval later, not sooner.
  state, _, scales = run_clean(step, state, GROWTH_INTERVAL)
  assert scales == [INIT_SCALE / 2] * (GROWTH_INTERVAL - 1) + [INIT_SCALE]
  assert_recovers(step, state, losses[-1])


@pytest.mark.parametrize(
    "make", [lambda: optax.adam(1e-2), lambda: jmp.static_loss_scaling(optax.adam(1e-2), 2.0**6)],
    ids=["plain-optax", "static-scaling"],
)
def test_other_transformations_refuse_a_poisoned_step(make):
  tx = make()
  state = jmp.TrainState.create(params=make_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), donate=False)
  state, _ = step(state, make_batch())
  new, metrics = step(state, make_batch(grad_poison=np.nan))
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(new.params, state.params)
  if isinstance(state.opt_state, jmp.LossScaleState):  # static scaling
    assert_bitwise_equal(new.opt_state.inner_state, state.opt_state.inner_state)
    assert float(new.opt_state.loss_scale) == 2.0**6
    assert int(new.opt_state.skipped_steps) == 1
  else:  # plain optax: the step keeps the old state by a select
    assert_bitwise_equal(new.opt_state, state.opt_state)
  new, metrics = step(new, make_batch())
  assert bool(metrics["grads_finite"])
  assert not np.array_equal(np.asarray(new.params["w1"]), np.asarray(state.params["w1"]))


_SHARDED_CHILD = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jmp_lite as jmp

    assert jax.device_count() == 4, jax.devices()

    def loss_fn(params, batch):
      h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
      pred = (h @ params["w2"]).astype(jnp.float32)[:, 0]
      per_example = (pred - batch["y"].astype(jnp.float32)) ** 2
      return jnp.mean(per_example * batch["row_poison"].astype(jnp.float32))

    def bits(tree):
      return [np.asarray(l).view(f"u{np.asarray(l).dtype.itemsize}") for l in jax.tree.leaves(tree)]

    def same(a, b):
      return all(np.array_equal(x, y) for x, y in zip(bits(a), bits(b)))

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "b1": jnp.full((32,), 0.01),
              "w2": jax.random.normal(k2, (32, 1)) * 0.1}
    x = jax.random.normal(k3, (64, 8))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))

    def batch(poison):
      row_poison = np.ones(64, np.float32)
      row_poison[32:48] = poison   # rows 32..47 live on device 2 only
      b = {"x": x, "y": jnp.sin(x[:, 0]), "row_poison": row_poison}
      return jax.device_put(b, rows)

    tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8, growth_interval=4)
    state = jmp.TrainState.create(params=params, tx=tx)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), donate=False)
    assert batch(np.nan)["row_poison"].addressable_shards[2].data[0] != 1  # the poisoned shard
    for _ in range(3):
      state, m = step(state, batch(1.0))
    loss_before = float(m["loss"])
    for poison in (np.nan, np.inf):
      new, m = step(state, batch(poison))
      assert not bool(m["grads_finite"]), poison
      assert same(new.params, state.params), poison
      assert same(new.opt_state.inner_state, state.opt_state.inner_state), poison
      assert float(new.opt_state.loss_scale) == float(state.opt_state.loss_scale) / 2
      # Every device holds the same (unchanged) params: the skip was global.
      for leaf in jax.tree.leaves(new.params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 4 and all(np.array_equal(s, shards[0]) for s in shards)
      state = new
    skipped_scale = float(state.opt_state.loss_scale)
    losses = []
    for _ in range(24):
      state, m = step(state, batch(1.0))
      assert bool(m["grads_finite"])
      losses.append(float(m["loss"]))
    assert losses[-1] < loss_before, (losses, loss_before)
    assert float(state.opt_state.loss_scale) > skipped_scale
    assert int(jmp.skipped_steps_of(state.opt_state)) == 2
    print("SHARDED-OK")
    """
)


@pytest.mark.slow
def test_poison_in_one_shard_of_a_sharded_batch():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
      [sys.executable, "-W", "error", "-c", _SHARDED_CHILD],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert "SHARDED-OK" in result.stdout

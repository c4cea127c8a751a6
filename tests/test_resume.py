"""Kill-and-resume with orbax (issue 7).

A run is saved at a random step, keeps training, and is then "killed": a new
transformation, a new train step and a template from ``TrainState.create``
stand in for a fresh process. The restored run replays the same batches and
must end bit-for-bit equal to the uninterrupted one, loss-scale state and
counters included.

Restoring under a different loss-scale configuration: the configuration is
static (it lives in the transformation's closure) and the checkpoint holds only
arrays, so the restored run uses the checkpointed scale and counters with the
new configuration's rule. The tests pin down what that means.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jmp_lite as jmp
import zoo_models
from conftest import assert_bitwise_equal
from conftest import regression_loss
from conftest import regression_params

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_resume")

STEPS = 30
POLICY = jmp.get_policy("mixed_float16")


def make_params():
  params = regression_params(5, 6, 16, 2, w1_std=0.4, b1=0.02, w2_std=0.2)
  return dict(params, calls=jnp.int32(11))  # a non-floating leaf, carried through untouched


def make_batches(seed):
  """A different batch every step, with a few overflows so the counters move."""
  rng = np.random.default_rng(seed)
  batches = []
  for t in range(STEPS):
    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)
    poison = np.float32(np.nan if rng.random() < 0.15 or t == 0 else 1.0)
    batches.append({"x": x, "y": y, "poison": poison})
  return batches


def make_tx(**overrides):
  config = dict(init_scale=2.0**8, growth_interval=3, min_scale=1.0, max_scale=2.0**14)
  config.update(overrides)
  return jmp.dynamic_loss_scaling(optax.adamw(optax.cosine_decay_schedule(3e-3, STEPS)), **config)


def assert_bit_equal(a, b):
  """``assert_bitwise_equal``; a ``TrainState``'s ``tx`` (a static function pair) may differ."""
  if isinstance(a, jmp.TrainState):
    assert (a.master_dtype, a.rounding) == (b.master_dtype, b.rounding)
    a, b = [(s.step, s.params, s.opt_state, s.compensation, s.rounding_key) for s in (a, b)]
  assert_bitwise_equal(a, b)


def save(path, state):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()


def restore(path, template):
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, template)


@pytest.fixture(scope="module")
def first_step():
  return jmp.make_train_step(regression_loss, POLICY, donate=False)


def test_kill_and_resume_is_bit_for_bit(tmp_path, first_step):
  seed = 0
  batches = make_batches(seed)
  save_at = int(np.random.default_rng().integers(1, STEPS - 1))  # a random step each run
  state = jmp.TrainState.create(params=make_params(), tx=make_tx())
  path = tmp_path / "ckpt"
  for t, batch in enumerate(batches):
    if t == save_at:
      save(path, state)
    state, _ = first_step(state, batch)
  uninterrupted = state
  ls = uninterrupted.opt_state
  assert int(ls.skipped_steps) >= 1  # the scale and counters did move
  assert float(ls.loss_scale) != 2.0**8 or int(ls.growth_count) != 0

  # "Kill": a fresh transformation, train step and template, as a new process would build.
  tx = make_tx()
  template = jmp.TrainState.create(params=make_params(), tx=tx)
  resumed = restore(path, template)
  assert resumed.tx is tx
  assert int(resumed.step) == save_at
  step = jmp.make_train_step(regression_loss, POLICY)  # donating, like a real run
  for batch in batches[save_at:]:
    resumed, _ = step(resumed, batch)
  print(f"saved and resumed at step {save_at}")  # shown if the comparison fails
  assert_bit_equal(resumed, uninterrupted)
  assert int(resumed.params["calls"]) == 11 and resumed.params["calls"].dtype == jnp.int32


LEAN = {
    "stochastic": dict(master_dtype=jnp.bfloat16, rounding="stochastic", key=jax.random.key(11)),
    "kahan": dict(master_dtype=jnp.bfloat16, rounding="kahan"),
}


@pytest.mark.parametrize(
    "rounding, template", [("stochastic", "eval_shape"), ("kahan", "create")]
)
def test_lean_masters_resume_bit_for_bit(tmp_path, rounding, template):
  """bf16 masters, the Kahan compensation and the stochastic-rounding key survive a restore."""
  batches = make_batches(1)
  save_at = int(np.random.default_rng().integers(1, STEPS - 1))
  state = jmp.TrainState.create(params=make_params(), tx=make_tx(), **LEAN[rounding])
  step = jmp.make_train_step(regression_loss, jmp.get_policy("mixed_bfloat16"))
  for t, batch in enumerate(batches):
    if t == save_at:
      save(tmp_path / "ckpt", state)
    state, _ = step(state, batch)
  uninterrupted = state
  if rounding == "kahan":
    assert any(np.any(np.asarray(c) != 0) for c in jax.tree.leaves(state.compensation))

  tx = make_tx()
  build = lambda: jmp.TrainState.create(params=make_params(), tx=tx, **LEAN[rounding])
  target = build() if template == "create" else jax.eval_shape(build)
  resumed = restore(tmp_path / "ckpt", target)
  assert resumed.params["w1"].dtype == jnp.bfloat16 and int(resumed.step) == save_at
  if rounding == "stochastic":
    assert jax.dtypes.issubdtype(resumed.rounding_key.dtype, jax.dtypes.prng_key)
  step = jmp.make_train_step(regression_loss, jmp.get_policy("mixed_bfloat16"))
  for batch in batches[save_at:]:
    resumed, _ = step(resumed, batch)
  print(f"saved and resumed at step {save_at}")
  assert_bit_equal(resumed, uninterrupted)


def test_lean_checkpoint_into_a_float32_template_is_a_clear_error(tmp_path):
  state = jmp.TrainState.create(params=make_params(), tx=make_tx(), **LEAN["kahan"])
  save(tmp_path / "ckpt", state)
  with pytest.raises(ValueError, match=r"tree structures do not match|compensation"):
    restore(tmp_path / "ckpt", jmp.TrainState.create(params=make_params(), tx=make_tx()))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, first_step):
  """A dynamic-scaling checkpoint with scale 2**10 and growth counter 2 (interval 3)."""
  state = jmp.TrainState.create(params=make_params(), tx=make_tx())
  batches = make_batches(7)
  clean = dict(batches[1], poison=np.float32(1.0))
  state, _ = first_step(state, clean)
  # Two growths (6 finite steps) then two more finite steps: 2**10, counter 2.
  for _ in range(7):
    state, m = first_step(state, clean)
    assert bool(m["grads_finite"])
  assert float(state.opt_state.loss_scale) == 2.0**10
  assert int(state.opt_state.growth_count) == 2
  path = tmp_path_factory.mktemp("ckpt") / "state"
  save(path, state)
  return path, state, clean


def restore_under(checkpoint, tx):
  path, _, _ = checkpoint
  return restore(path, jmp.TrainState.create(params=make_params(), tx=tx))


def test_restore_under_a_shorter_growth_interval(checkpoint):
  """The counter carries over: at or past the new interval, the next finite step grows."""
  _, saved, clean = checkpoint
  tx = make_tx(growth_interval=2)
  state = restore_under(checkpoint, tx)
  assert_bit_equal(state.opt_state, saved.opt_state)
  step = jmp.make_train_step(regression_loss, POLICY, donate=False)
  state, m = step(state, clean)
  assert float(m["loss_scale"]) == 2.0**10
  assert float(state.opt_state.loss_scale) == 2.0**11
  assert int(state.opt_state.growth_count) == 0
  state, _ = step(state, clean)
  state, _ = step(state, clean)
  assert float(state.opt_state.loss_scale) == 2.0**12  # then every 2 finite steps


def test_first_step_after_a_config_change_updates_params_like_the_old_config(checkpoint, first_step):
  """The loss is scaled and the gradients unscaled by the same (checkpointed) scale."""
  _, saved, clean = checkpoint
  expected, _ = first_step(saved, clean)
  state = restore_under(checkpoint, make_tx(growth_interval=50, max_scale=2.0**16))
  step = jmp.make_train_step(regression_loss, POLICY, donate=False)
  state, m = step(state, clean)
  assert float(m["loss_scale"]) == 2.0**10
  assert_bit_equal(state.params, expected.params)
  assert_bit_equal(state.opt_state.inner_state, expected.opt_state.inner_state)


def test_restore_under_a_lower_max_scale_obeys_the_new_cap(checkpoint):
  """A checkpointed scale above the new ``max_scale`` must not outlive the first update.

  The scale used on the first step is the checkpointed one (it must be, for the
  gradients to be unscaled correctly); from the first update on, the scale
  must be within the new configuration's [min_scale, max_scale].
  """
  _, _, clean = checkpoint
  tx = make_tx(init_scale=2.0**4, max_scale=2.0**6, growth_interval=100)
  state = restore_under(checkpoint, tx)
  step = jmp.make_train_step(regression_loss, POLICY, donate=False)
  for _ in range(3):
    state, _ = step(state, clean)
    # The checkpointed 2**10 is clipped to the new cap, and stays there.
    assert float(state.opt_state.loss_scale) == 2.0**6


def test_restore_dynamic_checkpoint_under_static_scaling_uses_the_static_scale(checkpoint):
  """``static_loss_scaling(inner, 8.0)`` must scale by 8 after a restore, not by the saved scale."""
  _, _, clean = checkpoint
  tx = jmp.static_loss_scaling(optax.adamw(optax.cosine_decay_schedule(3e-3, STEPS)), 8.0)
  state = restore_under(checkpoint, tx)
  step = jmp.make_train_step(regression_loss, POLICY, donate=False)
  state, _ = step(state, clean)
  for _ in range(2):
    state, m = step(state, clean)
    assert float(m["loss_scale"]) == 8.0
    assert float(state.opt_state.loss_scale) == 8.0


def test_restore_static_checkpoint_under_dynamic_scaling(tmp_path):
  """Well defined: the static scale becomes the starting scale of the dynamic rule."""
  inner = optax.adamw(optax.cosine_decay_schedule(3e-3, STEPS))
  static = jmp.TrainState.create(params=make_params(), tx=jmp.static_loss_scaling(inner, 2.0**5))
  save(tmp_path / "static", static)
  tx = make_tx(growth_interval=2)
  state = restore(tmp_path / "static", jmp.TrainState.create(params=make_params(), tx=tx))
  assert float(state.opt_state.loss_scale) == 2.0**5
  clean = dict(make_batches(3)[1], poison=np.float32(1.0))
  step = jmp.make_train_step(regression_loss, POLICY, donate=False)
  scales = []
  for _ in range(4):
    state, m = step(state, clean)
    scales.append(float(m["loss_scale"]))
  assert scales == [2.0**5, 2.0**5, 2.0**6, 2.0**6]
  assert float(state.opt_state.loss_scale) == 2.0**7


@pytest.mark.parametrize(
    "make",
    [lambda: optax.adamw(1e-3), lambda: jmp.dynamic_loss_scaling(optax.sgd(0.1))],
    ids=["no-loss-scaling", "other-inner-optimizer"],
)
def test_restore_into_a_different_optimizer_is_a_clear_error(checkpoint, make):
  with pytest.raises(ValueError, match=r"tree structures do not match"):
    restore_under(checkpoint, make())


@pytest.mark.parametrize("template", ["create", "eval_shape"])
def test_equinox_module_and_state_resume_bit_for_bit(tmp_path, template):
  """Stock Equinox layers' static fields (MaxPool's -inf and its function, Dropout's p and
  flag) stay out of the checkpoint; eqx.nn.State (BatchNorm statistics) is in it."""
  zoo = zoo_models.equinox("vision")
  policy = jmp.get_policy("mixed_float16")
  build = lambda: jmp.TrainState.create(params=zoo.params, tx=make_tx(),
                                        model_state=zoo.model_state)
  state = build()
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
  assert state.params.pool.operation is zoo.params.pool.operation  # static, kept as is
  step = jmp.make_train_step(zoo.loss_fn, policy, donate=False)
  save_at = int(np.random.default_rng().integers(1, 8))
  for t in range(10):
    if t == save_at:
      save(tmp_path / "ckpt", state)
    state, _ = step(state, zoo.batch(t))
  uninterrupted = state

  target = build() if template == "create" else jax.eval_shape(build)
  resumed = restore(tmp_path / "ckpt", target)
  assert int(resumed.step) == save_at and resumed.params.dropout.p == 0.1
  step = jmp.make_train_step(zoo.loss_fn, policy)  # donating, like a real run
  for t in range(save_at, 10):
    resumed, _ = step(resumed, zoo.batch(t))
  print(f"saved and resumed at step {save_at}")
  assert_bit_equal(resumed, uninterrupted)
  assert_bitwise_equal(resumed.model_state, uninterrupted.model_state)


def test_tree_maps_over_a_state_with_static_fields_round_trip():
  """What a tree map puts in the array places (orbax args, shardings, bools) stays there."""
  zoo = zoo_models.equinox("vision")
  state = jmp.TrainState.create(params=zoo.params, tx=optax.adam(1e-3),
                                model_state=zoo.model_state)
  n = len(jax.tree.leaves(state))
  marks = jax.tree.map(lambda x: True, state)
  assert jax.tree.leaves(marks) == [True] * n
  assert marks.params.dropout.p == 0.1 and marks.params.conv.weight is True
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert ".params.conv.weight" in paths and not any("pool" in p for p in paths)

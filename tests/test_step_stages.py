"""The train step's stages one by one: cast, gradient, guard, write-back, model state, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal
from jmp_lite._src.step import stages

F16 = jmp.get_policy("mixed_float16")


def _linear_loss(params, batch):
  """sum(w * x) + b, in float32: d/dw = x, d/db = 1."""
  return (jnp.sum(params["w"] * batch["x"]) + params["b"]).astype(jnp.float32)


def _state(tx=None, **kwargs):
  params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.float32(0.25), "n": 7}
  return jmp.TrainState.create(params=params, tx=tx or optax.sgd(0.5), **kwargs)


BATCH = {"x": jnp.array([2.0, 4.0, -8.0]), "y": jnp.array([1, 2, 3], jnp.int32)}


def _gradients(config, state, scale):
  inputs = stages.cast_inputs(config, state, BATCH)
  return inputs, stages.scaled_gradient(config, inputs, jnp.float32(scale))


def test_cast_inputs_casts_params_and_floating_batch_leaves_never_model_state(maybe_jit):
  state = _state(model_state={"mean": jnp.ones(3), "count": 2})
  keep_b = jmp.Policy(jnp.float32, jnp.float16, jnp.float32, keep_full=("b",))
  config = stages.StepConfig(_linear_loss, keep_b, batch_policy=F16)
  inputs = maybe_jit(lambda s, b: stages.cast_inputs(config, s, b))(state, BATCH)
  assert (inputs.params["w"].dtype, inputs.params["b"].dtype) == (jnp.float16, jnp.float32)
  assert inputs.params["n"].dtype == jnp.int32 and int(inputs.params["n"]) == 7
  assert inputs.trained["w"].dtype == jnp.float32 and inputs.trained["n"] is None
  assert inputs.model_state["mean"].dtype == jnp.float32  # state, not compute (issue 21)
  assert inputs.model_state["count"].dtype == jnp.int32
  assert (inputs.batch["x"].dtype, inputs.batch["y"].dtype) == (jnp.float16, jnp.int32)
  assert inputs.params["w"].tolist() == [1.0, -2.0, 0.5]


def test_cast_inputs_without_batch_policy_or_model_state_passes_them_through():
  inputs = stages.cast_inputs(stages.StepConfig(_linear_loss, F16), _state(), BATCH)
  assert inputs.batch is BATCH and inputs.model_state is None


def test_cast_inputs_reads_bfloat16_masters_through_their_float32_view():
  state = _state(master_dtype=jnp.bfloat16)
  inputs = stages.cast_inputs(stages.StepConfig(_linear_loss, jmp.get_policy("f32")), state, BATCH)
  assert inputs.trained["w"].dtype == jnp.float32 and inputs.params["w"].dtype == jnp.float32


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_scaled_gradient_is_the_gradient_of_loss_times_scale(scale, maybe_jit):
  config = stages.StepConfig(_linear_loss, F16, batch_policy=F16)
  inputs, grads = maybe_jit(lambda s: _gradients(config, s, scale))(_state())
  assert grads.loss.dtype == jnp.float32 and float(grads.loss) == 2.0 - 8.0 - 4.0 + 0.25
  assert grads.grads["w"].dtype == jnp.float16  # The compute-dtype copy's gradient.
  assert grads.grads["w"].tolist() == [2.0 * scale, 4.0 * scale, -8.0 * scale]
  assert float(grads.grads["b"]) == scale and grads.grads["n"] is None
  assert grads.model_state is None and grads.aux is None


def test_scaled_gradient_splits_model_state_and_aux():
  def loss_fn(params, model_state, batch):
    loss = _linear_loss(params, batch)
    return loss, ({"count": model_state["count"] + 1}, {"double": 2 * loss})

  state = _state(model_state={"count": 5})
  config = stages.StepConfig(loss_fn, jmp.get_policy("f32"), has_aux=True)
  _, grads = _gradients(config, state, 1.0)
  assert int(grads.model_state["count"]) == 6 and float(grads.aux["double"]) == 2 * -9.75


@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_axis_name_accepts_the_static_batch_leaves_the_step_accepts(axis_name):
  seen = []

  def loss_fn(params, batch):
    seen.append((batch["split"], batch["scale"]))
    x = batch["x"] if axis_name is None else jax.lax.pmean(batch["x"], axis_name)
    return (jnp.sum(params["w"] * x) + params["b"]).astype(jnp.float32) * batch["scale"]

  config = stages.StepConfig(loss_fn, jmp.get_policy("f32"), axis_name=axis_name)
  inputs = stages.cast_inputs(config, _state(), dict(BATCH, split="train", scale=2.0))
  grads = stages.scaled_gradient(config, inputs, jnp.float32(1.0))
  assert seen == [("train", 2.0)] and float(grads.loss) == 2 * (2.0 - 8.0 - 4.0 + 0.25)
  assert grads.grads["w"].tolist() == [4.0, 8.0, -16.0]
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), axis_name=axis_name)
  state, metrics = step(_state(), dict(BATCH, split="train", scale=2.0))
  assert float(metrics["loss"]) == -19.5 and state.params["w"].tolist() == [-1.0, -6.0, 8.5]


@pytest.mark.parametrize("autocast", [False, True])
def test_a_loss_fn_without_the_model_state_argument_is_named(autocast):
  state = _state(model_state={"count": jnp.int32(0)})
  step = jmp.make_train_step(_linear_loss, F16, autocast=autocast)
  expected = (r"the state has a model_state, so the step calls loss_fn\(params, model_state, "
              r"batch\), but loss_fn\(params, batch\) cannot take those three arguments "
              r"\(too many positional arguments\); add the model_state argument")
  with pytest.raises(TypeError, match=expected):
    step(state, BATCH)
  with pytest.raises(TypeError, match=r"the state has no model_state, so the step calls "
                     r"loss_fn\(params, batch\), but loss_fn\(params, model_state, batch\) "
                     r"cannot take those two arguments .*pass model_state= to TrainState.create"):
    jmp.make_train_step(lambda params, model_state, batch: 0.0, F16)(_state(), BATCH)


def test_a_loss_fn_taking_args_or_raising_its_own_type_error_is_called_as_it_is():
  def with_args(*args):
    params, model_state, batch = args
    return _linear_loss(params, batch), model_state

  state = _state(model_state={"count": jnp.int32(0)})
  _, metrics = jmp.make_train_step(with_args, F16)(state, BATCH)
  assert float(metrics["loss"]) == -9.75

  def raises(params, batch):
    raise TypeError("my own message")

  with pytest.raises(TypeError, match="^my own message"):
    jmp.make_train_step(raises, F16)(_state(), BATCH)


def test_scaled_gradient_refuses_a_bad_loss():
  config = stages.StepConfig(lambda p, b: jnp.ones(2), F16)
  with pytest.raises(TypeError, match=r"float scalar loss; got shape \(2,\)"):
    _gradients(config, _state(), 1.0)


@pytest.mark.parametrize(
    "make_tx",
    [lambda: optax.sgd(0.5), lambda: jmp.static_loss_scaling(optax.sgd(0.5), 4.0)],
    ids=["plain", "scaler"],
)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "skipped"])
def test_guarded_update_and_write_back(make_tx, bad):
  state = _state(make_tx())
  config = stages.StepConfig(_linear_loss, jmp.get_policy("f32"))
  scale = jmp.loss_scale_of(state.opt_state)
  inputs, grads = _gradients(config, state, scale)
  if bad:
    grads = grads._replace(grads=dict(grads.grads, w=grads.grads["w"].at[1].set(jnp.inf)))
  guard, opt_state = stages.guarded_update(config, state, inputs, grads)
  assert bool(guard.finite) is not bad
  new = stages.write_back(state, guard, opt_state)
  assert int(new.step) == 1 and new.compensation is None and int(new.params["n"]) == 7
  if bad:
    assert_bitwise_equal(new.params, state.params)
    scaler = isinstance(state.opt_state, jmp.LossScaleState)
    inner = [s.inner_state if scaler else s for s in (new.opt_state, state.opt_state)]
    assert_bitwise_equal(*inner)  # Only the scaler's skip counter moves.
    if scaler:
      assert int(jmp.skipped_steps_of(new.opt_state)) == 1
    else:  # A plain tx counts nothing, and says so.
      with pytest.raises(ValueError, match="found no loss-scaling state"):
        jmp.skipped_steps_of(new.opt_state)
  else:
    assert new.params["w"].tolist() == [1.0 - 1.0, -2.0 - 2.0, 0.5 + 4.0]
    assert float(new.params["b"]) == 0.25 - 0.5
    assert float(guard.sumsq) == 4.0 + 16.0 + 64.0 + 1.0


def test_guarded_update_passes_extra_args_to_tx():
  seen = {}

  def update(updates, state, params=None, **extra):
    seen.update(extra)
    return updates, state

  tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  state = _state(tx)
  config = stages.StepConfig(_linear_loss, jmp.get_policy("f32"),
                             extra_args=lambda loss, aux, batch: {"x0": batch["x"][0]})
  inputs, grads = _gradients(config, state, 1.0)
  stages.guarded_update(config, state, inputs, grads)
  assert float(seen["value"]) == -9.75 and float(seen["x0"]) == 2.0


def test_write_back_rounds_bfloat16_masters_like_apply_updates():
  state = _state(master_dtype=jnp.bfloat16, rounding="kahan")
  config = stages.StepConfig(_linear_loss, jmp.get_policy("f32"))
  inputs, grads = _gradients(config, state, 1.0)
  guard, opt_state = stages.guarded_update(config, state, inputs, grads)
  assert guard.params is None  # bfloat16 masters are not updated inside the guard.
  new = stages.write_back(state, guard, opt_state)
  trained = ("w", "b")
  expected, compensation = jmp.apply_updates(
      {k: state.params[k] for k in trained}, {k: guard.updates[k] for k in trained},
      rounding="kahan", compensation={k: state.compensation[k] for k in trained})
  assert_bitwise_equal({k: new.params[k] for k in trained}, expected)
  assert_bitwise_equal({k: new.compensation[k] for k in trained}, compensation)
  assert int(new.params["n"]) == 7 and new.compensation["n"] is None
  assert new.params["w"].dtype == jnp.bfloat16 and int(new.step) == 1


@pytest.mark.parametrize("finite", [True, False])
def test_next_model_state_is_stored_in_its_dtypes_and_kept_when_skipped(finite, maybe_jit):
  state = _state(model_state={"mean": jnp.array([1.5, 2.5]), "count": 3})
  new = {"mean": jnp.array([3.0, 4.0], jnp.float16), "count": jnp.int32(4)}
  out = maybe_jit(stages.next_model_state)(state, new, jnp.asarray(finite))
  assert out["mean"].dtype == jnp.float32
  expected = new if finite else state.model_state
  np.testing.assert_array_equal(out["mean"], expected["mean"])
  assert int(out["count"]) == int(expected["count"])
  assert stages.next_model_state(_state(), None, jnp.asarray(True)) is None


@pytest.mark.parametrize("finite", [True, False])
def test_integer_model_state_returned_in_another_dtype_is_stored_in_its_own(finite, maybe_jit):
  # An NNX-style uint32 counter that loss_fn returns as int32 (and a bool flag as int).
  state = _state(model_state={"count": jnp.uint32(3), "seen": jnp.array([True, False])})
  new = {"count": jnp.int32(4), "seen": jnp.array([1, 1], jnp.int8)}
  out = maybe_jit(stages.next_model_state)(state, new, jnp.asarray(finite))
  assert (out["count"].dtype, out["seen"].dtype) == (jnp.uint32, jnp.bool_)
  assert int(out["count"]) == (4 if finite else 3)
  assert out["seen"].tolist() == ([True, True] if finite else [True, False])


@pytest.mark.parametrize("new, got", [
    ({"count": jnp.float32(4.0)}, r"float32\[\]"),
    ({"count": jnp.zeros(2, jnp.uint32)}, r"uint32\[2\]"),
    ({"count": jax.random.key(0)}, r"key<fry>\[\]"),
], ids=["float", "shape", "key"])
def test_a_model_state_leaf_that_cannot_be_stored_is_named(new, got):
  state = _state(model_state={"count": jnp.uint32(3)})
  expected = rf"loss_fn returned model state leaf 'count' as {got}, .* its state's uint32\[\]"
  with pytest.raises(TypeError, match=expected):
    jax.jit(stages.next_model_state)(state, new, jnp.asarray(True))


def test_the_step_stores_an_nnx_style_counter_in_its_dtype():
  def loss_fn(params, model_state, batch):
    count = model_state["count"].astype(jnp.int32) + 1  # Comes back int32.
    return _linear_loss(params, batch) * batch["ok"], {"count": count}

  state = _state(model_state={"count": jnp.uint32(0)})
  step = jmp.make_train_step(loss_fn, F16)
  for ok in (1.0, jnp.nan, 1.0):
    state, metrics = step(state, dict(BATCH, ok=jnp.float32(ok)))
  assert state.model_state["count"].dtype == jnp.uint32 and int(state.model_state["count"]) == 2


def test_next_model_state_refuses_another_structure():
  state = _state(model_state={"mean": jnp.ones(2)})
  with pytest.raises(TypeError, match="model state of another structure"):
    stages.next_model_state(state, {"mean": jnp.ones(2), "extra": jnp.ones(2)}, jnp.asarray(True))


def test_step_metrics_report_the_loss_the_guard_and_nonfinite_leaves():
  state = _state()
  config = stages.StepConfig(_linear_loss, F16, has_aux=False, track_nonfinite=True)
  inputs, grads = _gradients(config, state, 2.0)
  grads = grads._replace(grads=dict(grads.grads, b=jnp.float16(jnp.nan)))
  guard, _ = stages.guarded_update(config, state, inputs, grads)
  metrics = stages.step_metrics(config, jnp.float32(2.0), inputs, grads, guard)
  assert set(metrics) == {"loss", "grads_finite", "loss_scale", "grad_norm", "nonfinite"}
  assert float(metrics["loss"]) == -9.75 and float(metrics["loss_scale"]) == 2.0
  assert not bool(metrics["grads_finite"]) and np.isnan(float(metrics["grad_norm"]))
  nonfinite = {k: bool(v) for k, v in metrics["nonfinite"].items()}
  assert nonfinite == {"w": False, "b": True, "n": False}


def test_consecutive_skips_counts_the_current_run_as_a_device_array():
  tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**4, min_scale=1.0)
  state = jmp.TrainState.create(params={"w": jnp.ones(3)}, tx=tx)
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b), jmp.get_policy("mixed_float16"))
  good, bad = jnp.ones(3), jnp.array([1.0, jnp.nan, 1.0])
  counts = []
  for batch in (good, bad, bad, bad, good, bad):
    state, metrics = step(state, batch)
    assert isinstance(metrics["consecutive_skips"], jax.Array)
    counts.append(metrics["consecutive_skips"])
  assert [int(c) for c in counts] == [0, 1, 2, 3, 0, 1]
  assert metrics["consecutive_skips"].dtype == jnp.int32
  plain = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b), jmp.get_policy("mixed_bfloat16"))
  _, metrics = plain(jmp.TrainState.create(params={"w": jnp.ones(3)}, tx=optax.sgd(0.1)), good)
  assert "consecutive_skips" not in metrics  # no loss-scaling state, nothing to count


@pytest.mark.parametrize("finite", [True, False])
def test_next_model_state_keeps_static_leaves_as_they_are(finite, maybe_jit):
  # Issue 31 item 2: a function and a string tag in the model state went through
  # the skip's lax.cond ("not a valid JAX type").
  state = _state(model_state={"mean": jnp.array([1.5, 2.5]), "act": jax.nn.relu, "tag": "ema"})

  def store(state, mean, finite):
    new = {"mean": mean, "act": jax.nn.relu, "tag": "ema"}
    # In a TrainState, as the step returns it (a jit output holds no function).
    return state.replace(model_state=stages.next_model_state(state, new, finite))

  out = maybe_jit(store)(state, jnp.array([3.0, 4.0]), jnp.asarray(finite)).model_state
  assert out["act"] is jax.nn.relu and out["tag"] == "ema"
  assert out["mean"].tolist() == ([3.0, 4.0] if finite else [1.5, 2.5])


@pytest.mark.parametrize("returned, got", [
    ("eval", r"'eval'"),
    (jnp.float32(0.5), r"float32\[\]"),
    (jax.nn.gelu, r"<.*gelu.*>"),
], ids=["string", "array", "function"])
def test_a_changed_static_model_state_leaf_is_named(returned, got):
  state = _state(model_state={"mean": jnp.ones(2), "tag": "train"})
  expected = (rf"loss_fn returned model state leaf 'tag' as {got}, but the state holds it as "
              r"the static \(non-array\) value 'train'\..*Return the state's own value")
  with pytest.raises(TypeError, match=expected):
    stages.next_model_state(state, {"mean": jnp.ones(2), "tag": returned}, jnp.asarray(True))

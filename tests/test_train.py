"""The train step: numerics against an fp32 reference, skipping, state, errors, orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal
from conftest import classifier_batch
from conftest import classifier_loss
from conftest import classifier_params
from conftest import host

DTYPES = {
    "float32": (jnp.float32, 1e-5),
    "bfloat16": (jnp.bfloat16, 3e-2),
    "float16": (jnp.float16, 5e-3),
}


def poison(batch, index=(3, 2)):
  return dict(batch, x=batch["x"].at[index].set(jnp.nan))


def inner_adam_state(opt_state):
  """The ScaleByAdamState inside dynamic_loss_scaling(optax.adam(...))."""
  adam_state, = [
      s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
      if isinstance(s, optax.ScaleByAdamState)
  ]
  return adam_state


@pytest.mark.parametrize("name", list(DTYPES))
def test_step_matches_fp32_reference(name):
  compute_dtype, tol = DTYPES[name]
  seen = []

  def loss_fn(params, batch):
    seen.append((jax.tree.map(lambda p: p.dtype, params), batch["x"].dtype, batch["y"].dtype))
    return classifier_loss(params, batch)

  params, batch = classifier_params(), classifier_batch()
  ref_loss, ref_grads = jax.value_and_grad(classifier_loss)(params, batch)
  # sgd(1.0) turns the update into -grads, so the step's gradients can be read
  # off the params.
  tx = jmp.static_loss_scaling(optax.sgd(1.0), 2.0**7)
  state = jmp.TrainState.create(params=params, tx=tx)
  policy = jmp.Policy(jnp.float32, compute_dtype, jnp.float32)
  step = jmp.make_train_step(loss_fn, policy, donate=False)
  new_state, metrics = step(state, batch)

  # donate=False keeps the input state alive.
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  (param_dtypes, x_dtype, y_dtype), = seen  # Traced once.
  assert all(d == compute_dtype for d in jax.tree.leaves(param_dtypes))
  assert x_dtype == compute_dtype and y_dtype == jnp.int32  # Labels are not cast.
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new_state.params))
  grads = jax.tree.map(lambda old, new: old - new, state.params, new_state.params)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    scale = float(jnp.abs(r).max())
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * scale)
  assert metrics["loss"].dtype == jnp.float32 and metrics["loss"].shape == ()
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=tol)
  assert metrics["grad_norm"].dtype == jnp.float32
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(ref_grads), rtol=tol)
  assert float(metrics["loss_scale"]) == 2.0**7
  assert metrics["grads_finite"].dtype == jnp.bool_ and bool(metrics["grads_finite"])


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_small_updates_accumulate_in_fp32_masters(name):
  # 1 - 1e-4 rounds back to 1 in bf16 and f16: the updates survive only because
  # gradients are taken with respect to, and applied to, the float32 masters.
  def loss_fn(params, batch):
    assert params["w"].dtype == batch["x"].dtype == DTYPES[name][0]
    return jnp.sum(params["w"] * batch["x"]).astype(jnp.float32)

  tx = jmp.static_loss_scaling(optax.sgd(1.0), 2.0**10)
  state = jmp.TrainState.create(params={"w": jnp.ones(4, DTYPES[name][0])}, tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.Policy(jnp.float32, DTYPES[name][0], jnp.float32))
  for _ in range(10):
    state, metrics = step(state, {"x": jnp.full(4, 1e-4)})
  assert state.params["w"].dtype == jnp.float32
  np.testing.assert_allclose(state.params["w"], 1.0 - 10 * float(DTYPES[name][0](1e-4)), rtol=1e-6)
  assert float(jnp.asarray(1.0 - 1e-4, DTYPES[name][0])) == 1.0


def test_adam_training_follows_the_fp32_reference():
  params, batch = classifier_params(), classifier_batch()
  opt = optax.adam(1e-2)
  ref_params, ref_opt = params, opt.init(params)

  @jax.jit
  def ref_step(p, s):
    loss, g = jax.value_and_grad(classifier_loss)(p, batch)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  state = jmp.TrainState.create(params=params, tx=jmp.dynamic_loss_scaling(opt, init_scale=2.0**8))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("p=f32,c=f32"))
  losses = []
  for _ in range(5):
    ref_params, ref_opt, ref_loss = ref_step(ref_params, ref_opt)
    state, metrics = step(state, batch)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    losses.append(float(metrics["loss"]))
  for p, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-6)
  assert losses[-1] < losses[0]


def test_poisoned_batch_skips_the_step_bit_for_bit():
  schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
  inner = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(schedule))
  tx = jmp.dynamic_loss_scaling(inner, init_scale=2.0**10, growth_interval=100)
  state = jmp.TrainState.create(params=classifier_params(), tx=tx)
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"))
  batch = classifier_batch()
  for _ in range(2):
    old = state
    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"])
    # Donation is on by default: the old state's buffers are gone. (A live
    # zero-copy NumPy view, np.asarray(x) on CPU, would keep them alive.)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))

  before = host(state)
  scale = float(jmp.loss_scale_of(state.opt_state))
  state, metrics = step(state, poison(batch))
  assert not bool(metrics["grads_finite"])
  assert float(metrics["loss_scale"]) == scale  # The scale this step used.
  assert_bitwise_equal(state.params, before.params)
  # Adam's moments and count, and the schedule's count, did not advance.
  assert_bitwise_equal(state.opt_state.inner_state, before.opt_state.inner_state)
  adam_state = inner_adam_state(state.opt_state)
  schedule_state = state.opt_state.inner_state[1]
  assert int(adam_state.count) == 2 and int(schedule_state.count) == 2
  assert float(jmp.loss_scale_of(state.opt_state)) == scale / 2
  assert int(jmp.skipped_steps_of(state.opt_state)) == 1
  assert int(state.step) == 3  # step counts calls, skipped ones included.

  state, metrics = step(state, batch)  # Training resumes at the halved scale.
  assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == scale / 2
  assert int(inner_adam_state(state.opt_state).count) == 3
  assert int(state.opt_state.inner_state[1].count) == 3
  assert not np.array_equal(state.params["w1"], before.params["w1"])


def test_plain_optax_tx_refuses_non_finite_gradients():
  state = jmp.TrainState.create(params=classifier_params(), tx=optax.adam(1e-2))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"))
  batch = classifier_batch()
  state, metrics = step(state, batch)
  assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 1.0
  before = host(state)
  state, metrics = step(state, poison(batch))
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.params, before.params)
  assert_bitwise_equal(state.opt_state, before.opt_state)
  assert jmp.all_finite(state.params)
  state, metrics = step(state, batch)
  assert bool(metrics["grads_finite"])
  assert int(inner_adam_state(state.opt_state).count) == 2


def test_loss_scaling_nested_in_a_chain_is_refused():
  # Nested, the scaler would see chained or accumulated updates and the step
  # would have to trust it: refused with a message that says what to do.
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)
  with pytest.raises(ValueError, match=r"not outermost: its state is at opt_state\[0\].*"
                     r"jmp.dynamic_loss_scaling\(optax.chain"):
    jmp.TrainState.create(params=classifier_params(), tx=optax.chain(tx))


def test_non_floating_params_pass_through_untouched():
  seen = {}

  def loss_fn(params, batch):
    seen["count"] = params["count"].dtype
    seen["key"] = params["key"].dtype
    noise = jax.random.normal(params["key"], batch["x"].shape, batch["x"].dtype)
    scale = params["count"].astype(batch["x"].dtype)
    return classifier_loss(params["mlp"], dict(batch, x=batch["x"] + 0.01 * scale * noise))

  params = {"mlp": classifier_params(), "count": jnp.int32(7), "key": jax.random.key(3)}
  state = jmp.TrainState.create(params=params, tx=jmp.dynamic_loss_scaling(optax.adam(1e-2)))
  adam_state = inner_adam_state(state.opt_state)
  assert adam_state.mu["count"] is None and adam_state.mu["key"] is None
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), track_nonfinite=True)
  key_data = np.asarray(jax.random.key_data(params["key"]))
  for _ in range(3):
    state, metrics = step(state, classifier_batch())
  assert seen["count"] == jnp.int32 and jax.dtypes.issubdtype(seen["key"], jax.dtypes.prng_key)
  assert state.params["count"].dtype == jnp.int32 and int(state.params["count"]) == 7
  np.testing.assert_array_equal(jax.random.key_data(state.params["key"]), key_data)
  assert not bool(metrics["nonfinite"]["count"]) and not bool(metrics["nonfinite"]["key"])
  assert int(state.step) == 3


def test_has_aux_and_track_nonfinite_mark_the_bad_leaf():
  def loss_fn(params, batch):
    out = jnp.sum(params["a"] * batch["x"]) + jnp.sum(params["b"] * batch["z"])
    out = out + jnp.sum(params["c"] ** 2)
    return out.astype(jnp.float32), {"z_sum": jnp.sum(batch["z"]), "n": batch["n"]}

  params = {"a": jnp.arange(3.0), "b": jnp.ones(3), "c": jnp.full(2, 0.5), "i": jnp.int32(1)}
  tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=4.0)
  state = jmp.TrainState.create(params=params, tx=tx)
  step = jmp.make_train_step(
      loss_fn, jmp.get_policy("mixed_float16"), has_aux=True, track_nonfinite=True
  )
  batch = {"x": jnp.linspace(-1.0, 1.0, 3), "z": jnp.array([1.0, 2.0, 3.0]), "n": jnp.int32(5)}
  state, metrics = step(state, batch)
  assert float(metrics["aux"]["z_sum"]) == 6.0 and metrics["aux"]["z_sum"].dtype == jnp.float16
  assert int(metrics["aux"]["n"]) == 5
  clean = {"a": False, "b": False, "c": False, "i": False}
  assert jax.tree.map(bool, metrics["nonfinite"]) == clean

  before = host(state.params)
  state, metrics = step(state, dict(batch, z=batch["z"].at[1].set(jnp.inf)))
  assert jax.tree.map(bool, metrics["nonfinite"]) == dict(clean, b=True)
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.params, before)


def test_no_retrace_and_stable_state_across_steps_including_skips():
  traces = []

  def loss_fn(params, batch):
    traces.append(1)
    return classifier_loss(params, batch)

  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**4, growth_interval=2)
  state = jmp.TrainState.create(params=classifier_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
  batch = classifier_batch()
  spec = jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), state)
  for b in [batch, batch, poison(batch), batch, poison(batch), poison(batch), batch]:
    state, _ = step(state, b)
    assert jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), state) == spec
  assert len(traces) == 1
  assert int(state.step) == 7 and int(jmp.skipped_steps_of(state.opt_state)) == 3


def test_train_state_create_makes_fp32_masters():
  params = {
      "bf16": jnp.ones(3, jnp.bfloat16),
      "f16_numpy": np.full(2, 0.5, np.float16),
      "f32": jnp.arange(2.0),
      "f64_numpy": np.linspace(0.0, 1.0, 3),  # float64; x64 is off, so float32.
      "python": 1.5,
      "count": jnp.int32(4),
      "flag": True,
  }
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1))
  assert state.step.dtype == jnp.int32 and int(state.step) == 0
  p = state.params
  for name in ("bf16", "f16_numpy", "f32", "f64_numpy", "python"):
    assert isinstance(p[name], jax.Array) and p[name].dtype == jnp.float32, name
  np.testing.assert_array_equal(p["f16_numpy"], [0.5, 0.5])
  assert float(p["python"]) == 1.5
  # Python numbers become strong arrays, and every array is the state's own copy.
  assert p["count"] is not params["count"] and p["count"].dtype == jnp.int32
  assert int(p["count"]) == 4
  assert p["flag"].dtype == jnp.bool_ and bool(p["flag"]) is True
  assert not any(x.weak_type for x in jax.tree.leaves(p))
  assert jax.tree.leaves(state.opt_state) == []  # sgd without momentum has no state.

  def loss_fn(params, batch):
    del batch
    return jnp.sum(params["bf16"] ** 2) + params["python"] ** 2

  state, _ = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"))(state, {})
  assert state.params["bf16"].dtype == jnp.float32
  np.testing.assert_allclose(state.params["bf16"], 0.8)
  np.testing.assert_allclose(state.params["python"], 1.2)  # A Python float is trained too.


@pytest.mark.parametrize(
    "loss_fn, has_aux, what",
    [
        (lambda p, b: jnp.sum(p["w"] * b["x"], axis=0), False, r"shape \(3,\) dtype bfloat16"),
        (lambda p, b: jnp.sum(p["w"] * b["x"]).astype(jnp.int32), False, "dtype int32"),
        (lambda p, b: 1.0, False, "class 'float'"),
        (lambda p, b: (jnp.sum(p["w"] * b["x"], axis=0), 0), True, r"\(loss, aux\)"),
    ],
    ids=["vector", "int", "python-float", "vector-with-aux"],
)
def test_loss_must_be_a_float_scalar(loss_fn, has_aux, what):
  state = jmp.TrainState.create(params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), has_aux=has_aux)
  with pytest.raises(TypeError, match="scalar") as info:
    step(state, {"x": jnp.ones((2, 3))})
  assert info.match(what)


def test_has_aux_needs_a_pair():
  state = jmp.TrainState.create(params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"]), jmp.get_policy("f32"), has_aux=True)
  with pytest.raises(TypeError, match=r"has_aux=True .* pair; got an array of shape \(\)"):
    step(state, {})
  def triple(params, batch):
    del batch
    return jnp.sum(params["w"]), 1, 2

  step = jmp.make_train_step(triple, jmp.get_policy("f32"), has_aux=True)
  with pytest.raises(TypeError, match=r"\(loss, aux\) pair; got a tuple of length 3"):
    step(state, {})


def test_orbax_checkpoint_resumes_bit_for_bit(tmp_path):
  tx = jmp.dynamic_loss_scaling(
      optax.chain(
          optax.clip_by_global_norm(1.0), optax.adamw(optax.cosine_decay_schedule(1e-2, 10))
      ),
      init_scale=2.0**12,
      growth_interval=2,
  )
  params = dict(classifier_params(), count=jnp.int32(2))

  def loss_fn(params, batch):
    return classifier_loss({k: v for k, v in params.items() if k != "count"}, batch)

  def fresh():
    return jmp.TrainState.create(params=jax.tree.map(jnp.copy, params), tx=tx)

  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
  batches = [classifier_batch(seed=i) for i in range(6)]
  batches[4] = poison(batches[4])

  state = fresh()
  for b in batches:
    state, _ = step(state, b)
  uninterrupted = host(state)

  state = fresh()
  for b in batches[:3]:
    state, _ = step(state, b)
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    template = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh())
    restored = ckptr.restore(path, template)
    abstract = ckptr.restore(path, jax.eval_shape(fresh))
  assert isinstance(restored, jmp.TrainState) and restored.tx is template.tx
  assert_bitwise_equal(restored, state)
  assert_bitwise_equal(abstract, state)
  assert int(restored.step) == 3

  for b in batches[3:]:
    restored, _ = step(restored, b)
  assert int(jmp.skipped_steps_of(restored.opt_state)) == 1
  assert_bitwise_equal(restored, uninterrupted)


# --------------------------------------------------------------- issue 11 (hardening, round 2)


def _scaler():
  return jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)


@pytest.mark.parametrize("make_tx,where", [
    (lambda: optax.MultiSteps(_scaler(), 2), r"opt_state.inner_opt_state"),
    (lambda: optax.chain(optax.scale_by_adam(), jmp.dynamic_loss_scaling(optax.scale(-1e-2))),
     r"opt_state\[1\]"),
    (lambda: optax.multi_transform({"a": _scaler(), "b": _scaler()},
                                   {"w1": "a", "b1": "b", "w2": "b"}),
     r"2 loss-scaling states"),
    (lambda: jmp.dynamic_loss_scaling(_scaler()), r"2 loss-scaling states"),
])
def test_misplaced_or_duplicated_scalers_are_refused(make_tx, where):
  tx = make_tx()
  with pytest.raises(ValueError, match=where + r".*Put the loss scaling outermost"):
    jmp.TrainState.create(params=classifier_params(), tx=tx)
  # A state built by hand is refused by the step, at trace time.
  params = classifier_params()
  state = jmp.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                         tx=tx)
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"), donate=False)
  with pytest.raises(ValueError, match=r"Put the loss scaling outermost"):
    step(state, classifier_batch())


def test_plain_multisteps_keeps_the_steps_guard():
  # Without a scaler the step guards MultiSteps itself: a NaN micro-batch never
  # reaches the accumulator, and training continues.
  state = jmp.TrainState.create(params=classifier_params(), tx=optax.MultiSteps(optax.adam(1e-2), 2))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"))
  batch = classifier_batch()
  finite = []
  for b in [batch, poison(batch), batch, batch, batch]:
    state, metrics = step(state, b)
    finite.append(bool(metrics["grads_finite"]))
    assert jmp.all_finite(state.opt_state.acc_grads)
  assert finite == [True, False, True, True, True]
  assert int(state.opt_state.gradient_step) == 2  # Two full accumulations applied.


@pytest.mark.parametrize("tx", ["scaled", "plain"])
def test_a_nan_loss_without_a_nan_gradient_skips(tx):
  def loss_fn(params, batch):
    return classifier_loss(params, batch) + jax.lax.stop_gradient(batch["bad"])

  tx = _scaler() if tx == "scaled" else optax.adam(1e-2)
  state = jmp.TrainState.create(params=classifier_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
  before = host(state)
  state, metrics = step(state, dict(classifier_batch(), bad=jnp.float32(jnp.nan)))
  assert np.isnan(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.params, before.params)
  inner = lambda s: s.inner_state if isinstance(s, jmp.LossScaleState) else s  # noqa: E731
  assert_bitwise_equal(inner(state.opt_state), inner(before.opt_state))
  state, metrics = step(state, dict(classifier_batch(), bad=jnp.float32(0.0)))
  assert bool(metrics["grads_finite"])


def test_float64_masters_unscale_and_reduce_in_float64():
  with jax.enable_x64(True):
    def loss_fn(params, batch):
      return jnp.sum(params["w"] * batch["c"])

    params = {"w": jnp.ones(3, jnp.float64)}
    c = jnp.array([1e-50, 1e-12, 1e20], jnp.float64)
    for tx in (jmp.dynamic_loss_scaling(optax.sgd(1.0), init_scale=2.0**10), optax.sgd(1.0)):
      state = jmp.TrainState.create(params=params, tx=tx)
      step = jmp.make_train_step(loss_fn, jmp.get_policy("f64"), donate=False)
      new, metrics = step(state, {"c": c})
      # A norm of 1e20 does not overflow float64: the step is applied, exactly.
      assert bool(metrics["grads_finite"]) and metrics["grad_norm"].dtype == jnp.float64
      np.testing.assert_array_equal(new.params["w"], 1.0 - c)
      assert float(new.params["w"][0]) == 1.0 - 1e-50 and float(new.params["w"][1]) == 1 - 1e-12
      assert float(metrics["grad_norm"]) == pytest.approx(1e20, rel=1e-12)


def test_batch_keep_full_keeps_large_targets_in_float32():
  def loss_fn(params, batch):
    pred = (batch["x"] @ params["w"]).astype(jnp.float32)
    return jnp.mean((pred - batch["y"].astype(jnp.float32) / 1e5) ** 2)

  x = jax.random.normal(jax.random.key(0), (32, 4))
  batch = {"x": x, "y": 1e5 * (x @ jnp.array([1.0, -1.0, 0.5, 2.0]))[:, None]}  # up to ~5e5
  policy = jmp.get_policy("mixed_float16")
  runs = {}
  for name, kwargs in [("cast", {}), ("keep", {"batch_keep_full": ("y",)}),
                       ("uncast", {"cast_batch": False, "warn_no_half": False})]:  # f32 x @ w
    tx = jmp.dynamic_loss_scaling(optax.adam(0.1), init_scale=2.0**10)
    state = jmp.TrainState.create(params={"w": jnp.zeros((4, 1))}, tx=tx)
    step = jmp.make_train_step(loss_fn, policy, **kwargs)
    for _ in range(100):
      state, metrics = step(state, batch)
    runs[name] = (float(metrics["loss"]), int(jmp.skipped_steps_of(state.opt_state)))
  assert np.isinf(runs["cast"][0]) or runs["cast"][1] == 100  # Targets above 65504 are inf.
  for name in ("keep", "uncast"):
    assert runs[name][1] == 0 and runs[name][0] < 0.05, runs


def test_keep_rules_that_select_nothing_warn_once_per_compile():
  def loss_fn(params, batch):
    return classifier_loss(params, batch)

  policy = jmp.get_policy("mixed_float16").with_keep_full("BatchNorm", "b1")
  state = jmp.TrainState.create(params=classifier_params(), tx=optax.sgd(0.1))
  step = jmp.make_train_step(loss_fn, policy, batch_keep_full=("targets",))
  with pytest.warns(UserWarning) as record:
    for _ in range(3):
      state, _ = step(state, classifier_batch())
  messages = sorted(str(w.message) for w in record)
  assert len(messages) == 2, messages  # One trace; "b1" selects a leaf.
  assert messages[0].startswith(
      "keep rule 'BatchNorm' of the policy selects no floating leaf of params, "
      "so it keeps nothing in float32. NNX (and Equinox) names are snake_case")
  assert messages[0].endswith("The floating leaves are, e.g.: 'b1', 'w1', 'w2'")
  assert messages[1] == ("keep rule 'targets' of batch_keep_full selects no floating leaf of "
                         "batch, so it keeps nothing in float32. The floating leaves are, e.g.: 'x'")


def test_donation_problems_are_named():
  z = jnp.zeros(3)
  tx = optax.sgd(0.1)
  loss_fn = lambda p, b: jnp.sum(p["a"] * b["x"]) + jnp.sum(p["b"])  # noqa: E731
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"))
  aliased = jmp.TrainState(step=jnp.zeros((), jnp.int32), params={"a": z, "b": z},
                           opt_state=tx.init({"a": z, "b": z}), tx=tx)
  with pytest.raises(ValueError, match=r"state.params\['a'\] and state.params\['b'\] are the "
                     r"same array.*donate=False"):
    step(aliased, {"x": jnp.ones(3)})
  # TrainState.create copies, so the same leaves work there.
  state = jmp.TrainState.create(params={"a": z, "b": z}, tx=tx)
  with pytest.raises(ValueError, match=r"state.params\['a'\] and batch\['x'\] are the same array"):
    step(state, {"x": state.params["a"]})
  new, _ = step(state, {"x": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"state.step was deleted.*state each call returns.*"
                     r"donate=False"):
    step(state, {"x": jnp.ones(3)})
  assert z.is_deleted() is False and int(new.step) == 1


def test_caller_arrays_survive_donating_steps():
  params = classifier_params()
  state = jmp.TrainState.create(params=params, tx=_scaler())
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"))
  for _ in range(3):
    state, _ = step(state, classifier_batch())
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))
  np.testing.assert_array_equal(params["w1"], classifier_params()["w1"])


@pytest.mark.parametrize("donate", [True, False])
def test_the_state_owns_the_callers_numpy_int_and_bool_arrays(donate):
  # Issue 31 item 1: an index buffer, a mask and a counter that the caller (a
  # data pipeline) writes into after TrainState.create must not change the state.
  idx, mask, count = np.array([0, 2], np.int32), np.array([True, False]), np.int32(5)

  def loss_fn(params, model_state, batch):
    picked = jnp.where(model_state["mask"], params["w"][params["idx"]], 0.0)
    return jnp.sum(picked * batch), {"mask": model_state["mask"], "count": model_state["count"] + 1}

  state = jmp.TrainState.create(params={"w": jnp.array([1.0, 2.0, 3.0]), "idx": idx},
                                tx=optax.sgd(0.5), model_state={"mask": mask, "count": count})
  for leaf in (state.params["idx"], state.model_state["mask"], state.model_state["count"]):
    assert isinstance(leaf, jax.Array)
  idx[:] = [1, 1]
  mask[:] = [False, True]
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), donate=donate)
  state, metrics = step(state, jnp.float32(2.0))
  assert float(metrics["loss"]) == 2.0  # w[0] * 2, with the index and mask as they were given
  assert state.params["w"].tolist() == [0.0, 2.0, 3.0]
  assert state.params["idx"].tolist() == [0, 2] and state.model_state["mask"].tolist() == [True, False]
  assert int(state.model_state["count"]) == 6 and state.model_state["count"].dtype == jnp.int32


@pytest.mark.parametrize("make_tx", [
    optax.contrib.prodigy, optax.contrib.cocob, lambda: optax.contrib.mechanize(optax.sgd(0.1)),
], ids=["prodigy", "cocob", "mechanize"])
def test_optimizers_that_keep_the_params_in_their_state_run_donating(make_tx):
  # Their state holds the initial params: TrainState.create copies what tx.init
  # shares with the state's params, so the donating step does not donate twice.
  state = jmp.TrainState.create(params=classifier_params(), tx=make_tx())
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"))
  losses = []
  for _ in range(3):
    state, metrics = step(state, classifier_batch())
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)) and bool(metrics["grads_finite"]) and int(state.step) == 3


def test_the_callers_hyperparameter_arrays_survive_donating_steps():
  lr = jnp.float32(1e-2)
  tx = jmp.dynamic_loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=lr))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"))
  first = jmp.TrainState.create(params=classifier_params(), tx=tx)
  first, _ = step(first, classifier_batch())
  assert not lr.is_deleted() and float(lr) == np.float32(1e-2)
  second = jmp.TrainState.create(params=classifier_params(), tx=tx)  # The same tx again.
  for _ in range(2):
    second, metrics = step(second, classifier_batch())
  assert bool(metrics["grads_finite"]) and not lr.is_deleted()
  hyperparams = second.opt_state.inner_state.hyperparams
  assert float(hyperparams["learning_rate"]) == np.float32(1e-2)


@pytest.mark.parametrize("tx, what", [
    (optax.adam(1e-3).init({"w": jnp.ones(2)}), r"tuple \(it looks like an optimizer state: "
     r"pass the transformation, e.g. optax.adam\(1e-3\), not its init\(params\)\)"),
    (optax.EmptyState(), r"optax._src.base.EmptyState \(it looks like an optimizer state: .*"),
    ("adam", r"str: 'adam'"),
    (list(range(1000)), r"list: \[0, 1, 2, .*\.\.\."),
], ids=["adam-state", "empty-state", "string", "long-list"])
def test_an_optimizer_state_for_tx_is_named_in_one_line(tx, what):
  expected = ("^tx must be an optax GradientTransformation \\(an object with callable init "
              f"and update\\), got an object of type {what}$")
  with pytest.raises(TypeError, match=expected) as info:
    jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
  assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_python_and_weak_leaves_compile_once():
  traces = []

  def loss_fn(params, batch):
    traces.append(1)
    return jnp.sum(params["w"] * batch["x"]) * params["s"] + params["n"] + params["b"]

  params = {"w": jnp.ones(2), "s": jnp.array(1.0), "n": 3, "b": True}
  assert params["s"].weak_type
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"))
  for _ in range(3):
    state, _ = step(state, {"x": jnp.ones(2)})
  assert len(traces) == 1
  assert not any(x.weak_type for x in jax.tree.leaves(state))
  assert (state.params["n"].dtype, state.params["b"].dtype) == (jnp.int32, jnp.bool_)


def test_step_counter_saturates():
  state = jmp.TrainState.create(params=classifier_params(), tx=optax.sgd(0.1))
  state = state.replace(step=jnp.int32(2**31 - 2))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("f32"))
  for _ in range(3):
    state, _ = step(state, classifier_batch())
  assert int(state.step) == 2**31 - 1


def test_extra_args_reach_the_transformation():
  # reduce_on_plateau reads optax's `value` extra arg: the step passes the loss.
  tx = jmp.dynamic_loss_scaling(optax.chain(
      optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)))
  state = jmp.TrainState.create(params=classifier_params(), tx=tx)
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_float16"))
  losses = []
  for _ in range(3):
    state, metrics = step(state, classifier_batch())
    losses.append(float(metrics["loss"]))
  plateau = state.opt_state.inner_state[1]
  assert float(plateau.best_value) == pytest.approx(min(losses), rel=1e-6)
  # extra_args adds (or overrides) keyword arguments of tx.update.
  seen = {}

  def update(updates, opt_state, params=None, **extra):
    seen.update(extra)
    return updates, opt_state

  spy = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  state = jmp.TrainState.create(params=classifier_params(), tx=optax.chain(optax.sgd(0.1), spy))
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("f32"), has_aux=False,
                             extra_args=lambda loss, aux, batch: {"value": 2 * loss, "n": 7})
  state, metrics = step(state, classifier_batch())
  assert set(seen) == {"value", "n"} and seen["n"] == 7


@pytest.mark.parametrize("bad", ["loss", "metric"])
def test_extra_args_value_never_decides_the_skip(bad):
  # reduce_on_plateau on a validation metric: `value` is the metric, yet the
  # skip decides on the loss and the gradients, as it does for a plain tx.
  def loss_fn(params, batch):
    loss = classifier_loss(params, batch) + jax.lax.stop_gradient(batch["bad_loss"])
    return loss, {"metric": batch["metric"]}

  tx = jmp.dynamic_loss_scaling(optax.chain(
      optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)),
      init_scale=2.0**10)
  state = jmp.TrainState.create(params=classifier_params(), tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), has_aux=True,
                             extra_args=lambda loss, aux, batch: {"value": aux["metric"]})
  nan, finite = jnp.float32(jnp.nan), jnp.float32(0.0)
  batch = dict(classifier_batch(), bad_loss=nan if bad == "loss" else finite,
               metric=nan if bad == "metric" else jnp.float32(0.75))
  before = host(state)
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["grad_norm"]))
  if bad == "loss":  # A NaN loss with a finite metric skips, bit for bit.
    assert not bool(metrics["grads_finite"])
    assert_bitwise_equal(state.params, before.params)
    assert_bitwise_equal(state.opt_state.inner_state, before.opt_state.inner_state)
    assert float(jmp.loss_scale_of(state.opt_state)) == 2.0**9
  else:  # A NaN metric with a finite loss applies, and the scale stays.
    assert bool(metrics["grads_finite"])
    assert int(jmp.skipped_steps_of(state.opt_state)) == 0
    assert float(jmp.loss_scale_of(state.opt_state)) == 2.0**10
    assert not np.array_equal(state.params["w1"], before.params["w1"])
  # The user's value reaches the inner transformation.
  state, metrics = step(state, dict(batch, bad_loss=finite, metric=jnp.float32(0.75)))
  assert bool(metrics["grads_finite"])
  assert float(state.opt_state.inner_state[1].best_value) == 0.75


@pytest.mark.parametrize("policy", ["f32", "mixed_float16"])
def test_complex_params_are_trained_like_plain_optax(policy):
  def loss_fn(params, batch):
    diff = params["z"].astype(jnp.complex64) - batch["t"]
    return jnp.sum(jnp.real(diff * jnp.conj(diff))) + jnp.sum(params["w"] ** 2).astype(jnp.float32)

  params = {"z": jnp.array([1 + 1j, -2j], jnp.complex64), "w": jnp.ones(2)}
  batch = {"t": jnp.array([0.5 - 1j, 1 + 0j], jnp.complex64)}
  opt = optax.sgd(0.1)
  ref, ref_opt = params, opt.init(params)
  for _ in range(3):
    g = jax.grad(loss_fn)(ref, batch)
    u, ref_opt = opt.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, u)
  state = jmp.TrainState.create(params=params, tx=jmp.static_loss_scaling(opt, 4.0))
  step = jmp.make_train_step(loss_fn, jmp.get_policy(policy))
  for _ in range(3):
    state, metrics = step(state, batch)
  assert state.params["z"].dtype == jnp.complex64
  tol = 1e-6 if policy == "f32" else 2e-3
  np.testing.assert_allclose(state.params["z"], ref["z"], rtol=tol, atol=tol)
  assert not np.allclose(state.params["z"], params["z"])
  bad = {"t": batch["t"].at[0].set(complex(jnp.nan, 0))}
  before = host(state.params)
  state, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.params, before)


# ------------------------------------------- bad input: messages name the value and what is allowed


BAD_ARGUMENTS = {
    "tx-string": (lambda: jmp.TrainState.create(params={"w": jnp.ones(2)}, tx="adam"),
                  r"tx must be an optax GradientTransformation .*, got an object of type str: 'adam'$"),
    "tx-uncalled-factory": (lambda: jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.adam),
                            r"tx must be an optax GradientTransformation .*, got an object of "
                            r"type function: <function adam .*\(call it to get the transformation"),
    "policy-string": (lambda: jmp.make_train_step(classifier_loss, "mixed_float16"),
                      r"policy must be a jmp_lite.Policy, got 'mixed_float16'"),
    "loss_fn-int": (lambda: jmp.make_train_step(3, jmp.get_policy("f32")),
                    r"loss_fn must be callable, got 3"),
    "donate-string": (lambda: jmp.make_train_step(classifier_loss, jmp.get_policy("f32"), donate="no"),
                      r"donate must be True or False, got 'no'"),
    "has_aux-int": (lambda: jmp.make_train_step(classifier_loss, jmp.get_policy("f32"), has_aux=1),
                    r"has_aux must be True or False, got 1"),
    "state-dict": (lambda: jmp.make_train_step(classifier_loss, jmp.get_policy("f32"), donate=False)(
                       {"params": classifier_params()}, classifier_batch()),
                   r"state must be a jmp_lite.TrainState.*got dict"),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_are_rejected(name):
  make, match = BAD_ARGUMENTS[name]
  with pytest.raises(TypeError, match=match):
    make()


def _state(**extra_params):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.full((2,), 0.1), **extra_params}
  return jmp.TrainState.create(params=params, tx=jmp.dynamic_loss_scaling(optax.sgd(0.1)))


def _batch():
  x = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)
  return {"x": x, "y": jnp.cos(x[:, :2])}


def _pred(params, batch):
  return batch["x"] @ params["w"] + params["b"]


BAD_LOSSES = {
    "vector": (lambda p, b: (_pred(p, b) - b["y"]) ** 2, False),
    "matrix-f16": (lambda p, b: ((_pred(p, b) - b["y"]) ** 2).astype(jnp.float16), False),
    "integer": (lambda p, b: jnp.sum(_pred(p, b)).astype(jnp.int32), False),
    "bool": (lambda p, b: jnp.sum(_pred(p, b)) > 0, False),
    "complex": (lambda p, b: jnp.sum(_pred(p, b)).astype(jnp.complex64), False),
    "tuple-without-has_aux": (lambda p, b: (jnp.sum(_pred(p, b)), {}), False),
    "vector-with-aux": (lambda p, b: (_pred(p, b), {"n": 1}), True),
}


@pytest.mark.parametrize("name", list(BAD_LOSSES))
def test_non_scalar_or_non_float_loss(name):
  loss_fn, has_aux = BAD_LOSSES[name]
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), has_aux=has_aux, donate=False)
  with pytest.raises((TypeError, ValueError), match=r"scalar"):
    step(_state(), _batch())


def test_has_aux_without_a_pair():
  step = jmp.make_train_step(
      lambda p, b: jnp.mean(_pred(p, b)), jmp.get_policy("f32"), has_aux=True, donate=False
  )
  with pytest.raises(TypeError, match=r"has_aux=True .*\(loss, aux\) pair"):
    step(_state(), _batch())


def _loss(params, batch):
  return jnp.mean((_pred(params, batch).astype(jnp.float32) - batch["y"]) ** 2)


STRUCTURE_CHANGES = {
    "batch-extra-key": (lambda state, batch: (state, dict(batch, extra=jnp.ones(3))),
                        r"batch tree changed structure.*expected.*received.*'extra'"),
    "batch-bare-array": (lambda state, batch: (state, batch["x"]),
                         r"batch tree changed structure.*received: PyTreeDef\(\*\)"),
    "batch-list": (lambda state, batch: (state, [batch["x"], batch["y"]]),
                   r"batch tree changed structure.*received: PyTreeDef\(\[\*, \*\]\)"),
    "params-extra-key": (
        lambda state, batch: (state.replace(params=dict(state.params, extra=jnp.ones(2))), batch),
        r"params tree changed structure.*expected.*received.*'extra'"),
    # A fresh state: its optimizer state changes structure too.
    "new-state-extra-param": (
        lambda state, batch: (_state(extra=jnp.ones(2)), batch),
        r"params tree changed structure.*expected.*received.*'extra'"),
}


@pytest.mark.parametrize("name", list(STRUCTURE_CHANGES))
def test_tree_structure_change_between_calls(name):
  change, match = STRUCTURE_CHANGES[name]
  step = jmp.make_train_step(_loss, jmp.get_policy("mixed_float16"), donate=False)
  state, _ = step(_state(), _batch())
  state, _ = step(state, {k: v[:2] for k, v in _batch().items()})  # A new shape is fine (it compiles).
  with pytest.raises(ValueError, match="(?s)" + match):
    step(*change(state, _batch()))
  state, metrics = step(state, _batch())  # The original structures still work.
  assert bool(metrics["grads_finite"])


def test_a_pair_without_has_aux_suggests_has_aux():
  step = jmp.make_train_step(lambda p, b: (jnp.sum(p["w"]), 1), jmp.get_policy("f32"))
  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"it returned a pair.*has_aux=True"):
    step(state, {})

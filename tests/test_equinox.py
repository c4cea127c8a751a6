"""Whole Equinox modules as params: non-array leaves are static, arrays are trained (issue 15)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp

POLICIES = {
    "f16_dynamic": (jmp.get_policy("mixed_float16"),
                    lambda: jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)),
    "bf16": (jmp.get_policy("mixed_bfloat16"), lambda: optax.adam(1e-2)),
}


class ConvNet(eqx.Module):
  """A small Conv2d model: conv, relu, global mean, linear head."""

  conv: eqx.nn.Conv2d
  head: eqx.nn.Linear
  activation: callable = eqx.field(static=False)

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
    self.head = eqx.nn.Linear(8, 1, key=k2)
    self.activation = jax.nn.relu  # A non-array leaf, as in eqx.nn.MLP.

  def __call__(self, x):
    h = self.activation(self.conv(x))
    return self.head(jnp.mean(h, axis=(1, 2)))


def _mlp_problem():
  model = eqx.nn.MLP(4, 1, 32, 2, key=jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (64, 4))
  return model, {"x": x, "y": jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]}


def _conv_problem():
  model = ConvNet(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (32, 1, 6, 6))
  return model, {"x": x, "y": jnp.mean(x, axis=(1, 2, 3))[:, None] * 3.0}


def _loss_fn(seen):
  def loss_fn(model, batch):
    seen.append(jax.tree.map(lambda a: a.dtype, eqx.filter(model, eqx.is_array)))
    pred = jax.vmap(model)(batch["x"]).astype(jnp.float32)
    return jnp.mean((pred - batch["y"]) ** 2)

  return loss_fn


@pytest.mark.parametrize("problem", [_mlp_problem, _conv_problem], ids=["MLP", "Conv2d"])
@pytest.mark.parametrize("mode", list(POLICIES))
def test_whole_equinox_modules_train(problem, mode):
  policy, make_tx = POLICIES[mode]
  model, batch = problem()
  static_before = [x for x in jax.tree.leaves(model) if not eqx.is_array(x)]
  assert static_before  # The module does hold non-array leaves.
  seen = []
  state = jmp.TrainState.create(params=model, tx=make_tx())
  step = jmp.make_train_step(_loss_fn(seen), policy)
  state, first = step(state, batch)
  for _ in range(60):
    state, metrics = step(state, batch)
  assert len(seen) == 1  # One compilation.
  assert all(d == policy.compute_dtype for d in jax.tree.leaves(seen[0]))
  assert type(state.params) is type(model)
  static_after = [x for x in jax.tree.leaves(state.params) if not eqx.is_array(x)]
  assert all(a is b for a, b in zip(static_after, static_before, strict=True))
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(eqx.filter(state.params, eqx.is_array)))
  assert float(metrics["loss"]) < 0.5 * float(first["loss"])
  # The caller's module survives donation.
  assert not any(a.is_deleted() for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def test_equinox_skip_is_exact_and_lower_works():
  model, batch = _mlp_problem()
  policy, make_tx = POLICIES["f16_dynamic"]
  state = jmp.TrainState.create(params=model, tx=make_tx())
  step = jmp.make_train_step(_loss_fn([]), policy, donate=False)
  state, _ = step(state, batch)
  bad = dict(batch, x=batch["x"].at[0, 0].set(jnp.nan))
  new, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])
  for part in (lambda s: s.params, lambda s: s.opt_state.inner_state):
    old_leaves = jax.tree.leaves(eqx.filter(part(state), eqx.is_array))
    new_leaves = jax.tree.leaves(eqx.filter(part(new), eqx.is_array))
    assert len(old_leaves) == len(new_leaves) > 0
    for a, b in zip(new_leaves, old_leaves):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  compiled = step.lower(state, batch).compile()
  assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_policy_casts_equinox_modules_leafwise():
  model, _ = _mlp_problem()
  cast = jmp.get_policy("mixed_bfloat16").cast_to_compute(model)
  assert type(cast) is type(model) and cast.activation is model.activation
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(eqx.filter(cast, eqx.is_array)))


class _Pooled(eqx.Module):
  """Stock layers whose fields are Python numbers and bools (MaxPool2d's -inf, Dropout's p)."""

  conv: eqx.nn.Conv2d
  pool: eqx.nn.MaxPool2d
  avg: eqx.nn.AvgPool2d
  dropout: eqx.nn.Dropout
  head: eqx.nn.Linear
  scale: float = 2.0  # a plain Python number field: static, never trained

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
    self.pool = eqx.nn.MaxPool2d(2, stride=2)
    self.avg = eqx.nn.AvgPool2d(2, stride=2)
    self.dropout = eqx.nn.Dropout(0.25)
    self.head = eqx.nn.Linear(4, 1, key=k2)

  def __call__(self, x, key):
    h = self.avg(self.pool(jax.nn.relu(self.conv(x))))
    return self.head(self.dropout(h.reshape(-1), key=key)) * self.scale


def test_python_fields_of_equinox_modules_stay_static():
  model = _Pooled(jax.random.key(0))
  state = jmp.TrainState.create(params=model, tx=optax.adam(1e-2))
  static = lambda m: (m.pool.init, m.dropout.p, m.dropout.inference, m.scale)
  assert static(state.params) == static(model)
  assert all(not isinstance(v, jax.Array) for v in static(state.params))
  assert state.params.conv.weight is not model.conv.weight  # arrays are the state's own copies
  opt_leaves = jax.tree.leaves(state.opt_state)
  assert len(opt_leaves) == 1 + 2 * len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))

  x = jax.random.normal(jax.random.key(1), (16, 1, 4, 4))
  batch = {"x": x, "y": x.mean(axis=(1, 2, 3))[:, None], "key": jax.random.key(2)}

  traces = []

  def loss_fn(model, batch):
    traces.append(1)
    keys = jax.random.split(batch["key"], batch["x"].shape[0])
    pred = jax.vmap(model)(batch["x"], keys).astype(jnp.float32)
    return jnp.mean((pred - batch["y"]) ** 2)

  for policy in ("full", "mixed_float16", "mixed_bfloat16"):
    traces.clear()
    step = jmp.make_train_step(loss_fn, jmp.get_policy(policy))
    s = jmp.TrainState.create(params=model, tx=optax.adam(1e-2))
    losses = []
    for _ in range(4):
      s, metrics = step(s, batch)
      losses.append(float(metrics["loss"]))
    assert bool(metrics["grads_finite"]) and static(s.params) == static(model)
    assert len(traces) == 1 and losses[-1] < losses[0], (policy, len(traces), losses)


def test_python_numbers_in_a_plain_dict_are_trained_arrays():
  # Outside an Equinox module a Python float is a parameter, as jax.jit and optax see it.
  state = jmp.TrainState.create(params={"w": jnp.ones(2), "b": 0.5}, tx=optax.sgd(0.1))
  assert isinstance(state.params["b"], jax.Array) and state.params["b"].dtype == jnp.float32
  step = jmp.make_train_step(lambda p, x: jnp.sum(p["w"] * x) + p["b"] * 3.0,
                             jmp.get_policy("mixed_bfloat16"))
  state, _ = step(state, jnp.ones(2))
  np.testing.assert_allclose(float(state.params["b"]), 0.5 - 0.1 * 3.0, rtol=1e-6)


class _RunningMean(eqx.Module):
  """A model-state module with a Python float field, as Equinox layers hold them."""

  mean: jax.Array
  momentum: float


@pytest.mark.parametrize("mode", list(POLICIES))
def test_an_ema_model_and_python_fields_in_model_state_train(mode):
  # Issue 31 item 2: an EMA copy of an eqx.nn.MLP (jax.nn.relu is a leaf) in the
  # model state crashed the first step in the skip's lax.cond, and a float field
  # of a module came back an array, so the step traced twice.
  policy, make_tx = POLICIES[mode]
  model, batch = _mlp_problem()
  traces = []

  def loss_fn(model, model_state, batch):
    traces.append(1)
    ema, running = model_state["ema"], model_state["running"]
    new_ema = eqx.apply_updates(ema, jax.tree.map(
        lambda e, p: 0.5 * (p.astype(jnp.float32) - e), eqx.filter(ema, eqx.is_array),
        eqx.filter(model, eqx.is_array)))
    pred = jax.vmap(model)(batch["x"]).astype(jnp.float32)
    mean = running.momentum * running.mean + (1 - running.momentum) * jnp.mean(pred)
    new_running = eqx.tree_at(lambda r: r.mean, running, mean)
    loss = jnp.mean((pred - batch["y"]) ** 2) * batch["ok"]
    return loss, {"ema": new_ema, "running": new_running, "tag": model_state["tag"]}

  model_state = {"ema": model, "running": _RunningMean(jnp.zeros(()), 0.75), "tag": "ema"}
  state = jmp.TrainState.create(params=model, tx=make_tx(), model_state=model_state)
  step = jmp.make_train_step(loss_fn, policy)
  for ok in (1.0, np.nan, 1.0):
    before = np.asarray(state.model_state["ema"].layers[0].weight)
    seen = np.asarray(state.params.layers[0].weight.astype(policy.compute_dtype), np.float32)
    state, metrics = step(state, dict(batch, ok=jnp.float32(ok)))
    after = np.asarray(state.model_state["ema"].layers[0].weight)
    assert bool(metrics["grads_finite"]) == (ok == 1.0)
    if ok == 1.0:  # loss_fn's EMA of the params it saw, stored in float32
      np.testing.assert_allclose(after, before + 0.5 * (seen - before), rtol=1e-6)
    else:  # kept bit for bit
      np.testing.assert_array_equal(after, before)
  ema, running = state.model_state["ema"], state.model_state["running"]
  assert ema.activation is model.activation and ema.final_activation is model.final_activation
  assert type(running.momentum) is float and running.momentum == 0.75
  assert state.model_state["tag"] == "ema" and float(running.mean) != 0.0
  assert len(traces) == 1


def test_a_float_field_of_a_model_state_module_stays_a_python_float():
  # Issue 31 item 2: the skip turned the field into an array, so the second step
  # saw another tree structure and traced again.
  traces = []

  def loss_fn(params, running, x):
    traces.append(1)
    mean = running.momentum * running.mean + (1 - running.momentum) * jnp.mean(x)
    return jnp.sum(params["w"] * x), eqx.tree_at(lambda r: r.mean, running, mean)

  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                                model_state=_RunningMean(jnp.zeros(()), 0.5))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"))
  for _ in range(3):
    state, _ = step(state, jnp.array([2.0, 6.0]))
    assert type(state.model_state.momentum) is float
  assert float(state.model_state.mean) == 3.5 and len(traces) == 1  # 0 -> 2 -> 3 -> 3.5

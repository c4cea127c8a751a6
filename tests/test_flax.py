"""The train step with Flax: Linen (dtype=None layers, fp32 norms, batch_stats) and NNX."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

import jmp_lite as jmp
from conftest import assert_bitwise_equal

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_flax")


@pytest.fixture(scope="module")
def digits():
  x, y = load_digits(return_X_y=True)
  x = (x[:256] / 16.0).astype(np.float32)
  return {"x": jnp.asarray(x), "y": jnp.asarray(y[:256], jnp.int32)}


class LinenNet(nn.Module):
  """Dense layers follow the (cast) params; norms compute in f32 and cast back."""

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Dense(32, dtype=None)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(h).astype(x.dtype)
    h = nn.relu(nn.Dense(32, dtype=None)(h))
    h = nn.LayerNorm()(h).astype(x.dtype)
    return nn.Dense(10, dtype=None)(h)


def xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


@pytest.mark.parametrize(
    "policy_name, tx",
    [
        ("mixed_float16", jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)),
        ("mixed_bfloat16", optax.adam(1e-2)),
    ],
    ids=["f16-dynamic-scale", "bf16-plain-optax"],
)
def test_linen_dtype_none_layers_fp32_norms_and_batch_stats(digits, policy_name, tx):
  policy = jmp.get_policy(policy_name).with_keep_full("LayerNorm|BatchNorm")
  model = LinenNet()
  init = jax.jit(functools.partial(model.init, train=False))
  variables = init(jax.random.key(0), digits["x"][:2])
  assert set(variables) == {"params", "batch_stats"}
  seen = {}

  def loss_fn(variables, batch):
    dtypes = {
        jax.tree_util.keystr(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]
    }
    seen.update(dtypes=dtypes, x=batch["x"].dtype)
    logits, updates = model.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
    seen["logits"] = logits.dtype
    return xent(logits, batch["y"]), updates["batch_stats"]

  step = jmp.make_train_step(loss_fn, policy, has_aux=True)

  @jax.jit
  def train_step(state, batch):
    # batch_stats come out through aux; keep the old ones on a skipped step.
    state, metrics = step(state, batch)
    stats = jmp.select_tree(
        metrics["grads_finite"], metrics["aux"], state.params["batch_stats"]
    )
    return state.replace(params={**state.params, "batch_stats": stats}), metrics

  @jax.jit
  def eval_loss(variables):
    return xent(model.apply(variables, digits["x"], train=False), digits["y"])

  state = jmp.TrainState.create(params=variables, tx=tx)
  initial = float(eval_loss(state.params))
  stats0 = jax.device_get(state.params["batch_stats"])
  for _ in range(25):
    state, metrics = train_step(state, digits)

  half = policy.compute_dtype
  assert seen["x"] == half and seen["logits"] == half
  for path, dtype in seen["dtypes"].items():
    if "Norm" in path:  # BatchNorm/LayerNorm scale and bias, batch_stats mean and var.
      assert dtype == jnp.float32, path
    else:
      assert dtype == half, path
  assert sum("Dense" in p for p in seen["dtypes"]) == 6
  assert sum("batch_stats" in p for p in seen["dtypes"]) == 2

  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  stats = state.params["batch_stats"]["BatchNorm_0"]
  assert stats["mean"].dtype == jnp.float32 and stats["var"].dtype == jnp.float32
  assert not np.allclose(stats["mean"], stats0["BatchNorm_0"]["mean"])
  assert not np.allclose(stats["var"], stats0["BatchNorm_0"]["var"])
  final = float(eval_loss(state.params))  # Uses the running averages written back.
  assert final < 0.5 * initial, (initial, final)
  assert float(metrics["loss"]) < 0.5 * initial

  # A poisoned batch: the step is skipped and the batch stats stay as they were.
  before = jax.device_get(state.params)
  bad = dict(digits, x=digits["x"].at[0, 5].set(jnp.nan))
  state, metrics = train_step(state, bad)
  assert not bool(metrics["grads_finite"])
  jax.tree.map(np.testing.assert_array_equal, state.params, before)


class NnxNet(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(64, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    h = nnx.relu(self.linear1(x))
    h = self.dropout(self.norm(h).astype(x.dtype))
    return self.linear2(h)


def test_nnx_split_step_merge_with_rng_and_int_leaves(digits):
  model = NnxNet(nnx.Rngs(params=0, dropout=1))
  model.train()
  graphdef, state0 = nnx.split(model)
  policy = jmp.get_policy("mixed_bfloat16").with_keep_full("norm")
  seen = {}

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    seen["kernel"] = model.linear1.kernel[...].dtype
    seen["norm"] = model.norm.scale[...].dtype
    logits = model(batch["x"])
    seen["logits"] = logits.dtype
    # The non-param state after the call (RNG count, counter) comes out as aux.
    return xent(logits, batch["y"]), nnx.state(model, nnx.Not(nnx.Param))

  step = jmp.make_train_step(loss_fn, policy, has_aux=True)
  tx = jmp.static_loss_scaling(optax.adam(1e-2), 1.0)
  state = jmp.TrainState.create(params=state0, tx=tx)
  before = jax.device_get(nnx.state(model, nnx.Not(nnx.Param)))
  params_before = jax.device_get(nnx.state(model, nnx.Param))

  state, metrics = step(state, digits)
  assert seen == {"kernel": jnp.bfloat16, "norm": jnp.float32, "logits": jnp.bfloat16}
  # The step leaves int and key leaves alone and updates the float params.
  other = nnx.state(nnx.merge(graphdef, state.params), nnx.Not(nnx.Param))
  assert int(other["calls"][...]) == 0
  assert int(other["dropout"]["rngs"]["count"][...]) == 0
  np.testing.assert_array_equal(
      jax.random.key_data(other["dropout"]["rngs"]["key"][...]),
      jax.random.key_data(before["dropout"]["rngs"]["key"][...]),
  )
  assert int(metrics["aux"]["calls"][...]) == 1
  assert int(metrics["aux"]["dropout"]["rngs"]["count"][...]) == 1

  # Write the advanced RNG count and counter back, so each step draws new masks.
  losses = [float(metrics["loss"])]
  state = state.replace(params=nnx.merge_state(state.params, metrics["aux"]))
  for _ in range(19):
    state, metrics = step(state, digits)
    state = state.replace(params=nnx.merge_state(state.params, metrics["aux"]))
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.5 * losses[0], losses

  trained = nnx.merge(graphdef, state.params)
  assert int(trained.calls[...]) == 20 and int(trained.dropout.rngs.count[...]) == 20
  assert trained.linear1.kernel[...].dtype == jnp.float32
  assert not np.allclose(trained.linear1.kernel[...], params_before["linear1"]["kernel"][...])
  trained.eval()

  @nnx.jit
  def eval_logits(model, x):
    return model(x)

  logits = eval_logits(trained, digits["x"])
  assert logits.dtype == jnp.float32
  assert float(xent(logits, digits["y"])) < 0.5 * losses[0]


# ------------------------------------------------- model state without boilerplate (issue 15)


def test_linen_batch_stats_as_model_state(digits):
  policy = jmp.get_policy("mixed_float16").with_keep_full("LayerNorm|BatchNorm")
  model = LinenNet()
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), digits["x"][:2])
  seen = {}

  def loss_fn(params, model_state, batch):
    seen["stats"] = jax.tree.map(lambda a: a.dtype, model_state)
    logits, updates = model.apply({"params": params, **model_state}, batch["x"], train=True,
                                  mutable=list(model_state))
    return xent(logits, batch["y"]), updates

  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)
  state = jmp.TrainState.create(params=variables["params"], tx=tx,
                                model_state={"batch_stats": variables["batch_stats"]})
  # No optimizer state for the statistics.
  assert "batch_stats" not in str(jax.tree_util.tree_flatten_with_path(state.opt_state)[0])
  step = jmp.make_train_step(loss_fn, policy)

  @jax.jit
  def eval_loss(state):
    return xent(model.apply({"params": state.params, **state.model_state}, digits["x"],
                            train=False), digits["y"])

  initial = float(eval_loss(state))
  stats0 = jax.device_get(state.model_state)
  for _ in range(25):
    state, metrics = step(state, digits)
  assert all(d == jnp.float32 for d in jax.tree.leaves(seen["stats"]))  # Keep rule.
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.model_state))
  assert not np.allclose(state.model_state["batch_stats"]["BatchNorm_0"]["mean"],
                         stats0["batch_stats"]["BatchNorm_0"]["mean"])
  assert float(eval_loss(state)) < 0.5 * initial
  before = jax.device_get((state.params, state.model_state))
  state, metrics = step(state, dict(digits, x=digits["x"].at[0, 5].set(jnp.nan)))
  assert not bool(metrics["grads_finite"])
  after = jax.device_get((state.params, state.model_state))
  assert_bitwise_equal(after, before)


def test_nnx_non_param_state_as_model_state(digits):
  model = NnxNet(nnx.Rngs(params=0, dropout=1))
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  policy = jmp.get_policy("mixed_bfloat16").with_keep_full("norm")

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    loss = xent(model(batch["x"]), batch["y"])
    return loss, (nnx.state(model, nnx.Not(nnx.Param)), model.calls[...])

  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-2), model_state=rest)
  step = jmp.make_train_step(loss_fn, policy, has_aux=True)
  losses = []
  for _ in range(20):
    state, metrics = step(state, digits)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.5 * losses[0], losses
  assert int(metrics["aux"]) == 20  # aux next to the model state.
  trained = nnx.merge(graphdef, state.params, state.model_state)
  assert int(trained.calls[...]) == 20 and int(trained.dropout.rngs.count[...]) == 20


def test_model_state_errors(digits):
  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                                model_state={"m": jnp.zeros(2)})
  policy = jmp.get_policy("f32")
  step = jmp.make_train_step(lambda p, m, b: jnp.sum(p["w"]), policy)
  with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\)"):
    step(state, {})
  step = jmp.make_train_step(lambda p, m, b: (jnp.sum(p["w"]), {"other": m["m"]}), policy)
  with pytest.raises(TypeError, match=r"model state of another structure"):
    step(state, {})
  with pytest.raises(TypeError, match=r"axis_name must be a string"):
    jmp.make_train_step(lambda p, b: 0.0, policy, axis_name=3)

"""Other people's models: stock layers of flax.linen, flax.nnx and equinox.nn, trained by jmp_lite.

Each model (``tests/zoo_models.py``) trains a few steps in float32,
``mixed_float16`` with dynamic loss scaling, and the same under ``autocast``;
``mixed_bfloat16`` runs on three of the nine models, one per framework and one
per kind (:data:`BF16_CELLS`). Every mode is finite and lowers the loss; float32
equals the framework's own training loop (``flax.training.train_state``,
``nnx.Optimizer`` with ``nnx.jit``, ``eqx.filter_jit``) step by step.

Why bf16 is not run on every model (issue 37, CI time; each mode costs about 5
CPU-seconds of compiling per model): a bf16 policy runs the step's cast code
that ``mixed_float16`` runs on every model here, with a wider exponent and no
loss scale, so a layer that trains under ``mixed_float16`` exercises the same
casts. Besides the three cells here, bf16 policies train stock layers in
``tests/test_flax.py`` (Linen Dense/BatchNorm/LayerNorm:
``test_linen_dtype_none_layers_fp32_norms_and_batch_stats[bf16-plain-optax]``;
NNX Linear/LayerNorm/Dropout with RNG state:
``test_nnx_split_step_merge_with_rng_and_int_leaves``,
``test_nnx_non_param_state_as_model_state``), ``tests/test_equinox.py``
(``eqx.nn.MLP`` and ``Conv2d``: ``test_whole_equinox_modules_train[bf16-*]``)
and ``tests/test_examples.py`` (a Linen ``nn.RNN`` LSTM: ``char_lm``; NNX Conv,
BatchNorm, Dropout and pooling: ``test_nnx_cnn_smoke_trains_four_ways_and_reports_what_ran_in_half``).
"""

import contextlib
import numpy as np
import optax
import pytest

import jmp_lite as jmp
import zoo_models

STEPS = 6
MODES = {  # name: (policy, autocast, dynamic loss scaling)
    "fp32": ("full", False, False),
    "f16_dynamic": ("mixed_float16", False, True),
    "f16_autocast": ("mixed_float16", True, True),
    "bf16": ("mixed_bfloat16", False, False),
}
# The models that also train under mixed_bfloat16: each framework once, each kind once.
BF16_CELLS = {("linen", "vision"), ("nnx", "sequence"), ("equinox", "recurrent")}


def _modes(framework, kind):
  return [m for m in MODES if m != "bf16" or (framework, kind) in BF16_CELLS]


# NNX's LayerNorm and its RNN's float32 carries (dtype=None) promote what follows to float32:
# under a plain half policy these models run no matmul in half, and the step says so.
NOTHING_IN_HALF = {("nnx", "sequence"), ("nnx", "recurrent")}


def _train(zoo, mode, nothing_in_half=False):
  policy, autocast, scaled = MODES[mode]
  tx = optax.adam(zoo_models.LR)
  if scaled:
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**10)
  state = jmp.TrainState.create(params=zoo.params, tx=tx, model_state=zoo.model_state)
  step = jmp.make_train_step(zoo.loss_fn, jmp.get_policy(policy), autocast=autocast)
  losses = []
  warns = nothing_in_half and policy != "full" and not autocast  # Issue 42 item 6.
  for i in range(STEPS):
    with (pytest.warns(jmp.NothingInHalfWarning, match="precision_lint names the cause")
          if warns and i == 0 else contextlib.nullcontext()):  # Once, at the first call.
      state, metrics = step(state, zoo.batch(i))
    assert bool(metrics["grads_finite"]), (mode, i)
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.parametrize("kind", ["vision", "sequence", "recurrent"])
@pytest.mark.parametrize("framework", sorted(zoo_models.BUILDERS))
def test_stock_layers_train_in_every_mode(framework, kind):
  zoo = zoo_models.BUILDERS[framework](kind)
  native = zoo.native(STEPS)
  for mode in _modes(framework, kind):
    losses = _train(zoo, mode, (framework, kind) in NOTHING_IN_HALF)
    assert np.all(np.isfinite(losses)), mode
    assert losses[-1] < losses[0], (mode, losses)
    if mode == "fp32":
      np.testing.assert_allclose(losses, native, rtol=1e-5, atol=1e-6)


class _LinenBN(zoo_models.nn.Module):
  @zoo_models.nn.compact
  def __call__(self, x):
    x = zoo_models.nn.BatchNorm(use_running_average=False, momentum=0.99)(x)
    return zoo_models.nn.Dense(1)(x)


class _NnxBN(zoo_models.nnx.Module):
  def __init__(self, rngs):
    self.bn = zoo_models.nnx.BatchNorm(4, momentum=0.99, rngs=rngs)
    self.head = zoo_models.nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.bn(x))


class _EqxBN(zoo_models.eqx.Module):
  bn: zoo_models.eqx.nn.BatchNorm
  head: zoo_models.eqx.nn.Linear

  def __init__(self, mode, key):
    self.bn = zoo_models.eqx.nn.BatchNorm(4, axis_name="batch", momentum=0.99, mode=mode)
    self.head = zoo_models.eqx.nn.Linear(4, 1, key=key)

  def __call__(self, x, state):
    x, state = self.bn(x, state)
    return self.head(x), state


def _eqx_bn_problem(mode):
  jax = zoo_models.jax
  model, state = zoo_models.eqx.nn.make_with_state(_EqxBN)(mode, jax.random.key(0))

  def loss_fn(model, state, batch):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        batch["x"], state)
    return ((out.astype(np.float32) - batch["y"]) ** 2).mean(), state

  index = model.bn.batch_state_index if mode == "batch" else model.bn.ema_state_index
  return loss_fn, model, state, lambda s: s.get(index)[1]


def _bn_problem(framework):
  """loss_fn, params, model_state and a running-variance reader for a BatchNorm model."""
  nn, nnx = zoo_models.nn, zoo_models.nnx
  if framework == "equinox":
    return _eqx_bn_problem("batch")
  if framework == "linen":
    model = _LinenBN()
    v = model.init(zoo_models.jax.random.key(0), np.ones((4, 4), np.float32))

    def loss_fn(params, stats, batch):
      out, new = model.apply({"params": params, "batch_stats": stats}, batch["x"],
                             mutable=["batch_stats"])
      return ((out.astype(np.float32) - batch["y"]) ** 2).mean(), new["batch_stats"]

    return loss_fn, v["params"], v["batch_stats"], lambda s: s["BatchNorm_0"]["var"]
  graphdef, params, rest = nnx.split(_NnxBN(nnx.Rngs(0)), nnx.Param, ...)

  def nnx_loss(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    out = model(batch["x"])
    return ((out.astype(np.float32) - batch["y"]) ** 2).mean(), nnx.state(model, nnx.Not(nnx.Param))

  return nnx_loss, params, rest, lambda s: s["bn"]["var"][...]


def test_bf16_runs_once_per_framework_and_once_per_kind():
  assert sorted(f for f, _ in BF16_CELLS) == sorted(zoo_models.BUILDERS)
  assert sorted(k for _, k in BF16_CELLS) == ["recurrent", "sequence", "vision"]


@pytest.mark.parametrize("framework", ["linen", "nnx", "equinox"])
def test_batchnorm_running_statistics_track_float32(framework):
  # Inputs of variance ~4 and mean 1: float16's ulp at 4 is 2**-8, so a momentum-0.99
  # update below 0.2 is lost when the statistics are kept in float16.
  rng = np.random.default_rng(0)
  x = (1.0 + 2.0 * rng.standard_normal((64, 4))).astype(np.float32)
  batch = {"x": x, "y": x[:, :1] * 0.5}
  loss_fn, params, stats, var_of = _bn_problem(framework)
  runs = {}
  for policy in ("full", "mixed_float16", "mixed_bfloat16"):
    state = jmp.TrainState.create(params=params, tx=optax.sgd(1e-3), model_state=stats)
    # NNX BatchNorm (dtype=None) promotes its output to float32, so the head's matmul runs
    # in float32 on purpose here: the statistics are under test (NothingInHalfWarning off).
    step = jmp.make_train_step(loss_fn, jmp.get_policy(policy), warn_no_half=framework != "nnx")
    for _ in range(300):
      state, _ = step(state, batch)
    runs[policy] = np.asarray(var_of(state.model_state), np.float64)
    assert var_of(state.model_state).dtype == np.float32  # stored as created
  for policy in ("mixed_float16", "mixed_bfloat16"):
    np.testing.assert_allclose(runs[policy], runs["full"], rtol=0.01, err_msg=policy)


def test_equinox_ema_batchnorm_is_a_documented_limit_under_a_half_policy():
  # mode="ema" selects between the half batch statistics and the float32 running
  # statistics with lax.select, which needs equal dtypes: Equinox itself refuses at
  # trace time (docs/equinox.md says to use mode="batch", which trains: see above).
  loss_fn, model, stats, var_of = _eqx_bn_problem("ema")
  x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
  batch = {"x": x, "y": x[:, :1]}
  state = jmp.TrainState.create(params=model, tx=optax.sgd(1e-3), model_state=stats)
  for policy in ("mixed_float16", "mixed_bfloat16"):
    step = jmp.make_train_step(loss_fn, jmp.get_policy(policy), donate=False)
    with pytest.raises(TypeError, match="lax.select requires arguments to have the same dtypes"):
      step(state, batch)
  state, metrics = jmp.make_train_step(loss_fn, jmp.get_policy("full"))(state, batch)
  assert bool(metrics["grads_finite"]) and var_of(state.model_state).dtype == np.float32

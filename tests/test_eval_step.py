"""make_eval_step: evaluation in the training precision (issue 31 item 7).

The porting guides' three kinds of model (Linen with BatchNorm statistics, NNX
with its non-param state, Equinox with Python fields and ``eqx.nn.State``)
evaluate as the step would run them: params and arguments cast by the policy,
the model state as stored, the same autocast/FP8 rules, the output in the
output dtype. Each is checked against the same casts written by hand.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite as jmp
from jmp_lite._src.autocast.autocast import step_autocast
from conftest import assert_bitwise_equal
from conftest import host

F16 = jmp.get_policy("mixed_float16")
BF16 = jmp.get_policy("mixed_bfloat16")
X = np.random.default_rng(0).standard_normal((4, 6, 6, 1)).astype(np.float32)


class _Linen(nn.Module):
  """Conv, BatchNorm and Dense, with float32 ``dtype`` fields as a real config has them."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3), dtype=self.dtype)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x))
    return nn.Dense(3, dtype=self.dtype)(x.reshape(x.shape[0], -1))


def _linen():
  model = _Linen()
  v = model.init(jax.random.key(0), X, train=False)
  # Running statistics away from their init, so that casting them would show.
  stats = jax.tree.map(lambda s: s + 0.1234567, v["batch_stats"])

  def predict(params, batch_stats, x):
    return model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)

  return predict, v["params"], stats


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.head = nnx.Linear(4 * 36, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1))


def _nnx():
  graphdef, params, rest = nnx.split(_Nnx(nnx.Rngs(0)), nnx.Param, ...)

  def predict(params, rest, x):
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return model(x)

  return predict, params, rest


class _Eqx(eqx.Module):
  conv: eqx.nn.Conv2d
  bn: eqx.nn.BatchNorm
  pool: eqx.nn.MaxPool2d
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
    self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
    self.pool = eqx.nn.MaxPool2d(2, stride=2)
    self.head = eqx.nn.Linear(4 * 9, 3, key=k2)

  def __call__(self, x, state):
    x, state = self.bn(self.conv(x), state)
    return self.head(self.pool(jax.nn.relu(x)).reshape(-1)), state


def _eqx():
  model, state = eqx.nn.make_with_state(_Eqx)(jax.random.key(0))

  def predict(model, state, x):
    model = eqx.nn.inference_mode(model)
    logits, _ = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                         out_axes=(0, None))(jnp.transpose(x, (0, 3, 1, 2)), state)
    return logits

  return predict, model, state


MODELS = {"linen": _linen, "nnx": _nnx, "equinox": _eqx}


def _by_hand(predict, policy, autocast):
  """The casts of the issue's recipe, written out: what make_eval_step must equal."""
  def run(params, model_state, x):
    # The step's autocast: it traces the float32 program and evaluates it on the cast values.
    fn = step_autocast(predict, policy.compute_dtype, None) if autocast else predict
    out = fn(policy.cast_to_compute(params), model_state, policy.cast_to_compute(x))
    return policy.cast_to_output(out)

  return eqx.filter_jit(run)


@pytest.mark.parametrize("autocast", [False, True], ids=["cast", "autocast"])
@pytest.mark.parametrize("name", list(MODELS))
def test_evaluates_as_the_step_would_run_the_model(name, autocast):
  predict, params, model_state = MODELS[name]()
  traces, seen = [], []

  def counted(params, model_state, x):
    traces.append(1)
    seen.append((x.dtype, {jnp.dtype(a.dtype) for a in jax.tree.leaves(eqx.filter(
        model_state, eqx.is_inexact_array))}))
    return predict(params, model_state, x)

  # A TrainState's own params: the masters the step trains.
  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-3), model_state=model_state)
  masters = host((state.params, state.model_state))
  eval_fn = jmp.make_eval_step(counted, F16, autocast=autocast, model_state=True)
  first = eval_fn(state.params, state.model_state, X)
  second = eval_fn(state.params, state.model_state, X + 1.0)
  assert len(traces) == 1  # no retrace on the second call
  # x cast (under autocast fn is traced as the float32 program: x as written), the state as stored.
  assert seen[0] == (jnp.float32 if autocast else jnp.float16, {jnp.dtype(jnp.float32)})
  assert first.dtype == jnp.float32 and first.shape == (4, 3)
  expected = _by_hand(predict, F16, autocast)(state.params, state.model_state, X)
  assert_bitwise_equal(first, expected)
  assert not np.array_equal(first, second)
  assert_bitwise_equal((state.params, state.model_state), masters)  # the masters are untouched
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_autocast_runs_a_float32_configured_model_in_half():
  # Linen's dtype=float32 fields cast the params back: only autocast evaluates in half,
  # as make_train_step(..., autocast=True) trains it.
  predict, params, stats = _linen()
  plain = jmp.make_eval_step(predict, F16, model_state=True)(params, stats, X)
  auto = jmp.make_eval_step(predict, F16, model_state=True, autocast=True)(params, stats, X)
  reference = jax.jit(lambda p, s, x: predict(p, s, x))(params, stats, X)
  np.testing.assert_allclose(plain, reference, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(auto, reference, rtol=2e-2, atol=2e-2)
  assert not np.array_equal(plain, auto)


def test_fp8_follows_the_steps_rules_and_stays_close_to_bf16():
  def predict(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]

  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(keys[0], (32, 32)) / 6, "w2": jax.random.normal(keys[1], (32, 16)) / 6}
  x = jax.random.normal(keys[2], (16, 32))
  bf16 = jmp.make_eval_step(predict, BF16, autocast=True)(params, x)
  fp8 = jmp.make_eval_step(predict, BF16, autocast=True, fp8=jmp.Float8Recipe(min_size=0))(params, x)
  assert fp8.dtype == bf16.dtype == jnp.float32 and not np.array_equal(fp8, bf16)
  error = float(jnp.linalg.norm(fp8 - bf16) / jnp.linalg.norm(bf16))
  assert error < 0.1, error


@pytest.mark.parametrize("outer", [False, True], ids=["eager", "jit"])
def test_keep_rules_static_arguments_and_an_outer_jit(outer):
  seen = []

  def predict(params, x, mode):
    seen.append((params["w"].dtype, params["scale"].dtype, mode))
    return {"y": x @ params["w"] * params["scale"], "mode": mode}

  policy = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32, keep_full=("scale",))
  eval_fn = jmp.make_eval_step(predict, policy)
  params = {"w": jnp.full((3, 2), 0.5), "scale": jnp.float32(3.0)}
  run = jax.jit(lambda p, x: eval_fn(p, x, "eval")["y"]) if outer else (
      lambda p, x: eval_fn(p, x, "eval")["y"])
  out = run(params, jnp.ones((1, 3)))
  assert seen == [(jnp.bfloat16, jnp.float32, "eval")]
  assert out.dtype == jnp.float32 and out.tolist() == [[4.5, 4.5]]
  if not outer:
    assert eval_fn(params, jnp.ones((1, 3)), "eval")["mode"] == "eval" and len(seen) == 1


def test_bfloat16_masters_are_read_through_their_float32_view():
  state = jmp.TrainState.create(params={"w": jnp.full((2, 1), 1.0 / 3.0)}, tx=optax.sgd(0.1),
                                master_dtype=jnp.bfloat16, rounding="kahan")
  out = jmp.make_eval_step(lambda p, x: x @ p["w"], jmp.get_policy("f32"))(state.params, jnp.ones((1, 2)))
  assert out.dtype == jnp.float32
  assert float(out[0, 0]) == 2 * float(jnp.float32(jnp.bfloat16(1.0 / 3.0)))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"fp8": True}, ValueError, r"fp8=True needs autocast=True"),
    ({"autocast": True, "fp8": "e4m3"}, TypeError, r"got 'e4m3'"),
    ({"autocast": 1}, TypeError, r"autocast must be True or False, got 1"),
    ({"model_state": "yes"}, TypeError, r"model_state must be True or False, got 'yes'"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    jmp.make_eval_step(lambda p, x: x, F16, **kwargs)


def test_bad_fn_policy_and_missing_model_state_are_named():
  with pytest.raises(TypeError, match=r"policy must be a jmp_lite.Policy, got 'mixed_float16'"):
    jmp.make_eval_step(lambda p, x: x, "mixed_float16")
  with pytest.raises(TypeError, match=r"fn must be callable, got 3"):
    jmp.make_eval_step(3, F16)
  with pytest.raises(ValueError, match=r"must be jnp.float16 or jnp.bfloat16, got dtype\('float32'\)"):
    jmp.make_eval_step(lambda p, x: x, jmp.get_policy("f32"), autocast=True)
  eval_fn = jmp.make_eval_step(lambda p, s, x: x, F16, model_state=True)
  with pytest.raises(TypeError, match=r"needs the model state"):
    eval_fn({"w": jnp.ones(2)})


@pytest.mark.parametrize("jit_outer", [False, True])
def test_batch_options_evaluate_as_the_step_trains(jit_outer):
  # Issue 36 item 6: float16 targets past 65504 kept float32 by batch_keep_full.
  def loss_fn(params, batch):
    pred = (batch["x"] @ params["w"]).astype(jnp.float32)
    return jnp.mean((pred - batch["y"].astype(jnp.float32)) ** 2) * 1e-9

  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.standard_normal((3, 1)), jnp.float32)}
  batch = {"x": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
           "y": jnp.asarray(1e5 + rng.standard_normal((4, 1)), jnp.float32)}
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.0))
  step = jmp.make_train_step(loss_fn, F16, batch_keep_full=("y",), donate=False)
  _, metrics = step(state, batch)
  eval_fn = jmp.make_eval_step(loss_fn, F16, batch_keep_full=("y",))
  plain = jmp.make_eval_step(loss_fn, F16)
  raw = jmp.make_eval_step(loss_fn, F16, cast_batch=False)
  call = jax.jit(eval_fn) if jit_outer else eval_fn
  assert np.isfinite(host(metrics["loss"]))
  assert_bitwise_equal(call(params, batch), metrics["loss"])
  assert not np.isfinite(host(plain(params, batch)))  # y cast to float16 is inf.
  # cast_batch=False: x @ w runs in float32 on purpose here (no NothingInHalfWarning).
  raw_step = jmp.make_train_step(loss_fn, F16, cast_batch=False, donate=False, warn_no_half=False)
  _, raw_metrics = raw_step(state, batch)
  assert_bitwise_equal(raw(params, batch), raw_metrics["loss"])

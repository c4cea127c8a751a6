"""precision_lint on the stock layers of Linen, NNX and Equinox: each cause it names is the true one.

Issue 42 item 5: on six ported programs the lint named a cause that fixing
would not change (Dropout's float32 draw for a layer pinned to float32), a
constant that the policy's program never rounds, a float16 sum of float32
data, and a matmul for Equinox BatchNorm's select.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_lite as jmp

F16 = jmp.get_policy("mixed_float16")
PINS = "a layer pins its dtype"
RANDOM = "a random draw"
MADE = "a float32 value made inside the function"


def _reasons(found, op="dot_general"):
  return [f.reason for f in found if f.op == op]


class _PinnedLinen(nn.Module):
  """flax's wmt example as shipped: every layer built with its config's dtype=float32."""

  dropout: bool

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 16, dtype=jnp.float32)(tokens)
    if self.dropout:
      x = nn.Dropout(0.1, deterministic=False)(x)
    x = nn.relu(nn.Dense(16, dtype=jnp.float32)(x))
    if self.dropout:
      x = nn.Dropout(0.1, deterministic=False)(x)
    return nn.Dense(16, dtype=jnp.float32)(x)


@pytest.mark.parametrize("dropout", [False, True])
def test_linen_pinned_dtype_is_named_with_or_without_dropout(dropout):
  # Dropout's float32 uniform only makes a bool mask: the matmuls are float32 because
  # the layers cast their inputs and params to float32.
  model = _PinnedLinen(dropout)
  tokens, key = jnp.arange(8).reshape(2, 4), jax.random.key(0)
  params = model.init({"params": key, "dropout": key}, tokens)["params"]

  def loss_fn(params, tokens, key):
    return jnp.mean(model.apply({"params": params}, tokens, rngs={"dropout": key}) ** 2)

  reasons = _reasons(jmp.precision_lint(loss_fn, params, tokens, key, policy=F16))
  assert len(reasons) == 2
  for reason in reasons:
    assert reason.split(": ")[1].startswith(PINS)
    assert RANDOM not in reason and MADE not in reason
    assert "set the layer's dtype to float16" in reason


def test_nnx_pinned_dtype_with_dropout_names_the_pinned_dtype():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 16, dtype=jnp.float32, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)
      self.b = nnx.Linear(16, 16, dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
      return self.b(self.drop(nnx.relu(self.a(x))))

  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)

  def loss_fn(params, rest, x):
    model = nnx.merge(graphdef, params, rest)
    return jnp.mean(model(x).astype(jnp.float32) ** 2), nnx.state(model, nnx.Not(nnx.Param))

  found = jmp.precision_lint(loss_fn, params, jnp.ones((4, 16)), policy=F16, model_state=rest)
  reasons = _reasons(found)
  assert len(reasons) == 2
  assert all(r.split(": ")[1].startswith(PINS) and RANDOM not in r for r in reasons)


def _linen_attention(x, mask):
  attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dtype=jnp.float32)
  params = attention.init(jax.random.key(0), x, mask=mask)["params"]
  return params, lambda p, x: jnp.mean(attention.apply({"params": p}, x, mask=mask) ** 2)


def _nnx_attention(x, mask):
  attention = nnx.MultiHeadAttention(2, 16, 16, dtype=jnp.float32, decode=False,
                                     rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(attention)
  return params, lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x, mask=mask) ** 2)


@pytest.mark.parametrize("build", [_linen_attention, _nnx_attention], ids=["linen", "nnx"])
def test_an_attention_pinned_to_float32_reports_no_float16_constant(build):
  # Its mask value finfo(float32).min meets float32 scores: the policy's program never
  # rounds it, so it is no hazard (it was "-inf in float16"), and the lint prints no
  # NumPy overflow warning (the suite turns warnings into errors; checked here too).
  x = jnp.ones((2, 5, 16))
  params, loss_fn = build(x, nn.make_causal_mask(jnp.ones((2, 5))))
  report = jmp.precision_report(loss_fn, params, x, policy=F16)
  assert report.count("matmul", jnp.float16) == 0 and report.count("matmul") > 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    found = jmp.precision_lint(loss_fn, params, x, policy=F16)
  assert [f for f in found if f.op == "constant"] == []
  reasons = _reasons(found)
  assert reasons and all(r.split(": ")[1].startswith(PINS) and MADE not in r for r in reasons)


def test_a_float16_mask_constant_is_still_reported():
  # The control: the same sentinel, a Python float, in a float16 jnp.where is -inf there.
  def loss_fn(params, x):
    scores = x @ params["w"]
    big_neg = float(jnp.finfo(jnp.float32).min)
    masked = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), scores, big_neg)
    return jnp.mean(jax.nn.softmax(masked.astype(jnp.float32)))

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    found = jmp.precision_lint(loss_fn, {"w": jnp.ones((8, 8))}, jnp.ones((8, 8)), policy=F16)
  assert [f.reason.split(":")[0] for f in found if f.op == "constant"] == [
      "-3.4028235e+38 is -inf in float16"]


def test_equinox_softmax_of_float32_logits_is_no_float16_sum():
  # Equinox's attention: softmax(logits.astype(float32)).astype(half). The sum reduces
  # float32 data; only its probabilities are rounded.
  linear = eqx.nn.Linear(16, 16, key=jax.random.key(0))

  def loss_fn(model, x):
    logits = jax.vmap(model)(x)
    p = jax.nn.softmax(logits.astype(jnp.float32)).astype(logits.dtype)
    return jnp.mean(p.astype(jnp.float32))

  found = jmp.precision_lint(loss_fn, linear, jnp.ones((8, 16)), policy=F16)
  assert [f for f in found if f.op in ("reduce_sum", "softmax/logsumexp")] == []

  def float16_sum(model, x):  # The control: a sum of float16 data, returned in float16.
    return jnp.sum(jax.vmap(model)(x), axis=-1).astype(jnp.float32).mean()

  [finding] = [f for f in jmp.precision_lint(float16_sum, linear, jnp.ones((8, 16)), policy=F16)
               if f.op == "reduce_sum"]
  assert "of float16 data returns float16" in finding.reason


class _EqxBatchNormNet(eqx.Module):
  linear: eqx.nn.Linear
  norm: eqx.nn.BatchNorm

  def __init__(self, key):
    self.linear = eqx.nn.Linear(16, 16, key=key)
    self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="ema")  # Equinox's default

  def __call__(self, x, state):
    return self.norm(self.linear(x), state)


def test_equinox_default_batchnorm_names_its_select_and_the_documented_fixes():
  net, state = eqx.nn.make_with_state(_EqxBatchNormNet)(jax.random.key(0))

  def loss_fn(model, state, x):
    y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean(y.astype(jnp.float32) ** 2), state

  [found] = jmp.precision_lint(loss_fn, net, jnp.ones((4, 16)), policy=F16, model_state=state)
  assert found.op == "select_n"
  assert "lax.select requires" in found.reason and "model-state leaf" in found.reason
  # The step never casts model state: the advice is autocast or mode="batch" (docs/equinox.md).
  assert "where it is made" not in found.reason
  assert "autocast=True" in found.reason and 'mode="batch"' in found.reason
  with pytest.raises(TypeError, match="select_n: .* mode=\"batch\""):
    jmp.precision_report(loss_fn, net, jnp.ones((4, 16)), policy=F16, model_state=state)


def test_nnx_batchnorm_names_its_dtype_none():
  # NNX BatchNorm (dtype=None) promotes its output to the float32 batch statistics it
  # computes: the next matmul is float32 because of the layer's dtype (setting it to
  # float16 fixes it), not the running statistics it only updates, nor a draw.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 16, rngs=rngs)
      self.norm = nnx.BatchNorm(16, rngs=rngs)
      self.b = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
      return self.b(self.norm(self.a(x)))

  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, rest, x):
    model = nnx.merge(graphdef, params, rest)
    return jnp.mean(model(x).astype(jnp.float32) ** 2), nnx.state(model, nnx.Not(nnx.Param))

  found = jmp.precision_lint(loss_fn, params, jnp.ones((4, 16)), policy=F16, model_state=rest)
  [reason] = _reasons(found)
  assert reason.split(": ")[1].startswith(PINS) and "dtype=float32 or None" in reason
  assert "model-state" not in reason and RANDOM not in reason


# --- a position table made in float32 beside a pinned layer or an explicit upcast ----


def _position_table(length, width):
  """A sinusoidal position table made inside the function: float32 (no dtype given)."""
  angle = jnp.arange(length)[:, None] / 10000.0 ** (jnp.arange(width // 2)[None] * 2 / width)
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)


class _PositionsThenPinned(nn.Module):
  """flax's wmt in its float32 config: a float32 position table, then pinned layers."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 16)(tokens) + _position_table(tokens.shape[1], 16)
    x = x.astype(jnp.float32)  # wmt's x.astype(config.dtype): float32 already.
    x = nn.relu(nn.Dense(16, dtype=jnp.float32)(nn.LayerNorm(dtype=jnp.float32)(x)))
    return nn.Dense(16, dtype=jnp.float32)(x)


def _pinned_problem():
  model, tokens = _PositionsThenPinned(), jnp.arange(16).reshape(2, 8) % 64
  params = model.init(jax.random.key(0), tokens)["params"]
  return lambda p, t: jnp.mean(model.apply({"params": p}, t) ** 2), params, tokens


def _upcast_problem(upcast=True):
  def loss_fn(params, tokens):
    x = params["embed"][tokens]
    if upcast:
      x = x.astype(jnp.float32)  # An explicit upcast, before the table meets it.
    x = x + _position_table(tokens.shape[1], 16)
    return jnp.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"]) ** 2)

  params = {k: jax.random.normal(jax.random.key(i), s) / 4 for i, (k, s) in enumerate(
      [("embed", (64, 16)), ("w1", (16, 16)), ("w2", (16, 16))])}
  return loss_fn, params, jnp.arange(16).reshape(2, 8) % 64


@pytest.mark.parametrize("problem", [_pinned_problem, _upcast_problem],
                         ids=["pinned_layers", "explicit_upcast"])
def test_a_position_table_is_not_blamed_for_what_a_pinned_layer_or_an_upcast_does(problem):
  # Fixing the table would leave every matmul in float32 (the layers, or the astype,
  # cast to float32 whatever it is); lint and the step's warning blamed it, 2 of 2.
  loss_fn, params, tokens = problem()
  reasons = _reasons(jmp.precision_lint(loss_fn, params, tokens, policy=F16))
  assert len(reasons) == 2
  for reason in reasons:
    assert reason.split(": ")[1].startswith(PINS) and MADE not in reason, reason
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1))
  with pytest.warns(jmp.NothingInHalfWarning) as caught:
    jmp.make_train_step(loss_fn, F16, donate=False)(state, tokens)
  (message,) = [str(w.message) for w in caught]
  assert f"precision_lint names the cause: {PINS}" in message and MADE not in message


def test_a_position_table_alone_is_named():
  # The control: without the upcast, the table is what makes the matmuls float32.
  loss_fn, params, tokens = _upcast_problem(upcast=False)
  reasons = _reasons(jmp.precision_lint(loss_fn, params, tokens, policy=F16))
  assert len(reasons) == 2 and all(r.split(": ")[1].startswith(MADE) for r in reasons)

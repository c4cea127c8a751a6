"""The model zoo's models: stock layers of flax.linen, flax.nnx and equinox.nn.

Each family of layers that has parameters, state or Python-number fields is
in one of three small models per framework, configured the way those
frameworks' users configure them (a ``dtype`` field, Python numbers in
modules, BatchNorm state, dropout keys):

* ``vision``: Conv, ConvTranspose, GroupNorm, BatchNorm, Dropout, max and
  average pooling, Dense/Linear;
* ``sequence``: Embed/Embedding, LayerNorm, RMSNorm, multi-head attention
  (with dropout), Dense/Linear;
* ``recurrent``: Embed/Embedding, an LSTM cell and a GRU cell scanned over
  time (``nn.RNN``, ``nnx.RNN``, ``jax.lax.scan``), Dense/Linear.

Every builder returns a :class:`Zoo`: jmp_lite's ``loss_fn``, its params and
model state, a batch maker (step -> batch), and the framework's own float32
train loop (``native(steps) -> losses``) for comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

CLASSES = 5
LR = 3e-3


@dataclasses.dataclass
class Zoo:
  loss_fn: Callable[..., Any]
  params: Any
  model_state: Any
  batch: Callable[[int], Any]
  native: Callable[[int], list[float]]


def _data(kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  if kind == "vision":
    x = rng.standard_normal((8, 8, 8, 3)).astype(np.float32)
  else:
    x = rng.integers(0, 20, (8, 6)).astype(np.int32)
  return x, rng.integers(0, CLASSES, (8,)).astype(np.int32)


def _xent(logits: jax.Array, y: jax.Array) -> jax.Array:
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _key(step: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(42), step)


# --- Flax Linen ---------------------------------------------------------------------


class LinenVision(nn.Module):
  dtype: Any = None  # The Flax convention: layers compute in this dtype (None: inputs').

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
    x = nn.GroupNorm(num_groups=2, dtype=self.dtype)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
    x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
    x = nn.ConvTranspose(8, (2, 2), strides=(2, 2), dtype=self.dtype)(x)
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.Dropout(0.1, deterministic=not train)(x.reshape(x.shape[0], -1))
    return nn.Dense(CLASSES, dtype=self.dtype)(x)


class LinenSequence(nn.Module):
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Embed(20, 16, dtype=self.dtype)(x)
    h = nn.LayerNorm(dtype=self.dtype)(h)
    h = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, dtype=self.dtype,
                                        deterministic=not train)(h, h)
    h = nn.RMSNorm(dtype=self.dtype)(h)
    return nn.Dense(CLASSES, dtype=self.dtype)(h.mean(axis=1))


class LinenRecurrent(nn.Module):
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    h = nn.Embed(20, 16, dtype=self.dtype)(x)
    h = nn.RNN(nn.LSTMCell(16, dtype=self.dtype))(h)
    h = nn.RNN(nn.GRUCell(16, dtype=self.dtype))(h)
    return nn.Dense(CLASSES, dtype=self.dtype)(h[:, -1])


def linen(kind: str) -> Zoo:
  model = {"vision": LinenVision, "sequence": LinenSequence, "recurrent": LinenRecurrent}[kind]()
  x, y = _data(kind)
  variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, False)
  params, stats = variables["params"], variables.get("batch_stats")

  def loss_fn(params, *rest):
    *state, batch = rest
    v = {"params": params, **({"batch_stats": state[0]} if state else {})}
    logits, new = model.apply(v, batch["x"], True, rngs={"dropout": batch["key"]},
                              mutable=["batch_stats"] if state else [])
    loss = _xent(logits, batch["y"])
    return (loss, new["batch_stats"]) if state else loss

  def native(steps: int) -> list[float]:
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(LR))

    @jax.jit
    def step(ts, stats, batch):
      def f(p):
        out = loss_fn(p, stats, batch) if stats is not None else loss_fn(p, batch)
        return out if stats is not None else (out, None)
      (loss, new_stats), grads = jax.value_and_grad(f, has_aux=True)(ts.params)
      return ts.apply_gradients(grads=grads), new_stats, loss

    losses, s = [], stats
    for i in range(steps):
      ts, s, loss = step(ts, s, {"x": x, "y": y, "key": _key(i)})
      losses.append(float(loss))
    return losses

  return Zoo(loss_fn, params, stats, lambda i: {"x": x, "y": y, "key": _key(i)}, native)


# --- Flax NNX -----------------------------------------------------------------------


class NnxVision(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.group = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.up = nnx.ConvTranspose(8, 8, (2, 2), strides=(2, 2), rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(4 * 4 * 8, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.bn(self.group(self.conv(x)))
    x = nnx.max_pool(nnx.relu(x), (2, 2), strides=(2, 2))
    x = nnx.avg_pool(self.up(x), (2, 2), strides=(2, 2))
    return self.head(self.dropout(x.reshape(x.shape[0], -1)))


class NnxSequence(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(20, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, 16, dropout_rate=0.1, decode=False, rngs=rngs)
    self.rms = nnx.RMSNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, CLASSES, rngs=rngs)

  def __call__(self, x):
    h = self.norm(self.embed(x))
    return self.head(self.rms(self.attention(h)).mean(axis=1))


class NnxRecurrent(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(20, 16, rngs=rngs)
    self.lstm = nnx.RNN(nnx.LSTMCell(16, 16, rngs=rngs))
    self.gru = nnx.RNN(nnx.GRUCell(16, 16, rngs=rngs))
    self.head = nnx.Linear(16, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(self.gru(self.lstm(self.embed(x)))[:, -1])


def _nnx_model(kind: str) -> nnx.Module:
  cls = {"vision": NnxVision, "sequence": NnxSequence, "recurrent": NnxRecurrent}[kind]
  model = cls(nnx.Rngs(params=0, dropout=1))
  model.train()
  return model


def nnx_zoo(kind: str) -> Zoo:
  x, y = _data(kind)
  graphdef, params, rest = nnx.split(_nnx_model(kind), nnx.Param, ...)

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    loss = _xent(model(batch["x"]), batch["y"])
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  def native(steps: int) -> list[float]:
    model = _nnx_model(kind)
    opt = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
      def f(model):
        return _xent(model(batch["x"]), batch["y"])
      loss, grads = nnx.value_and_grad(f)(model)
      opt.update(model, grads)
      return loss

    return [float(step(model, opt, {"x": x, "y": y})) for _ in range(steps)]

  return Zoo(loss_fn, params, rest, lambda i: {"x": x, "y": y}, native)


# --- Equinox ------------------------------------------------------------------------


class EqxVision(eqx.Module):
  conv: eqx.nn.Conv2d
  group: eqx.nn.GroupNorm
  bn: eqx.nn.BatchNorm
  pool: eqx.nn.MaxPool2d
  up: eqx.nn.ConvTranspose2d
  avg: eqx.nn.AvgPool2d
  dropout: eqx.nn.Dropout
  head: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 3)
    self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k[0])
    self.group = eqx.nn.GroupNorm(2, 8)
    self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="batch")
    self.pool = eqx.nn.MaxPool2d(2, stride=2)
    self.up = eqx.nn.ConvTranspose2d(8, 8, 2, stride=2, key=k[1])
    self.avg = eqx.nn.AvgPool2d(2, stride=2)
    self.dropout = eqx.nn.Dropout(0.1)
    self.head = eqx.nn.Linear(8 * 4 * 4, CLASSES, key=k[2])

  def __call__(self, x, state, key):  # One example, channels first.
    x, state = self.bn(self.group(self.conv(x)), state)
    x = self.avg(self.up(self.pool(jax.nn.relu(x))))
    return self.head(self.dropout(x.reshape(-1), key=key)), state


class EqxSequence(eqx.Module):
  embed: eqx.nn.Embedding
  norm: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  rms: eqx.nn.RMSNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(20, 16, key=k[0])
    self.norm = eqx.nn.LayerNorm(16)
    self.attention = eqx.nn.MultiheadAttention(2, 16, dropout_p=0.1, key=k[1])
    self.rms = eqx.nn.RMSNorm(16)
    self.head = eqx.nn.Linear(16, CLASSES, key=k[2])

  def __call__(self, x, state, key):
    h = jax.vmap(self.norm)(jax.vmap(self.embed)(x))
    h = jax.vmap(self.rms)(self.attention(h, h, h, key=key))
    return self.head(h.mean(axis=0)), state


class EqxRecurrent(eqx.Module):
  embed: eqx.nn.Embedding
  lstm: eqx.nn.LSTMCell
  gru: eqx.nn.GRUCell
  head: eqx.nn.Linear

  def __init__(self, key):
    k = jax.random.split(key, 4)
    self.embed = eqx.nn.Embedding(20, 16, key=k[0])
    self.lstm = eqx.nn.LSTMCell(16, 16, key=k[1])
    self.gru = eqx.nn.GRUCell(16, 16, key=k[2])
    self.head = eqx.nn.Linear(16, CLASSES, key=k[3])

  def __call__(self, x, state, key):
    del key
    h = jax.vmap(self.embed)(x)
    zeros = jnp.zeros(16, h.dtype)

    def cell(carry, xt):
      (hl, cl), hg = carry
      hl, cl = self.lstm(xt, (hl, cl))
      hg = self.gru(hl, hg)
      return ((hl, cl), hg), None

    (_, hg), _ = jax.lax.scan(cell, ((zeros, zeros), zeros), h)
    return self.head(hg), state


def equinox(kind: str) -> Zoo:
  cls = {"vision": EqxVision, "sequence": EqxSequence, "recurrent": EqxRecurrent}[kind]
  model, state = eqx.nn.make_with_state(cls)(jax.random.key(0))
  x, y = _data(kind)
  if kind == "vision":
    x = np.transpose(x, (0, 3, 1, 2))  # Equinox convolutions are channels first.

  def loss_fn(model, state, batch):
    keys = jax.random.split(batch["key"], batch["x"].shape[0])
    logits, new_state = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0),
                                 out_axes=(0, None))(batch["x"], state, keys)
    return _xent(logits, batch["y"]), new_state

  def native(steps: int) -> list[float]:
    m, s = model, state
    tx = optax.adam(LR)
    opt_state = tx.init(eqx.filter(m, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(m, s, opt_state, batch):
      (loss, s), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(m, s, batch)
      updates, opt_state = tx.update(grads, opt_state, eqx.filter(m, eqx.is_inexact_array))
      return eqx.apply_updates(m, updates), s, opt_state, loss

    losses = []
    for i in range(steps):
      m, s, opt_state, loss = step(m, s, opt_state, {"x": x, "y": y, "key": _key(i)})
      losses.append(float(loss))
    return losses

  return Zoo(loss_fn, model, state, lambda i: {"x": x, "y": y, "key": _key(i)}, native)


BUILDERS = {"linen": linen, "nnx": nnx_zoo, "equinox": equinox}

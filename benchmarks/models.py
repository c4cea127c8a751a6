"""Benchmark models (Flax Linen) and their synthetic data.

Every model is dtype-agnostic: it computes in the dtype of the params and
inputs it is given, so the same module serves the float32 step and the
mixed-precision steps (which cast params and inputs to the compute dtype).

Sizes come in two presets, ``cpu`` (small, a few tens of milliseconds per step
on two cores) and ``gpu`` (large enough to fill an H100-class device), plus a
``smoke`` preset for CI.

``deep_transformer`` is a 24-layer pre-LN Transformer encoder with 390
parameter leaves (the other models have 8 to 40), for the cost that grows with
the number of leaves. It is not in :data:`DEFAULT_MODELS` (what ``--model
all`` runs): on two CPU cores (jax 0.10.2) its steps take 75-140 ms, but
compiling the hand-written jmp step took 640 s and the Flax step 206 s (the
others 14-25 s), so a run with every variant lasts about 16 minutes.
``--variants f16_dynamic,f16_noscale`` takes about a minute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

DEFAULT_MODELS = ("mlp", "cnn", "transformer", "lstm")
MODELS = (*DEFAULT_MODELS, "deep_transformer")


class MLP(nn.Module):
  """Dense layers with ReLU, then a linear classifier head."""

  features: Sequence[int]
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for width in self.features:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class ResBlock(nn.Module):
  """Two 3x3 convolutions with GroupNorm and an identity skip."""

  channels: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.relu(nn.GroupNorm(num_groups=8)(nn.Conv(self.channels, (3, 3))(x)))
    y = nn.GroupNorm(num_groups=8)(nn.Conv(self.channels, (3, 3))(y))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A residual CNN with 8 conv layers: stem, 3 residual blocks of 2, head conv.

  Average pooling halves the resolution after the first two blocks, so every
  skip connection is an identity.
  """

  channels: int
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Conv(self.channels, (3, 3))(x))  # conv 1
    for i in range(3):  # convs 2-7
      x = ResBlock(self.channels)(x)
      if i < 2:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(2 * self.channels, (3, 3))(x))  # conv 8
    return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class EncoderBlock(nn.Module):
  """Pre-LayerNorm Transformer encoder block: self-attention, then a GELU MLP."""

  d_model: int
  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
    y = nn.LayerNorm()(x)
    y = nn.Dense(self.d_model)(nn.gelu(nn.Dense(self.mlp_dim)(y)))
    return x + y


class ViT(nn.Module):
  """A Vision Transformer from stock Linen layers: conv patches, a class token,
  learned positions, pre-LayerNorm encoder blocks and a linear head."""

  patch: int
  hidden: int
  heads: int
  layers: int
  classes: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    x = nn.Conv(self.hidden, (self.patch, self.patch), strides=self.patch)(images)
    x = x.reshape(x.shape[0], -1, self.hidden)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, self.hidden))
    x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (x.shape[0], 1, self.hidden)), x],
                        axis=1)
    pos = self.param("pos", nn.initializers.normal(0.02), x.shape[1:])
    x = x + pos.astype(x.dtype)
    for _ in range(self.layers):
      x = EncoderBlock(self.hidden, self.heads, self.mlp_ratio * self.hidden)(x)
    return nn.Dense(self.classes)(nn.LayerNorm()(x[:, 0]))


class Transformer(nn.Module):
  """Token and position embeddings, an encoder stack and a per-token vocab head."""

  vocab: int
  seq_len: int
  d_model: int
  num_heads: int
  mlp_dim: int
  num_layers: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.d_model)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
    x = x + pos.astype(x.dtype)
    for _ in range(self.num_layers):
      x = EncoderBlock(self.d_model, self.num_heads, self.mlp_dim)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class LSTMLayer(nn.Module):
  """One LSTM layer over a (batch, time, features) sequence.

  The input projection of all time steps is one large matmul; ``lax.scan``
  runs only the recurrent matmul and the gates, as cuDNN-style LSTMs do. The
  carry takes the dtype of the input, so the recurrence runs in the compute
  dtype.
  """

  hidden: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    gates_x = nn.Dense(4 * self.hidden, name="input")(x)  # (B, T, 4N), includes the bias
    w_h = self.param(
        "recurrent", nn.initializers.lecun_normal(), (self.hidden, 4 * self.hidden)
    )
    w_h = w_h.astype(gates_x.dtype)

    def cell(carry, gx):
      h, c = carry
      i, f, g, o = jnp.split(gx + h @ w_h, 4, axis=-1)
      c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
      h = nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), h

    zeros = jnp.zeros((x.shape[0], self.hidden), gates_x.dtype)
    _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(gates_x, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


class LSTMLM(nn.Module):
  """A word-level LSTM language model: embedding, L LSTM layers, vocab head."""

  vocab: int
  hidden: int
  num_layers: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.hidden)(tokens)
    for _ in range(self.num_layers):
      x = LSTMLayer(self.hidden)(x)
    return nn.Dense(self.vocab)(x)


# Per-model size presets. "layers" and "hidden" are the knobs --layers/--hidden
# override: the depth and width of each model.
PRESETS: dict[str, dict[str, dict[str, int]]] = {
    "smoke": {
        "mlp": dict(batch=32, in_dim=64, hidden=64, layers=2, classes=10),
        "cnn": dict(batch=4, image=16, hidden=8, classes=10),
        "transformer": dict(batch=4, seq_len=16, hidden=32, layers=1, heads=2, vocab=64),
        "lstm": dict(batch=4, seq_len=8, hidden=32, layers=2, vocab=64),
        "deep_transformer": dict(
            batch=2, seq_len=8, hidden=16, layers=4, heads=2, vocab=32, mlp_ratio=2
        ),
    },
    "cpu": {
        # The MLP of issue 3: four 1024-wide layers, batch 256, Adam.
        "mlp": dict(batch=256, in_dim=1024, hidden=1024, layers=4, classes=10),
        "cnn": dict(batch=32, image=32, hidden=32, classes=10),
        "transformer": dict(batch=16, seq_len=128, hidden=256, layers=2, heads=4, vocab=2048),
        "lstm": dict(batch=32, seq_len=35, hidden=256, layers=2, vocab=4096),
        # Issue 13's deep model: 24 layers, 16 leaves each, 390 leaves in all.
        "deep_transformer": dict(
            batch=8, seq_len=32, hidden=64, layers=24, heads=2, vocab=256, mlp_ratio=2
        ),
    },
    "gpu": {
        "mlp": dict(batch=4096, in_dim=1024, hidden=4096, layers=4, classes=1000),
        "cnn": dict(batch=256, image=32, hidden=128, classes=10),
        "transformer": dict(batch=32, seq_len=512, hidden=1024, layers=6, heads=16, vocab=32768),
        "lstm": dict(batch=256, seq_len=35, hidden=1536, layers=2, vocab=10240),
        "deep_transformer": dict(
            batch=16, seq_len=512, hidden=1024, layers=24, heads=16, vocab=32768, mlp_ratio=4
        ),
    },
}


@dataclasses.dataclass
class Problem:
  """A model with its initial params, one batch of data and a loss.

  Attributes:
    name: the model name.
    config: the sizes used.
    params: float32 initial params.
    batch: ``{"x": inputs, "y": integer labels}``.
    loss_fn: ``loss_fn(params, batch) -> scalar``, computing in the dtype of
      ``params`` and ``batch["x"]``; the logits are upcast to float32 for the
      softmax cross-entropy.
    examples: examples per step (the batch size).
    activation_heavy: whether activations dominate memory (the GPU memory bar
      is checked on these).
  """

  name: str
  config: dict[str, int]
  params: Any
  batch: dict[str, jax.Array]
  loss_fn: Callable[[Any, Any], jax.Array]
  examples: int
  activation_heavy: bool


def build_problem(
    name: str,
    preset: str,
    *,
    batch: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    seed: int = 0,
) -> Problem:
  """Builds model ``name`` at size ``preset`` with random data (never zeros).

  Args:
    name: one of :data:`MODELS`.
    preset: ``"smoke"``, ``"cpu"`` or ``"gpu"``.
    batch: overrides the preset's batch size.
    layers: overrides the depth (MLP, Transformer and LSTM layers).
    hidden: overrides the width (MLP width, Transformer d_model, LSTM hidden
      size, CNN channels).
    seed: PRNG seed for params and data.

  Returns:
    A :class:`Problem`.

  Raises:
    ValueError: for an unknown model or preset, or a size < 1.
  """
  if name not in MODELS:
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")
  if preset not in PRESETS:
    raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
  cfg = dict(PRESETS[preset][name])
  for key, value in (("batch", batch), ("layers", layers), ("hidden", hidden)):
    if value is not None:
      if value < 1:
        raise ValueError(f"{key} must be >= 1, got {value!r}")
      cfg[key] = value
  k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
  b = cfg["batch"]

  if name == "mlp":
    module = MLP(features=(cfg["hidden"],) * cfg["layers"], num_classes=cfg["classes"])
    x = jax.random.normal(k_x, (b, cfg["in_dim"]), jnp.float32)
    y = jax.random.randint(k_y, (b,), 0, cfg["classes"])
    heavy = False
  elif name == "cnn":
    module = ResNet(channels=cfg["hidden"], num_classes=cfg["classes"])
    x = jax.random.normal(k_x, (b, cfg["image"], cfg["image"], 3), jnp.float32)
    y = jax.random.randint(k_y, (b,), 0, cfg["classes"])
    heavy = True
  elif name in ("transformer", "deep_transformer"):
    d = cfg["hidden"]
    if d % cfg["heads"]:
      raise ValueError(f"hidden ({d}) must be a multiple of heads ({cfg['heads']})")
    module = Transformer(
        vocab=cfg["vocab"],
        seq_len=cfg["seq_len"],
        d_model=d,
        num_heads=cfg["heads"],
        mlp_dim=cfg.get("mlp_ratio", 4) * d,
        num_layers=cfg["layers"],
    )
    x = jax.random.randint(k_x, (b, cfg["seq_len"]), 0, cfg["vocab"])
    y = jax.random.randint(k_y, (b, cfg["seq_len"]), 0, cfg["vocab"])
    heavy = True
  else:  # lstm
    module = LSTMLM(vocab=cfg["vocab"], hidden=cfg["hidden"], num_layers=cfg["layers"])
    x = jax.random.randint(k_x, (b, cfg["seq_len"]), 0, cfg["vocab"])
    # Next-token targets: the input shifted by one.
    y = jnp.concatenate([x[:, 1:], jax.random.randint(k_y, (b, 1), 0, cfg["vocab"])], axis=1)
    heavy = True

  params = jax.jit(module.init)(k_init, x)["params"]

  def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    logits = module.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["y"]
    ).mean()

  return Problem(
      name=name,
      config=cfg,
      params=params,
      batch={"x": x, "y": y},
      loss_fn=loss_fn,
      examples=b,
      activation_heavy=heavy,
  )


def build_leaf_problem(leaves: int, leaf_size: int, *, seed: int = 0) -> Problem:
  """A model of ``leaves`` vectors of ``leaf_size`` floats with a trivial loss.

  The loss, ``sum_i mean(tanh(p_i * x))`` over the leaves ``p_i`` and one data
  vector ``x``, costs a few element-wise ops per float, so the optimizer and
  the per-leaf work of loss scaling dominate the step. The batch is
  ``{"x": x}``.

  Args:
    leaves: the number of parameter leaves, named ``p0000``, ``p0001``...
    leaf_size: the floats in each leaf.
    seed: the NumPy seed for params and data.

  Returns:
    A :class:`Problem` named ``"leaves"``.

  Raises:
    ValueError: if ``leaves`` or ``leaf_size`` is < 1.

  Examples:
    >>> problem = build_leaf_problem(3, 4)
    >>> sorted(problem.params), problem.params["p0000"].shape
    (['p0000', 'p0001', 'p0002'], (4,))
    >>> problem.loss_fn(problem.params, problem.batch).shape
    ()
  """
  for key, value in (("leaves", leaves), ("leaf_size", leaf_size)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{key} must be an int >= 1, got {value!r}")
  rng = np.random.default_rng(seed)
  values = rng.standard_normal((leaves + 1, leaf_size), np.float32)
  params = {f"p{i:04d}": jnp.asarray(v) for i, v in enumerate(values[:-1])}

  def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return sum(jnp.mean(jnp.tanh(p * batch["x"])) for p in params.values())

  return Problem(
      name="leaves",
      config=dict(leaves=leaves, leaf_size=leaf_size),
      params=params,
      batch={"x": jnp.asarray(values[-1])},
      loss_fn=loss_fn,
      examples=1,
      activation_heavy=False,
  )

"""The oracle's models: an MLP, a CNN, an LSTM and a Transformer, as plain JAX functions.

Parameters are flat ``{name: float32 array}`` dicts built in NumPy, so the same
arrays start both sides (JAX and torch) and each optimizer's state can be
matched to its parameter by name. ``apply(params, x, act)`` returns the
model's outputs; :mod:`benchmarks.optim_oracle.problems` adds the loss.

Shapes are chosen so that every tensor of at least 4,096 elements has a
multiple of 256 elements: torchao codes exactly those (``AdamW8bit`` and
``AdamWFp8`` keep tensors below 4,096 elements, or not a multiple of their
block of 256, in float32), and ``quantize_state`` at its default ``min_size``
of 4,096 codes the same ones.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
  return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def _zeros(*shape: int) -> np.ndarray:
  return np.zeros(shape, np.float32)


# ------------------------------------------------------------------ MLP


def mlp_init(rng: np.random.Generator, sizes: tuple[int, ...]) -> Params:
  """Kernels ``w{i}`` (normal / sqrt(fan in)) and zero biases ``b{i}`` for ``sizes``."""
  p: Params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    p[f"w{i}"] = _normal(rng, (n_in, n_out), n_in)
    p[f"b{i}"] = _zeros(n_out)
  return p


def mlp_apply(p: Params, x: jax.Array, act: str) -> jax.Array:
  """``act`` between the dense layers, none after the last."""
  layers = len([k for k in p if k.startswith("w")])
  for i in range(layers):
    x = x @ p[f"w{i}"] + p[f"b{i}"]
    if i < layers - 1:
      x = ACTIVATIONS[act](x)
  return x


# ------------------------------------------------------------------ CNN


def cnn_init(rng: np.random.Generator, sizes: tuple[int, ...]) -> Params:
  """``sizes = (side, c1, c2, classes)``: two 3x3 convolutions, a 2x2 mean pool, a dense head."""
  side, c1, c2, classes = sizes
  flat = (side // 2) ** 2 * c2
  return {"conv0": _normal(rng, (3, 3, 1, c1), 9), "cb0": _zeros(c1),
          "conv1": _normal(rng, (3, 3, c1, c2), 9 * c1), "cb1": _zeros(c2),
          "w": _normal(rng, (flat, classes), flat), "b": _zeros(classes)}


def _conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return y + b


def cnn_apply(p: Params, images: jax.Array, act: str) -> jax.Array:
  """Class logits of ``(batch, side, side, 1)`` images."""
  f = ACTIVATIONS[act]
  h = f(_conv(f(_conv(images, p["conv0"], p["cb0"])), p["conv1"], p["cb1"]))
  n, side, _, c = h.shape
  h = h.reshape(n, side // 2, 2, side // 2, 2, c).mean(axis=(2, 4))
  return h.reshape(n, -1) @ p["w"] + p["b"]


# ------------------------------------------------------------------ LSTM


def lstm_init(rng: np.random.Generator, sizes: tuple[int, ...]) -> Params:
  """``sizes = (vocab, hidden)``: one-hot input, one LSTM layer, a dense readout."""
  vocab, hidden = sizes
  return {"wx": _normal(rng, (vocab, 4 * hidden), vocab),
          "wh": _normal(rng, (hidden, 4 * hidden), hidden),
          "b": np.concatenate([_zeros(hidden), np.ones(hidden, np.float32), _zeros(2 * hidden)]),
          "wo": _normal(rng, (hidden, vocab), hidden), "bo": _zeros(vocab)}


def lstm_apply(p: Params, tokens: jax.Array, act: str) -> jax.Array:
  """Next-token logits ``(batch, time, vocab)``; ``act`` is the cell's (tanh in an LSTM)."""
  f = ACTIVATIONS[act]
  vocab, hidden = p["wx"].shape[0], p["wh"].shape[0]
  gx = jax.nn.one_hot(tokens, vocab, dtype=jnp.float32) @ p["wx"] + p["b"]

  def cell(carry: tuple[jax.Array, jax.Array], g: jax.Array) -> Any:
    h, c = carry
    i, fg, o, u = jnp.split(g + h @ p["wh"], 4, axis=-1)
    c = jax.nn.sigmoid(fg) * c + jax.nn.sigmoid(i) * f(u)
    h = jax.nn.sigmoid(o) * f(c)
    return (h, c), h

  zeros = jnp.zeros((tokens.shape[0], hidden), jnp.float32)
  _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(gx, 0, 1))
  return jnp.swapaxes(hs, 0, 1) @ p["wo"] + p["bo"]


# ------------------------------------------------------------------ Transformer


def transformer_init(rng: np.random.Generator, sizes: tuple[int, ...]) -> Params:
  """``sizes = (vocab, seq, d, mlp)``: one pre-LayerNorm block, 4 heads, causal."""
  vocab, seq, d, mlp = sizes
  return {"embed": _normal(rng, (vocab, d), 1), "pos": 0.1 * _normal(rng, (seq, d), 1),
          "ln1": np.ones(d, np.float32), "wqkv": _normal(rng, (d, 3 * d), d),
          "wo": _normal(rng, (d, d), d), "ln2": np.ones(d, np.float32),
          "w1": _normal(rng, (d, mlp), d), "b1": _zeros(mlp),
          "w2": _normal(rng, (mlp, d), mlp), "b2": _zeros(d),
          "lnf": np.ones(d, np.float32), "head": _normal(rng, (d, vocab), d)}


def _norm(x: jax.Array, g: jax.Array) -> jax.Array:
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def transformer_apply(p: Params, tokens: jax.Array, act: str, heads: int = 4) -> jax.Array:
  """Next-token logits ``(batch, time, vocab)``; ``act`` is the MLP's."""
  n, t = tokens.shape
  d = p["wo"].shape[0]
  x = p["embed"][tokens] + p["pos"][:t]
  q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["wqkv"], 3, axis=-1)
  q, k, v = (a.reshape(n, t, heads, d // heads) for a in (q, k, v))
  scores = jnp.einsum("nqhc,nkhc->nhqk", q, k) / np.sqrt(d // heads)
  scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -1e9)
  att = jnp.einsum("nhqk,nkhc->nqhc", jax.nn.softmax(scores, axis=-1), v)
  x = x + att.reshape(n, t, d) @ p["wo"]
  x = x + ACTIVATIONS[act](_norm(x, p["ln2"]) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  return _norm(x, p["lnf"]) @ p["head"]


MODELS = {"mlp": (mlp_init, mlp_apply), "cnn": (cnn_init, cnn_apply),
          "lstm": (lstm_init, lstm_apply), "transformer": (transformer_init, transformer_apply)}

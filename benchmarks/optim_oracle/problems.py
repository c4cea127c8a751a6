"""The oracle's problem matrix: model, activation, data, steps, learning rate, weight decay.

Data are made in NumPy, from the seed (a teacher network, a Markov chain) or
from scikit-learn's digits, as a pool of examples and a ``(steps, batch)``
array of indices into it: step ``t`` of every optimizer, on either side, sees
``pool[indices[t]]``. A seed sets the initial weights, the batch order and
(except for the digits) the data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.optim_oracle import models

POOL = 2048  # training examples (sequences) per problem; the digits have 1,797 in all
EVAL = 256  # held-out examples for the final loss
BATCH = 32  # examples per step (16 sequences of 16 tokens for the Transformer)


@dataclasses.dataclass(frozen=True)
class Problem:
  """One cell of the matrix.

  Attributes:
    name: its key.
    model: a key of :data:`models.MODELS`.
    activation: a key of :data:`models.ACTIVATIONS`.
    sizes: the model's sizes (see its ``*_init``).
    data: a key of :data:`DATA`.
    steps: optimizer steps.
    lr: AdamW's learning rate (lion gets ``lr / 10``, sgd ``10 lr``).
    weight_decay: AdamW's (and lion's) decoupled weight decay.
    note: why it is in the matrix, for the report.
  """

  name: str
  model: str
  activation: str
  sizes: tuple[int, ...]
  data: str
  steps: int
  lr: float
  weight_decay: float
  note: str = ""

  def describe(self) -> str:
    """``mlp 32-128-64-10 gelu``: the model in a few words."""
    return f"{self.model} {'-'.join(map(str, self.sizes))} {self.activation}"


# ------------------------------------------------------------------ data


def _teacher_regression(rng: np.random.Generator, sizes: tuple[int, ...], n: int) -> Any:
  """``y = sin(2 x t / sqrt(d))`` for normal ``x`` and a random ``t``."""
  d, out = sizes[0], sizes[-1]
  t = rng.standard_normal((d, out)).astype(np.float32)
  x = rng.standard_normal((n, d)).astype(np.float32)
  return x, np.sin(x @ t / np.sqrt(d) * 2).astype(np.float32)


def _teacher_classes(rng: np.random.Generator, sizes: tuple[int, ...], n: int) -> Any:
  """Labels of normal ``x`` by a random tanh teacher (``d -> 64 -> classes``)."""
  d, classes = sizes[0], sizes[-1]
  w1 = rng.standard_normal((d, 64)) / np.sqrt(d)
  w2 = rng.standard_normal((64, classes))
  x = rng.standard_normal((n, d)).astype(np.float32)
  return x, np.argmax(np.tanh(x @ w1 * 2) @ w2, axis=1).astype(np.int32)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  d = load_digits()
  return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


def _digit_vectors(rng: np.random.Generator, sizes: tuple[int, ...], n: int) -> Any:
  """scikit-learn's 1,797 8x8 digits, as 64 features in [0, 1], shuffled."""
  x, y = _digits()
  order = rng.permutation(len(y))
  return x[order], y[order]


def _digit_images(rng: np.random.Generator, sizes: tuple[int, ...], n: int) -> Any:
  x, y = _digit_vectors(rng, sizes, n)
  return x.reshape(-1, 8, 8, 1), y


def _markov_tokens(rng: np.random.Generator, sizes: tuple[int, ...], n: int) -> Any:
  """Sequences of an order-2 Markov chain over ``vocab`` tokens, 3 successors per context.

  Inputs are tokens ``0..seq-1`` of each sequence, targets ``1..seq``.
  """
  vocab, seq = sizes[0], (sizes[1] if len(sizes) == 4 else 16)
  succ = rng.integers(0, vocab, (vocab, vocab, 3))
  weights = rng.dirichlet(np.ones(3), (vocab, vocab))
  out = np.empty((n, seq + 1), np.int32)
  out[:, :2] = rng.integers(0, vocab, (n, 2))
  for t in range(2, seq + 1):
    a, b = out[:, t - 2], out[:, t - 1]
    pick = (rng.random(n)[:, None] > np.cumsum(weights[a, b], axis=1)).sum(1)
    out[:, t] = succ[a, b, np.minimum(pick, 2)]
  return out[:, :-1], out[:, 1:]


DATA: dict[str, Callable[..., Any]] = {
    "teacher_regression": _teacher_regression, "teacher_classes": _teacher_classes,
    "digit_vectors": _digit_vectors, "digit_images": _digit_images,
    "markov_tokens": _markov_tokens}


# ------------------------------------------------------------------ the matrix

_MLP_REG, _GELU_CLS = (64, 64, 64), (32, 128, 64, 10)
_CNN, _LSTM, _TRF = (8, 16, 32, 10), (32, 32), (32, 16, 64, 64)
PROBLEMS = {p.name: p for p in (
    Problem("mlp_tanh", "mlp", "tanh", _MLP_REG, "teacher_regression", 300, 3e-3, 1e-2,
            "the earlier benchmark's problem, smaller"),
    Problem("gelu_classifier", "mlp", "gelu", _GELU_CLS, "teacher_classes", 200, 3e-3, 1e-4,
            "the issue's case: a 3-layer GELU classifier, 200 AdamW steps at lr 3e-3"),
    Problem("relu_digits", "mlp", "relu", (64, 64, 64, 10), "digit_vectors", 500, 1e-3, 0.0),
    Problem("tanh_slow", "mlp", "tanh", (64, 64, 8), "teacher_regression", 2000, 1e-4, 0.0,
            "the longest run and the smallest lr"),
    Problem("gelu_deep_fast", "mlp", "gelu", (64, 64, 64, 64, 10), "teacher_classes", 300, 1e-2,
            1e-2, "the largest lr"),
    Problem("cnn_relu", "cnn", "relu", _CNN, "digit_images", 300, 1e-3, 1e-4),
    Problem("cnn_gelu", "cnn", "gelu", _CNN, "digit_images", 200, 3e-3, 0.0),
    Problem("cnn_tanh_fast", "cnn", "tanh", _CNN, "digit_images", 150, 1e-2, 1e-2),
    Problem("lstm", "lstm", "tanh", _LSTM, "markov_tokens", 300, 3e-3, 1e-2),
    Problem("lstm_fast", "lstm", "tanh", _LSTM, "markov_tokens", 100, 1e-2, 0.0),
    Problem("transformer_gelu", "transformer", "gelu", _TRF, "markov_tokens", 200, 1e-3, 1e-2),
    Problem("transformer_relu_slow", "transformer", "relu", _TRF, "markov_tokens", 300, 3e-4,
            0.0),
    Problem("transformer_gelu_fast", "transformer", "gelu", _TRF, "markov_tokens", 100, 1e-2,
            1e-2),
)}


# ------------------------------------------------------------------ a problem, instantiated


@dataclasses.dataclass(frozen=True)
class Instance:
  """A problem at one seed: initial weights, data, batches and the loss.

  Attributes:
    params: the initial weights, ``{name: float32 array}``.
    x, y: the training pool.
    eval_x, eval_y: held-out examples for the final loss.
    batches: ``(steps, batch)`` indices into the pool.
    loss: ``loss(params, x, y)``, a JAX scalar.
  """

  params: dict[str, np.ndarray]
  x: np.ndarray
  y: np.ndarray
  eval_x: np.ndarray
  eval_y: np.ndarray
  batches: np.ndarray
  loss: Callable[[Any, Any, Any], jax.Array]


def make_loss(problem: Problem) -> Callable[[Any, Any, Any], jax.Array]:
  """Mean squared error for regression, softmax cross-entropy for labels and tokens."""
  apply = models.MODELS[problem.model][1]
  regression = problem.data == "teacher_regression"

  def loss(params: Any, x: Any, y: Any) -> jax.Array:
    out = apply(params, x, problem.activation)
    if regression:
      return jnp.mean((out - y) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

  return loss


def instance(problem: Problem, seed: int, steps: int | None = None) -> Instance:
  """``problem`` at ``seed`` (``steps`` overrides the problem's number of batches)."""
  rng = np.random.default_rng([seed, sum(map(ord, problem.name))])
  params = models.MODELS[problem.model][0](rng, problem.sizes)
  x, y = DATA[problem.data](rng, problem.sizes, POOL + EVAL)
  n_train = len(y) - EVAL
  batch = BATCH // 2 if problem.model == "transformer" else BATCH  # 16 x 16 tokens
  batches = rng.integers(0, n_train, (problem.steps if steps is None else steps, batch))
  return Instance(params, x[:n_train], y[:n_train], x[n_train:], y[n_train:],
                  batches.astype(np.int32), make_loss(problem))

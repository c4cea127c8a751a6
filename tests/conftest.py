"""Shared fixtures and helpers.

``maybe_jit`` runs numeric checks both eagerly and under ``jax.jit``. The plain
functions below are imported by the test modules (``from conftest import ...``):
the bit-for-bit tree comparison, and the two small MLP problems that several
modules train.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """``maybe_jit(f)`` is ``f`` itself or ``jax.jit(f)``."""
  return jax.jit if request.param else (lambda f: f)


# ------------------------------------------------------------ bit-for-bit trees


def host(tree):
  """Host copies (PRNG keys as their key data), so that donated buffers can be compared later."""
  def one(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.array(x, copy=True)
  return jax.tree.map(one, tree)


def assert_bitwise_equal(a, b):
  """Same tree structure and, leaf by leaf, the same dtype, shape and bytes.

  Bytes, not values: ``-0.0`` differs from ``+0.0`` and NaN equals only the same NaN.
  """
  leaves_a, tree_a = jax.tree.flatten(host(a))
  leaves_b, tree_b = jax.tree.flatten(host(b))
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    assert (x.dtype, x.shape) == (y.dtype, y.shape)
    assert x.tobytes() == y.tobytes(), (x, y)


# ------------------------------------------------------- a small MLP classifier


def classifier_params(seed=0):
  """A 6 -> 16 -> 3 tanh MLP (float32 unless x64 is on)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
      "w1": jax.random.normal(k1, (6, 16)) * 0.5,
      "b1": jax.random.normal(k2, (16,)) * 0.1,
      "w2": jax.random.normal(k3, (16, 3)) * 0.3,
  }


def classifier_batch(seed=1, n=32):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (n, 6)), "y": jax.random.randint(ky, (n,), 0, 3)}


def classifier_loss(params, batch):
  """Softmax cross-entropy of the classifier, computed on float32 logits."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  logits = (h @ params["w2"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# ------------------------------------------------ a small MLP regression, poisoned


def regression_params(seed, n_in, n_hidden, n_out, *, w1_std, b1, w2_std):
  """``{"w1", "b1", "w2"}`` for ``regression_loss``: normal weights, a constant bias."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "w1": jax.random.normal(k1, (n_in, n_hidden)) * w1_std,
      "b1": jnp.full((n_hidden,), b1),
      "w2": jax.random.normal(k2, (n_hidden, n_out)) * w2_std,
  }


def regression_loss(params, batch):
  """Mean squared error of a tanh MLP, in float32, times ``batch["poison"]`` if present.

  A poison of NaN or inf makes the whole step overflow; 1.0 leaves the loss as it is.
  """
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  pred = (h @ params["w2"]).astype(jnp.float32)
  loss = jnp.mean((pred - batch["y"].astype(jnp.float32)) ** 2)
  if "poison" in batch:
    loss = loss * batch["poison"].astype(jnp.float32)
  return loss

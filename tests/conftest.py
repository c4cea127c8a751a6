"""Shared fixtures and helpers.

``maybe_jit`` runs numeric checks both eagerly and under ``jax.jit``. The plain
functions below are imported by the test modules (``from conftest import ...``):
the bit-for-bit tree comparison, the two small MLP problems that several
modules train, and plain-Python reference models of the two loss-scale schedules
(torch's GradScaler and jmp's ``DynamicLossScale.adjust``). The models are
written from the reference semantics, never from jmp_lite's own rule.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest


class Traces:
  """Counts the traces of the functions it wraps: ``f = traces(f)``, then ``traces.count``.

  Tests that a jitted step compiles once count its traces rather than read
  ``_cache_size()``. jax's C++ jit cache holds at most 8,192 functions, and a
  function pins its entry until Python frees it (for one in a reference
  cycle, at the next cyclic garbage collection), so late in a long test
  process a new jitted function may get no entry at all: ``_cache_size()``
  then reads 0 although nothing retraced, and the calls take jax's Python path.
  """

  def __init__(self):
    self.count = 0

  def __call__(self, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
      self.count += 1
      return fn(*args, **kwargs)
    return counted


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


# ------------------------------------------- reference models of the scale schedules

_INT32_MAX = int(np.iinfo(np.int32).max)


def gradscaler_model(pattern, init_scale, growth_factor, backoff_factor, growth_interval,
                     min_scale=0.0, max_scale=math.inf):
  """torch.amp.GradScaler's scale update rule plus a floor and a cap, in float32.

  GradScaler keeps the scale as a float32 tensor; ``update(found_inf)`` does::

    if found_inf: scale *= backoff_factor; tracker = 0
    else:
      tracker += 1
      if tracker == growth_interval:
        if isfinite(scale * growth_factor): scale *= growth_factor
        tracker = 0

  jmp_lite adds ``scale = max(scale, min_scale)`` after a backoff and
  ``scale = min(scale, max_scale, 2**126)`` after a growth, saturates the
  tracker at int32 max, and counts skipped steps (all, and the current run).

  Args:
    pattern: one bool per step, True where the gradients are finite.
    init_scale, growth_factor, backoff_factor, growth_interval: GradScaler's.
    min_scale, max_scale: the floor and the cap (a cap above 2**126, the
      largest usable scale, is 2**126).

  Returns:
    ``(used, after)``: the scale used on each step, and after each step the
    tuple ``(scale, tracker, skipped, consecutive_skips)``.
  """
  f32 = np.float32
  scale, tracker, skipped, consecutive = f32(init_scale), 0, 0, 0
  lo = f32(min_scale)
  hi = f32(min(max_scale, 2.0**126))
  used, after = [], []
  for finite in pattern:
    used.append(scale)
    with np.errstate(over="ignore"):
      if finite:
        tracker = min(tracker + 1, _INT32_MAX)
        consecutive = 0
        if tracker >= growth_interval:
          grown = scale * f32(growth_factor)
          scale = min(grown if np.isfinite(grown) else scale, hi)
          tracker = 0
      else:
        scale = max(scale * f32(backoff_factor), lo)
        tracker = 0
        skipped += 1
        consecutive += 1
    after.append((scale, tracker, skipped, consecutive))
  return used, after


def jmp_adjust_model(pattern, scale, period, factor, floor, dtype=np.float32):
  """jmp's ``DynamicLossScale.adjust`` rule from a zero counter, in the scale's dtype::

    if finite:
      if counter == period - 1: scale *= factor (unless that overflows); counter = 0
      else: counter += 1
    else: scale = max(floor, scale / factor); counter = 0

  Args:
    pattern: one bool per ``adjust`` call, True where the gradients are finite.
    scale, period, factor, floor: the loss scale's; ``floor`` is ``min_loss_scale``.
    dtype: the dtype the scale is kept in.

  Returns:
    ``(scale, counter)`` after each call.
  """
  dtype = np.dtype(dtype)
  scale, factor, floor = dtype.type(scale), dtype.type(factor), dtype.type(floor)
  counter, out = 0, []
  for finite in pattern:
    with np.errstate(over="ignore"):
      if finite:
        if counter == period - 1:
          grown = scale * factor
          scale = grown if np.isfinite(grown) else scale
          counter = 0
        else:
          counter += 1
      else:
        scale = max(floor, scale / factor)
        counter = 0
    out.append((scale, counter))
  return out

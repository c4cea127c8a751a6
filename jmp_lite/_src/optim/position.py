"""Which state leaves set the params' position rather than the size of a step, measured on the update.

Most optimizers step: Adam's update is ``-lr * m / (sqrt(v) + eps)``, and
a rounding error of ``e`` (relative) in ``m`` changes the update by ``e``
of itself, in ``v`` by ``e / 2``. Dual-averaging and parameter-free methods
set a position: madgrad's params move towards ``x0 - s / cbrt(sum_sq)``
and cocob's are the initial ones plus a function of its sums, so a relative
error ``e`` in such a sum moves the params by ``e`` of the whole distance
they have travelled, many steps' worth, at every update. A 4-bit code's
rounding (a few percent of a block's largest) then sets the loss: in
``tests/test_contrib_quantized.py``'s regression, madgrad and cocob ended
at 6-9x float32's loss in ``"int4"``, within 6% in ``"int8"``.

:func:`position_leaves` measures it on the update itself, on small stand-in
params (at most 2 elements an axis, so the cost does not grow with the
model): after :data:`STEPS` updates on random gradients, the **gain** of
each state leaf is ``|d update / d leaf . leaf| / |update|``, the update's
relative change for a relative change of the leaf. Adam's moments have
gains of 1 and 1/2 (by central differences); a leaf with a gain of at least :data:`POSITION_GAIN`
sets a position. :func:`jmp_lite.quantize_state` codes such leaves in 8
bits when asked for 4, and warns.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

STEPS = 64  # updates on gradients of 1 plus noise before the gains are measured
PULL = 0.05  # an update whose derivative in the params is at most -PULL pulls them somewhere
POSITION_GAIN = 2.0  # a leaf whose gain is at least this sets a position
_SIDE = 2  # each axis of the stand-in params is at most this long


def stand_in(params: Any) -> Any:
  """Small params of ``params``' structure: each floating leaf (or its shape) as 0.5s, at most 2 an axis."""
  def small(x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")
            and jnp.issubdtype(x.dtype, jnp.inexact)):
      return x
    return jnp.full(tuple(min(int(d), _SIDE) for d in x.shape), 0.5, x.dtype)
  return jax.tree.map(small, params)


def _floats(tree: Any) -> list[np.ndarray]:
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)
          if np.issubdtype(np.asarray(x).dtype, np.floating)]


def _norm(tree: Any) -> float:
  return float(optax.tree.norm(tree))


def _gradients(params: Any, key: jax.Array) -> Any:
  """Gradients of 1 plus standard normal noise: a steady descent, as training makes."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, max(len(leaves), 1))
  return jax.tree.unflatten(treedef, [
      1.0 + jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact)
      else x for k, x in zip(keys, leaves)])


_STEP = 1e-2  # the central differences' relative step


def _difference(f: Callable[[Any], Any], x: Any, direction: Any) -> Any:
  """``f``'s derivative at ``x`` along ``direction``, by a central difference.

  Plain arithmetic, no ``jax.jvp``: under ``jax.ensure_compile_time_eval``
  every operation on the concrete stand-in runs eagerly, even inside a
  caller's ``jit``.
  """
  def at(sign: float) -> Any:
    return f(jax.tree.map(lambda a, d: a + sign * _STEP * d, x, direction))
  return jax.tree.map(lambda hi, lo: (hi - lo) / (2 * _STEP), at(1.0), at(-1.0))


def pulls(update: Callable[..., Any], state: Any, small: Any) -> bool:
  """Whether the update at ``state`` (``init``'s) pulls the params (median derivative <= -PULL).

  Adam's update does not depend on the params (AdamW's by ``-lr * wd``);
  an update that is a new position minus the params (or a move towards
  one: madgrad's ``-0.1``) does.
  """
  zeros = jax.tree.map(jnp.zeros_like, small)
  gain = _difference(lambda p: update(zeros, state, p)[0], small,
                     jax.tree.map(jnp.ones_like, small))
  flat = np.concatenate([g.ravel() for g in _floats(gain)] or [np.zeros(0)])
  flat = flat[np.isfinite(flat)]
  return bool(flat.size) and float(np.median(flat)) <= -PULL


def position_leaves(init: Callable[[Any], Any], update: Callable[..., Any],
                    params: Any, n_leaves: int) -> list[bool] | None:
  """For each of the ``n_leaves`` leaves of ``init(params)``: whether it sets a position.

  All ``False`` at the cost of one derivative when the update does not pull
  the params (:func:`pulls`); else the gains are measured.
  ``None`` when the update cannot be measured on stand-in params (it needs
  extra arguments or other shapes, or its state has other than
  ``n_leaves`` leaves). Only the params' shapes and dtypes are read, and
  the measurement runs eagerly under ``jax.ensure_compile_time_eval``
  (central differences, no ``jax.jvp``), so it measures the same inside a
  caller's ``jit``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from optax import contrib
    >>> params = {"w": jnp.zeros((3, 4))}
    >>> adam = optax.adam(1e-3)
    >>> position_leaves(adam.init, adam.update, params, 3)  # count, mu, nu
    [False, False, False]
    >>> madgrad = contrib.madgrad(1e-2)
    >>> position_leaves(madgrad.init, madgrad.update, params, 4)  # count, grad_sum_sq, s, x0 (a copy of the params)
    [False, False, True, False]
  """
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, params)
  try:
    # Eagerly on the concrete stand-in, even when the caller's init is under jit.
    with jax.ensure_compile_time_eval():
      return _measure(init, update, stand_in(shapes), n_leaves)
  except Exception:  # pylint: disable=broad-exception-caught  # no measurement, no claim
    return None


def _measure(init: Callable[[Any], Any], update: Callable[..., Any], small: Any,
             n_leaves: int) -> list[bool] | None:
  state = init(small)
  if len(jax.tree.leaves(state)) != n_leaves:
    return None
  if not pulls(update, state, small):
    return [False] * n_leaves
  key = jax.random.key(0)
  for t in range(STEPS):
    updates, state = update(_gradients(small, jax.random.fold_in(key, t)), state, small)
    small = optax.apply_updates(small, updates)
  grads = _gradients(small, jax.random.fold_in(key, STEPS))
  flat, treedef = jax.tree.flatten(state)
  size = _norm(update(grads, state, small)[0])
  found = []
  for i, leaf in enumerate(flat):
    if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)):
      found.append(False)
      continue

    def of_leaf(x: jax.Array, i: int = i) -> Any:
      return update(grads, jax.tree.unflatten(treedef, flat[:i] + [x] + flat[i + 1:]), small)[0]

    change = _difference(of_leaf, leaf, leaf)
    found.append(bool(size > 0 and _norm(change) >= POSITION_GAIN * size))
  return found

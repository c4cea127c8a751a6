"""The skip: one decision and one mechanism for non-finite steps.

:func:`guarded_update` is the only place that decides whether an optimizer
update runs. The loss-scaling transformation calls it with ``1 / scale``; the
train step calls it directly for a ``tx`` without loss scaling.

The decision is one reduction: the sum of squares of the unscaled gradients,
computed in at least float32 (float64 for float64 gradients). It is finite
exactly when every gradient is finite and the global norm does not overflow,
and its square root is the ``grad_norm`` metric. A non-finite ``value`` (the
loss, passed as optax's extra arg) skips too.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import tree_utils

T = TypeVar("T")

UpdateFn = Callable[[optax.Updates, optax.OptState, "optax.Params | None"],
                    tuple[optax.Updates, optax.OptState]]
# What the guard's lax.cond branches take: (grads, inner state, params).
_Operand = tuple[optax.Updates, optax.OptState, "optax.Params | None"]


class Guarded(NamedTuple):
  """What :func:`guarded_update` returns.

  Attributes:
    updates: the inner updates, or ``-0.0`` everywhere on a skipped step
      (``None`` when the update was applied inside the guard).
    params: with ``apply=True``, the new params (the old ones, untouched, on
      a skipped step); otherwise ``None``.
    state: the inner state, returned as it was on a skipped step.
    sumsq: sum of squares of the unscaled gradients (float32, or float64).
    finite: scalar bool; False means the step was skipped.
  """

  updates: optax.Updates | None
  params: optax.Params | None
  state: optax.OptState
  sumsq: jax.Array
  finite: jax.Array


def _real_dtype(dtype: np.dtype) -> np.dtype:
  return np.dtype(jnp.finfo(dtype).dtype)


def _wide(dtype: np.dtype, param: Any) -> np.dtype:
  """The dtype a gradient is unscaled and reduced in.

  :func:`tree_utils.wide_dtype` of the gradient (float32 at least), or of its
  param when that is wider: float16 gradients of float64 masters are unscaled
  in float64.
  """
  wide = tree_utils.wide_dtype(dtype)
  if tree_utils.is_inexact_array(param) and tree_utils.wide_dtype(param.dtype).itemsize > wide.itemsize:
    return tree_utils.wide_dtype(param.dtype)
  return wide


def _with_params(grads: optax.Updates, params: optax.Params | None) -> list[tuple[Any, Any]]:
  """``(gradient, param or None)`` for every leaf of ``grads``."""
  leaves = jax.tree.leaves(grads)
  structure: Any = jax.tree.structure(grads)  # Any: mypy cannot compare jaxlib's PyTreeDef.
  if params is not None and structure == jax.tree.structure(params):
    return list(zip(leaves, jax.tree.leaves(params)))
  return [(g, None) for g in leaves]


def _times_inv(x: jax.Array, inv_scale: jax.Array | None) -> jax.Array:
  if inv_scale is None:
    return x
  return x * inv_scale.astype(_real_dtype(x.dtype)).astype(x.dtype)


def unscale(
    grads: optax.Updates, inv_scale: jax.Array | None, params: optax.Params | None = None
) -> optax.Updates:
  """Floating and complex leaves widened (see :func:`_wide`) and times ``inv_scale``.

  ``inv_scale=None`` only widens. ``1 / scale`` is cast to each leaf's dtype.
  """
  pairs = iter(_with_params(grads, params))

  def one(g: Any) -> Any:
    _, p = next(pairs)
    if not tree_utils.is_inexact_array(g):
      return g
    return _times_inv(g.astype(_wide(g.dtype, p)), inv_scale)

  return jax.tree.map(one, grads)


# Gradient leaves with at most this many elements are reduced together, in one
# pass over their concatenation; larger ones are reduced one by one. On XLA:CPU
# each reduction is a kernel call of its own (a few microseconds), which
# dominates for small leaves, while copying a leaf into the concatenation
# costs about as much as reducing it.
FUSE_MAX_ELEMENTS = 1 << 14


def _squares_fit(dtype: Any, size: int, acc: np.dtype) -> bool:
  """Whether ``size`` squares of ``dtype``'s largest finite value sum finitely in ``acc``.

  True for float16 (65504**2 is about 4.3e9) and float8 leaves, False for
  bfloat16, float32, float64 and complex leaves, whose squares can overflow.

  Examples:
    >>> import numpy as np, jax.numpy as jnp
    >>> _squares_fit(jnp.float16, 10**9, np.dtype(np.float32))
    True
    >>> _squares_fit(jnp.bfloat16, 1, np.dtype(np.float32))
    False
  """
  biggest = float(np.abs(jnp.finfo(dtype).max))
  return biggest * biggest * max(size, 1) < float(jnp.finfo(acc).max) / 2


def unscaled_sumsq(
    grads: optax.Updates, inv_scale: jax.Array | None, params: optax.Params | None = None
) -> jax.Array:
  """Sum of squares (``|g|**2`` for complex) of the unscaled gradients.

  Accumulated in the widest real dtype among the leaves' wide dtypes (float32,
  or float64 when a leaf is float64). An empty tree gives 0.

  The cost does not grow with the number of leaves: on a single device, the
  leaves of at most :data:`FUSE_MAX_ELEMENTS` elements are concatenated (per
  dtype) and squared and summed in one fused pass (squaring after the
  concatenation keeps XLA from splitting it back into a reduction per leaf);
  only large leaves get a reduction each. With several devices every leaf is
  reduced where it lives (a concatenation would gather sharded leaves), which
  XLA:GPU fuses horizontally.

  Leaves whose squares cannot overflow the accumulator (float16, float8) are
  squared and summed before unscaling, and the sum is multiplied by
  ``inv_scale`` twice: the same value up to rounding (exactly, for a power-of-two
  scale) and the same finiteness, without an unscaled wide copy of each leaf.
  """
  pairs = [(g, _wide(g.dtype, p)) for g, p in _with_params(grads, params)
           if tree_utils.is_inexact_array(g)]
  acc = np.dtype(jnp.float64 if any(_real_dtype(w).itemsize > 4 for _, w in pairs)
                 else jnp.float32)

  def sumsq(x: jax.Array, wide: np.dtype) -> jax.Array:
    # Where no sum of squares of the leaf's dtype can overflow the accumulator
    # (float16 and float8 gradients), the scale is taken out of the sum:
    # sum((g / s)**2) = (sum(g**2) / s) / s. The finiteness decision is the
    # same, and XLA reads the gradients straight into the reduction instead of
    # materialising an unscaled wide copy of each large leaf first.
    factor = inv_scale is not None and _squares_fit(x.dtype, x.size, acc)
    x = x.astype(wide) if factor else _times_inv(x.astype(wide), inv_scale)
    sq = jnp.square(jnp.abs(x)) if jnp.iscomplexobj(x) else jnp.square(x)
    total = jnp.sum(sq).astype(acc)
    if factor:
      inv = cast(jax.Array, inv_scale).astype(acc)
      total = (total * inv) * inv
    return total

  # Small leaves are concatenated in their own dtype (often half the bytes of
  # the wide one) and widened after the concatenation.
  fuse = jax.device_count() == 1
  groups: dict[tuple[np.dtype, np.dtype], list[jax.Array]] = {}
  total = jnp.zeros((), acc)
  for g, wide in pairs:
    if fuse and g.size <= FUSE_MAX_ELEMENTS:
      groups.setdefault((np.dtype(g.dtype), wide), []).append(g.ravel())
    else:
      total = total + sumsq(g, wide)
  for (_, wide), group in groups.items():
    total = total + sumsq(jnp.concatenate(group), wide)
  return total


def is_finite_value(value: Any) -> jax.Array:
  """True unless ``value`` is a floating or complex array with a non-finite element."""
  if tree_utils.is_inexact_array(value) or isinstance(value, float):
    return jnp.isfinite(jnp.asarray(value)).all()
  return jnp.array(True)


def _skip_updates(shapes: Any) -> Any:
  """``-0.0`` for floating leaves, 0 for others.

  ``-0.0`` is the additive identity bit for bit: ``p + (-0.0) == p`` for
  every ``p``, including ``p == -0.0``, which ``p + (+0.0)`` would turn into
  ``+0.0``.
  """

  def zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    if jnp.issubdtype(s.dtype, jnp.inexact):
      return jnp.full(s.shape, -0.0, s.dtype)
    return jnp.zeros(s.shape, s.dtype)

  return jax.tree.map(zeros, shapes)


def _select(finite: jax.Array, applied: Any, skipped: Any) -> Any:
  """``applied`` where ``finite``, else ``skipped``, leaf by leaf (an element-wise select)."""
  return jax.tree.map(lambda a, s: jax.lax.select(jnp.broadcast_to(finite, jnp.shape(a)), a, s),
                      applied, skipped)


def either(finite: jax.Array, applied: Callable[[Any], T], skipped: Callable[[Any], T],
           operand: Any) -> T:
  """``applied(operand)`` if ``finite`` else ``skipped(operand)``, the same bits on any backend.

  The two programs differ by backend, because XLA's compilers differ in what
  they can update in place (read from the buffer assignment of the benchmark
  MLP, ``benchmarks.gpu_compile``):

  - **CPU**: ``lax.cond``. XLA:CPU writes the conditional's outputs over its
    donated operands, and a skipped step does not run the update at all. An
    element-wise select costs about 2x the no-scaling step's temp memory
    there, because XLA:CPU materialises both sides.
  - **GPU and others**: both sides, then one element-wise select per leaf.
    XLA:GPU gives a conditional's outputs buffers of their own and copies
    every passed-through operand into them (params and optimizer state, about
    3x the params' bytes of temp memory for Adam), whereas the select fuses
    into the update's own kernel, in place, with no host round trip for the
    predicate. The update's results are discarded on a skipped step.

  The choice is made when the step is lowered (``lax.platform_dependent``),
  so the compiled program holds one form only.

  Args:
    finite: a scalar bool.
    applied: what runs on a finite step.
    skipped: what a skipped step returns; the same tree of shapes and dtypes.
    operand: the argument of both.

  Returns:
    The output of ``applied`` or of ``skipped``.

  Examples:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([1.0, -0.0])
    >>> either(jnp.array(False), lambda x: x + 1, lambda x: x, p).tolist()
    [1.0, -0.0]
    >>> _select(jnp.array(True), p + 1, p).tolist()
    [2.0, 1.0]
  """

  def on_cpu(finite: jax.Array, operand: Any) -> T:
    return jax.lax.cond(finite, applied, skipped, operand)

  def elsewhere(finite: jax.Array, operand: Any) -> T:
    return cast(T, _select(finite, applied(operand), skipped(operand)))

  return cast(T, jax.lax.platform_dependent(finite, operand, cpu=on_cpu, default=elsewhere))


def guarded_update(
    update_fn: UpdateFn,
    grads: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None,
    *,
    inv_scale: jax.Array | None,
    value: Any = None,
    apply: bool = False,
) -> Guarded:
  """``update_fn(unscale(grads), state, params)``, or a skip.

  The update runs under :func:`either` on ``finite``: when it is False the
  update's results are not used and ``state`` is returned as it was, bit for
  bit. With
  ``apply=False`` the updates are ``-0.0`` on a skipped step, so
  ``optax.apply_updates`` leaves the params unchanged bit for bit. With
  ``apply=True`` the updates are applied inside the applied branch (XLA fuses
  the update and the write into one pass) and a skipped step passes the params
  through untouched.

  Args:
    update_fn: the inner update, called with unscaled (widened) gradients.
    grads: gradients of the scaled loss.
    state: the inner state.
    params: passed through to ``update_fn`` (and updated with ``apply``).
    inv_scale: ``1 / scale`` (float32), or ``None`` for no scaling.
    value: the loss, if known; a non-finite value skips the step.
    apply: apply the updates to ``params`` inside the guard.

  Returns:
    A :class:`Guarded`.
  """
  # The unscale is fused into each consumer (the reduction, the update), so
  # the unscaled gradients are never materialised: the guard's operand is the
  # backward pass's own output.
  sumsq = unscaled_sumsq(grads, inv_scale, params)
  finite = jnp.isfinite(sumsq) & is_finite_value(value)

  def update(operand: _Operand) -> tuple[optax.Updates, optax.OptState]:
    g, s, p = operand
    return update_fn(unscale(g, inv_scale, p), s, p)

  if apply:
    if params is None:
      raise ValueError("guarded_update: apply=True needs params")

    def apply_branch(
        operand: tuple[optax.Updates, optax.OptState, optax.Params],
    ) -> tuple[optax.Params, optax.OptState]:
      updates, s = update(operand)
      return optax.apply_updates(operand[2], updates), s

    new_params, state = either(
        finite, apply_branch, lambda operand: (operand[2], operand[1]), (grads, state, params)
    )
    return Guarded(None, new_params, state, sumsq, finite)

  def skip_branch(operand: _Operand) -> tuple[optax.Updates, optax.OptState]:
    return _skip_updates(update_shapes), operand[1]

  operand = (grads, state, params)
  update_shapes, _ = jax.eval_shape(update, operand)
  updates, state = either(finite, update, skip_branch, operand)
  return Guarded(updates, None, state, sumsq, finite)

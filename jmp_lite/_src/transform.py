"""An optax transformation for loss scaling that skips non-finite steps."""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import tree_utils

_INT32_MAX = int(np.iinfo(np.int32).max)
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal: 1 / tiny is finite


class LossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scaling` and :func:`static_loss_scaling`.

  Every field is a strongly typed array (or the inner optimizer's state), so the
  state is stable across steps and survives ``jit`` and checkpoints.

  Attributes:
    loss_scale: float32 scalar, the scale the next loss is multiplied by.
    growth_count: int32 scalar, consecutive finite steps since the last change.
    skipped_steps: int32 scalar, total skipped (non-finite) steps; saturates.
    consecutive_skips: int32 scalar, current run of skipped steps; saturates.
      It is 0 exactly when the last step was applied.
    inner_state: the wrapped transformation's state.
  """

  loss_scale: jax.Array
  growth_count: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: optax.OptState


def _as_extra_args(inner: Any) -> optax.GradientTransformationExtraArgs:
  init = getattr(inner, "init", None)
  update = getattr(inner, "update", None)
  if not (callable(init) and callable(update)):
    raise TypeError(
        "inner must be an optax transformation (an object with callable init and "
        f"update, e.g. optax.adam(1e-3) or optax.MultiSteps(...)), got {inner!r}"
    )
  if isinstance(inner, optax.GradientTransformationExtraArgs):
    return inner
  if isinstance(inner, optax.GradientTransformation):
    return optax.with_extra_args_support(inner)
  return optax.GradientTransformationExtraArgs(init, update)  # e.g. optax.MultiSteps.


def _saturating_increment(x: jax.Array) -> jax.Array:
  return jnp.where(x == _INT32_MAX, x, x + 1)


def _negative_zeros(shape_dtype: jax.ShapeDtypeStruct) -> jax.Array:
  # -0.0 is the additive identity bit for bit: p + (-0.0) == p for every p,
  # including p == -0.0, which p + (+0.0) would turn into +0.0.
  return jnp.full(shape_dtype.shape, -0.0, shape_dtype.dtype)


def _skip_updates(shapes: Any) -> Any:
  def zeros(s):
    if jnp.issubdtype(s.dtype, jnp.floating):
      return _negative_zeros(s)
    return jnp.zeros(s.shape, s.dtype)

  return jax.tree.map(zeros, shapes)


def unscaled_sumsq(grads: Any, inv_scale: jax.Array) -> jax.Array:
  """Sum of squares of the unscaled floating gradients, in float32.

  One pass over the gradients gives both the skip decision (the sum is finite
  iff every gradient is finite and the global norm does not overflow float32)
  and the ``grad_norm`` metric (its square root).
  """
  total = jnp.zeros((), jnp.float32)
  for g in jax.tree.leaves(grads):
    if tree_utils.is_floating_array(g):
      total = total + jnp.sum(jnp.square(g.astype(jnp.float32) * inv_scale))
  return total


def cond_update(finite: jax.Array, update_fn: Any, grads: Any, state: Any, params: Any):
  """``update_fn(grads, state, params)`` under ``lax.cond`` on ``finite``.

  When ``finite`` is False the update does not run: the updates are ``-0.0``
  (``params + updates == params`` bit for bit) and ``state`` is returned as is.
  """

  def apply(operand):
    return update_fn(*operand)

  def skip(operand):
    return _skip_updates(update_shapes), operand[1]

  operand = (grads, state, params)
  update_shapes, _ = jax.eval_shape(apply, operand)
  return jax.lax.cond(finite, apply, skip, operand)


def _loss_scaling(
    inner: Any,
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
    max_scale: float,
) -> optax.GradientTransformationExtraArgs:
  """The shared core: static scaling is growth_factor=backoff_factor=1."""
  inner = _as_extra_args(inner)
  dynamic = growth_factor != 1.0
  # float32 constants: a Python float above float32's range (max_scale=inf is
  # allowed, meaning no cap) must not be cast at trace time.
  max_scale32 = np.float32(max_scale) if max_scale <= _F32_MAX else np.float32(np.inf)
  min_scale32 = np.float32(min_scale)

  def init(params):
    return LossScaleState(
        loss_scale=jnp.asarray(init_scale, jnp.float32),
        growth_count=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        inner_state=inner.init(params),
    )

  def inner_update(grads, inner_state, params, inv_scale, extra_args):
    # The unscale happens here, inside the applied branch, and again inside
    # the sum of squares: XLA fuses each into its consumer, so the unscaled
    # gradients are never materialised.
    grads = tree_utils.map_floating(lambda g: g.astype(jnp.float32) * inv_scale, grads)
    return inner.update(grads, inner_state, params, **extra_args)

  def next_state(state, finite, inner_state):
    scale = state.loss_scale
    zero = jnp.zeros((), jnp.int32)
    # The new scale always obeys *this* transformation's configuration, even
    # for a state restored from a checkpoint written under another one. The
    # scale used for this step stays the state's: the loss was multiplied by it.
    if dynamic:
      count = jnp.where(finite, _saturating_increment(state.growth_count), zero)
      grow = count >= growth_interval
      grown = scale * growth_factor
      # Like GradScaler, a growth that overflows float32 keeps the old scale.
      grown = jnp.where(jnp.isfinite(grown), grown, scale)
      new_scale = jnp.where(finite, jnp.where(grow, grown, scale), scale * backoff_factor)
      new_scale = jnp.clip(new_scale, min_scale32, max_scale32)
      count = jnp.where(grow, zero, count)
    else:
      new_scale, count = jnp.full((), init_scale, jnp.float32), state.growth_count
    return LossScaleState(
        loss_scale=new_scale.astype(jnp.float32),
        growth_count=count.astype(jnp.int32),
        skipped_steps=jnp.where(
            finite, state.skipped_steps, _saturating_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(
            finite, zero, _saturating_increment(state.consecutive_skips)
        ),
        inner_state=inner_state,
    )

  def update(grads, state, params=None, **extra_args):
    inv_scale = 1.0 / state.loss_scale
    finite = jnp.isfinite(unscaled_sumsq(grads, inv_scale))
    updates, inner_state = cond_update(
        finite,
        lambda g, s, p: inner_update(g, s, p, inv_scale, extra_args),
        grads,
        state.inner_state,
        params,
    )
    return updates, next_state(state, finite, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def _real(name: str, value: Any) -> float:
  if isinstance(value, (bool, str, bytes)):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be a real number, got {value!r}") from e


def _check_scale(name: str, value: float) -> None:
  """A scale must be a normal float32: finite, > 0, with a finite reciprocal."""
  if not (math.isfinite(value) and _F32_TINY <= value <= _F32_MAX):
    raise ValueError(
        f"{name} must be finite and > 0, within float32's normal range "
        f"[{_F32_TINY!r}, {_F32_MAX!r}], got {value!r}"
    )


def _check_config(
    init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale
) -> tuple[float, float, float, int, float, float]:
  """Validates the arguments of :func:`dynamic_loss_scaling`; returns them as numbers."""
  init_scale = _real("init_scale", init_scale)
  _check_scale("init_scale", init_scale)
  growth_factor = _real("growth_factor", growth_factor)
  if not (math.isfinite(growth_factor) and 1 < growth_factor <= _F32_MAX):
    raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor!r}")
  backoff_factor = _real("backoff_factor", backoff_factor)
  if not 0 < backoff_factor < 1:
    raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}")
  if isinstance(growth_interval, bool):
    raise TypeError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
  try:
    interval = operator.index(growth_interval)
  except TypeError as e:
    raise TypeError(f"growth_interval must be an int >= 1, got {growth_interval!r}") from e
  if not 1 <= interval <= _INT32_MAX:
    raise ValueError(f"growth_interval must be in [1, {_INT32_MAX}], got {growth_interval!r}")
  min_scale = _real("min_scale", min_scale)
  _check_scale("min_scale", min_scale)
  max_scale = _real("max_scale", max_scale)
  if math.isnan(max_scale):
    raise ValueError(f"max_scale must be a number (inf means no cap), got {max_scale!r}")
  if min_scale > max_scale:
    raise ValueError(
        f"min_scale must be <= max_scale, got min_scale={min_scale!r} > max_scale={max_scale!r}"
    )
  if not min_scale <= init_scale <= max_scale:
    raise ValueError(
        f"init_scale must be in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
        f"got {init_scale!r}"
    )
  return init_scale, growth_factor, backoff_factor, interval, min_scale, max_scale


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with dynamic loss scaling and skip-on-non-finite.

  ``update`` receives the gradients of the **scaled** loss (the loss multiplied
  by ``loss_scale_of(state)``). It unscales them in float32 and then::

    if sum(unscaled ** 2) is finite:        # every gradient finite, norm < ~1.8e19
      updates, inner_state = inner.update(unscaled, inner_state, params, **extra)
      growth_count += 1
      if growth_count == growth_interval:
        scale = min(scale * growth_factor, max_scale)
        growth_count = 0
    else:                                    # the step is skipped
      updates = -0.0 everywhere              # params + updates == params, bit for bit
      inner_state unchanged                  # Adam's count and schedules do not advance
      scale = max(scale * backoff_factor, min_scale)
      growth_count = 0

  With the floor and cap out of reach this is ``torch.amp.GradScaler``'s rule.
  The inner update runs under ``lax.cond``, so a skipped step does not pay for it.
  One fused sum of squares decides the skip: it is non-finite when any gradient
  is inf or NaN, and also when the global norm of the unscaled gradients
  overflows float32 (about 1.8e19), an update no optimizer could use either.

  Args:
    inner: any optax transformation, including ``optax.chain``,
      ``optax.inject_hyperparams(...)`` and ``optax.MultiSteps``.
    init_scale: initial scale; finite and > 0, in ``[min_scale, max_scale]``.
      Always stored as float32.
    growth_factor: multiplier after ``growth_interval`` finite steps; > 1.
    backoff_factor: multiplier on a non-finite step; in (0, 1).
    growth_interval: consecutive finite steps before growth; an int in
      ``[1, 2**31 - 1]``.
    min_scale: floor of the scale; a normal float32 (about 1.2e-38 or more),
      so that ``1 / scale`` is finite.
    max_scale: cap of the scale; >= ``min_scale``. ``inf`` means no cap (a
      growth that would overflow float32 then keeps the scale, as GradScaler).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    ValueError: for an out-of-range argument; the message names it.
    TypeError: if ``inner`` is not an optax transformation, or an argument is
      not a number.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> tx = jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=4.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> scaled_grads = {"w": jnp.full(2, 4.0)}      # gradients of loss * 4
    >>> updates, state = tx.update(scaled_grads, state, params)
    >>> updates["w"]
    Array([-0.1, -0.1], dtype=float32)
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state, params)
    >>> float(jmp.loss_scale_of(state)), int(jmp.skipped_steps_of(state))
    (2.0, 1)
  """
  config = _check_config(
      init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale
  )
  return _loss_scaling(inner, *config)


def static_loss_scaling(
    inner: optax.GradientTransformation, scale: float
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale and skip-on-non-finite.

  Like :func:`dynamic_loss_scaling` but the scale never changes. ``scale=1.0``
  gives skip-on-non-finite alone, for bf16 training that needs no scaling.

  Args:
    inner: any optax transformation.
    scale: the fixed scale; finite and > 0 (a normal float32).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    ValueError: if ``scale`` is out of range.
    TypeError: if ``inner`` is not an optax transformation or ``scale`` is not
      a number.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> tx = jmp.static_loss_scaling(optax.sgd(1.0), 8.0)
    >>> state = tx.init({"w": jnp.zeros(1)})
    >>> updates, state = tx.update({"w": jnp.full(1, 8.0)}, state)
    >>> updates["w"], float(jmp.loss_scale_of(state))
    (Array([-1.], dtype=float32), 8.0)
  """
  value = _real("scale", scale)
  _check_scale("scale", value)
  return _loss_scaling(inner, value, 1.0, 1.0, 1, value, value)


def find_loss_scale_state(opt_state: Any) -> LossScaleState | None:
  """The first :class:`LossScaleState` inside ``opt_state`` (depth-first), or None."""
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaleState)):
    if isinstance(node, LossScaleState):
      return node
  return None


def loss_scale_of(opt_state: Any) -> jax.Array:
  """The current loss scale found anywhere inside ``opt_state``.

  Searches nested states (``optax.chain`` tuples, ``inject_hyperparams``,
  ``MultiSteps``, a ``TrainState``) for the first :class:`LossScaleState`.

  Returns:
    A float32 scalar; ``1.0`` if there is no loss-scaling state.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> float(jmp.loss_scale_of(optax.adam(1e-3).init(jnp.zeros(2))))
    1.0
  """
  state = find_loss_scale_state(opt_state)
  if state is None:
    return jnp.ones((), jnp.float32)
  return state.loss_scale


def skipped_steps_of(opt_state: Any) -> jax.Array:
  """Total skipped steps recorded inside ``opt_state`` (int32; 0 if none).

  Searches nested states like :func:`loss_scale_of`. The count saturates at
  ``2**31 - 1`` instead of wrapping.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> tx = optax.chain(optax.clip(1.0), jmp.static_loss_scaling(optax.sgd(0.1), 1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> _, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state)
    >>> int(jmp.skipped_steps_of(state))
    1
  """
  state = find_loss_scale_state(opt_state)
  if state is None:
    return jnp.zeros((), jnp.int32)
  return state.skipped_steps

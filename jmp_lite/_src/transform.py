"""An optax transformation for loss scaling that skips non-finite steps."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import loss_scale
from jmp_lite._src import tree_utils

_INT32_MAX = jnp.iinfo(jnp.int32).max


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

  def init(params):
    return LossScaleState(
        loss_scale=jnp.asarray(init_scale, jnp.float32),
        growth_count=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        inner_state=inner.init(params),
    )

  def update(grads, state, params=None, **extra_args):
    scale = state.loss_scale
    inv_scale = 1.0 / scale
    grads = tree_utils.map_floating(lambda g: g.astype(jnp.float32) * inv_scale, grads)
    finite = loss_scale.all_finite(grads)

    def apply(operand):
      grads, inner_state, params = operand
      return inner.update(grads, inner_state, params, **extra_args)

    def skip(operand):
      _, inner_state, _ = operand
      return _skip_updates(update_shapes), inner_state

    operand = (grads, state.inner_state, params)
    update_shapes, _ = jax.eval_shape(apply, operand)
    updates, inner_state = jax.lax.cond(finite, apply, skip, operand)

    if dynamic:
      count = jnp.where(finite, state.growth_count + 1, jnp.zeros_like(state.growth_count))
      grow = count >= growth_interval
      grown = jnp.minimum(scale * growth_factor, max_scale)
      backed_off = jnp.maximum(scale * backoff_factor, min_scale)
      new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
      count = jnp.where(grow, jnp.zeros_like(count), count)
    else:
      new_scale, count = scale, state.growth_count
    new_state = LossScaleState(
        loss_scale=new_scale.astype(jnp.float32),
        growth_count=count,
        skipped_steps=jnp.where(
            finite, state.skipped_steps, _saturating_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(
            finite,
            jnp.zeros_like(state.consecutive_skips),
            _saturating_increment(state.consecutive_skips),
        ),
        inner_state=inner_state,
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)


def _check_config(
    init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale
) -> None:
  def number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      try:
        value = float(value)
      except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a real number, got {value!r}") from e
    return float(value)

  init_scale = number("init_scale", init_scale)
  if not (math.isfinite(init_scale) and init_scale > 0):
    raise ValueError(f"init_scale must be finite and > 0, got {init_scale!r}")
  growth_factor = number("growth_factor", growth_factor)
  if not (math.isfinite(growth_factor) and growth_factor > 1):
    raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor!r}")
  backoff_factor = number("backoff_factor", backoff_factor)
  if not 0 < backoff_factor < 1:
    raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}")
  if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
    raise TypeError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
  if growth_interval < 1:
    raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}")
  min_scale = number("min_scale", min_scale)
  max_scale = number("max_scale", max_scale)
  if not (min_scale > 0 and math.isfinite(min_scale)):
    raise ValueError(f"min_scale must be finite and > 0, got {min_scale!r}")
  if not max_scale > 0:
    raise ValueError(f"max_scale must be > 0, got {max_scale!r}")
  if min_scale > max_scale:
    raise ValueError(
        f"min_scale must be <= max_scale, got min_scale={min_scale!r} > max_scale={max_scale!r}"
    )
  if not min_scale <= init_scale <= max_scale:
    raise ValueError(
        f"init_scale must be in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
        f"got {init_scale!r}"
    )


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

    if all unscaled gradients are finite:
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

  Args:
    inner: any optax transformation, including ``optax.chain``,
      ``optax.inject_hyperparams(...)`` and ``optax.MultiSteps``.
    init_scale: initial scale; finite and > 0. Always stored as float32.
    growth_factor: multiplier after ``growth_interval`` finite steps; > 1.
    backoff_factor: multiplier on a non-finite step; in (0, 1).
    growth_interval: consecutive finite steps before growth; >= 1.
    min_scale: floor of the scale.
    max_scale: cap of the scale; >= ``min_scale``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    ValueError: for an out-of-range argument.
    TypeError: if ``inner`` is not an optax transformation.

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
  _check_config(init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale)
  return _loss_scaling(
      inner,
      float(init_scale),
      float(growth_factor),
      float(backoff_factor),
      growth_interval,
      float(min_scale),
      float(max_scale),
  )


def static_loss_scaling(
    inner: optax.GradientTransformation, scale: float
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale and skip-on-non-finite.

  Like :func:`dynamic_loss_scaling` but the scale never changes. ``scale=1.0``
  gives skip-on-non-finite alone, for bf16 training that needs no scaling.

  Args:
    inner: any optax transformation.
    scale: the fixed scale; finite and > 0.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> tx = jmp.static_loss_scaling(optax.sgd(1.0), 8.0)
    >>> state = tx.init({"w": jnp.zeros(1)})
    >>> updates, state = tx.update({"w": jnp.full(1, 8.0)}, state)
    >>> updates["w"], float(jmp.loss_scale_of(state))
    (Array([-1.], dtype=float32), 8.0)
  """
  try:
    value = float(scale)
  except (TypeError, ValueError) as e:
    raise TypeError(f"scale must be a real number, got {scale!r}") from e
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"scale must be finite and > 0, got {scale!r}")
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
  """Total skipped steps recorded inside ``opt_state`` (int32; 0 if none)."""
  state = find_loss_scale_state(opt_state)
  if state is None:
    return jnp.zeros((), jnp.int32)
  return state.skipped_steps

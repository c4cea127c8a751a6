"""An optax transformation for loss scaling that skips non-finite steps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src.scaling import loss_scale as loss_scale_lib
from jmp_lite._src.scaling import skip

_INT32_MAX = int(np.iinfo(np.int32).max)
_F32_MAX = float(np.finfo(np.float32).max)

_NO_COUNTER_MSG = (
    "skipped_steps_of found no loss-scaling state in opt_state (of type {what}), "
    "so no skipped steps were counted: the train step skips non-finite steps of a plain "
    "optax tx without recording them. Wrap the optimizer in "
    "jmp_lite.static_loss_scaling(tx, 1.0) (no scaling, with a skip counter), or read "
    "metrics[\"grads_finite\"] each step"
)
_OUTERMOST_MSG = (
    "{what}. Put the loss scaling outermost, wrapping everything else: "
    "tx = jmp.dynamic_loss_scaling(optax.chain(...)) (or "
    "jmp.dynamic_loss_scaling(optax.MultiSteps(...))), with exactly one scaler. "
    "A scaler nested inside another transformation sees partial or accumulated "
    "updates and cannot make its skip exact."
)


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


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
  """The validated configuration of a loss-scaling transformation.

  Static scaling is the same rule with ``growth_factor = backoff_factor = 1``
  and ``min_scale = max_scale = init_scale``. ``max_scale`` is the effective
  cap: a larger one given by the user (``inf`` included) is stored as
  ``2**126``, the largest usable scale (:data:`checks.MAX_LOSS_SCALE`).
  """

  init_scale: float
  growth_factor: float
  backoff_factor: float
  growth_interval: int
  min_scale: float
  max_scale: float

  @classmethod
  def dynamic(cls, init_scale: Any, growth_factor: Any, backoff_factor: Any,
              growth_interval: Any, min_scale: Any, max_scale: Any) -> "ScalingConfig":
    """Validates the arguments of :func:`dynamic_loss_scaling`."""
    init_scale = checks.loss_scale("init_scale", init_scale)
    growth_factor = checks.real_number("growth_factor", growth_factor)
    if not (math.isfinite(growth_factor) and 1 < growth_factor <= _F32_MAX):
      raise ValueError(f"growth_factor must be finite and > 1, got {growth_factor!r}")
    backoff_factor = checks.real_number("backoff_factor", backoff_factor)
    if not 0 < backoff_factor < 1:
      raise ValueError(
          f"backoff_factor must be in the open interval (0, 1), got {backoff_factor!r}"
      )
    interval = checks.integer("growth_interval", growth_interval, minimum=1, maximum=_INT32_MAX)
    min_scale = checks.loss_scale("min_scale", min_scale)
    max_scale = checks.real_number("max_scale", max_scale)
    if math.isnan(max_scale):
      raise ValueError(
          f"max_scale must be a number (inf means up to 2**126, the largest usable scale), "
          f"got {max_scale!r}"
      )
    if min_scale > max_scale:
      raise ValueError(
          f"min_scale must be <= max_scale, got min_scale={min_scale!r} > max_scale={max_scale!r}"
      )
    if not min_scale <= init_scale <= max_scale:
      raise ValueError(
          f"init_scale must be in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
          f"got {init_scale!r}"
      )
    max_scale = min(max_scale, checks.MAX_LOSS_SCALE)
    return cls(init_scale, growth_factor, backoff_factor, interval, min_scale, max_scale)

  @classmethod
  def static(cls, scale: Any) -> "ScalingConfig":
    """Validates the argument of :func:`static_loss_scaling`."""
    value = checks.loss_scale("scale", scale)
    return cls(value, 1.0, 1.0, 1, value, value)


def next_state(
    config: ScalingConfig, state: LossScaleState, finite: jax.Array, inner_state: optax.OptState
) -> LossScaleState:
  """The state after a step that was applied (``finite``) or skipped.

  The new scale always obeys ``config``, even for a state restored from a
  checkpoint written under another configuration: it is clipped to
  ``[min_scale, max_scale]``, so a static config always gives its own scale.
  The scale used for this step stays the state's: the loss was multiplied by it.
  """
  scale = state.loss_scale
  zero = jnp.zeros((), jnp.int32)
  count = jnp.where(finite, optax.safe_increment(state.growth_count), zero)
  grow = count >= config.growth_interval
  new_scale = loss_scale_lib.adjust_scale(
      scale,
      finite,
      grow,
      growth_factor=np.float32(config.growth_factor),
      backed_off=scale * np.float32(config.backoff_factor),
      floor=jnp.float32(0),
  )
  new_scale = jnp.clip(new_scale, np.float32(config.min_scale), np.float32(config.max_scale))
  return LossScaleState(
      loss_scale=new_scale.astype(jnp.float32),
      growth_count=jnp.where(grow, zero, count).astype(jnp.int32),
      skipped_steps=jnp.where(
          finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
      ),
      consecutive_skips=jnp.where(
          finite, zero, optax.safe_increment(state.consecutive_skips)
      ),
      inner_state=inner_state,
  )


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


@dataclasses.dataclass(frozen=True)
class ScalingUpdate:
  """The ``update`` function of a loss-scaling transformation.

  A value (frozen, hashable) rather than a closure, so that
  :func:`make_train_step` can recognise an outermost scaler and ask it for
  the sum of squares it already computed.
  """

  config: ScalingConfig
  inner: optax.GradientTransformationExtraArgs

  def init(self, params: optax.Params) -> LossScaleState:
    return LossScaleState(
        loss_scale=jnp.asarray(self.config.init_scale, jnp.float32),
        growth_count=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        inner_state=self.inner.init(params),
    )

  def guarded(
      self,
      grads: optax.Updates,
      state: LossScaleState,
      params: optax.Params | None = None,
      *,
      apply: bool = False,
      skip_loss: Any = None,
      **extra_args: Any,
  ) -> tuple[skip.Guarded, LossScaleState]:
    """The guarded inner update (:func:`skip.guarded_update`) and the new state.

    ``skip_loss``, when given, is the loss the skip decides on (with the
    gradients), whatever ``value`` the extra args forward to ``inner``: the
    train step passes its loss here, so that a user's ``value`` (a validation
    metric for ``reduce_on_plateau``) never decides the skip. Without it, the
    ``value`` extra arg decides, as optax's convention for the loss.
    """
    decide = extra_args.get("value") if skip_loss is None else skip_loss
    guard = skip.guarded_update(
        lambda g, s, p: self.inner.update(g, s, p, **extra_args),
        grads,
        state.inner_state,
        params,
        inv_scale=1.0 / state.loss_scale,
        value=decide,
        apply=apply,
    )
    return guard, next_state(self.config, state, guard.finite, guard.state)

  def __call__(
      self,
      grads: optax.Updates,
      state: LossScaleState,
      params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, LossScaleState]:
    guard, state = self.guarded(grads, state, params, **extra_args)
    return cast(optax.Updates, guard.updates), state  # Not applied: updates are there.


def _loss_scaling(inner: Any, config: ScalingConfig) -> optax.GradientTransformationExtraArgs:
  update = ScalingUpdate(config, _as_extra_args(inner))
  # optax types every update's state as OptState; ours takes its LossScaleState.
  return optax.GradientTransformationExtraArgs(update.init, update)  # type: ignore[arg-type]


def dynamic_loss_scaling(
    inner: optax.GradientTransformation | optax.MultiSteps,
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
  by ``loss_scale_of(state)``). It unscales them in float32 (float64 for
  float64 gradients) and then::

    if sum(unscaled ** 2) is finite and value is finite:
      updates, inner_state = inner.update(unscaled, inner_state, params, **extra)
      growth_count += 1
      if growth_count == growth_interval:    # a growth to inf keeps the scale
        scale = min(scale * growth_factor, max_scale, 2**126)
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
  ``value`` is optax's extra arg for the loss (``make_train_step`` passes it);
  when given, a non-finite loss skips the step too, and it is forwarded to
  ``inner`` with every other extra arg.

  Put this transformation **outermost**: clipping, schedules and accumulation
  (``optax.MultiSteps``) then see unscaled gradients and are skipped whole.
  ``make_train_step`` refuses a scaler nested inside another transformation.

  Args:
    inner: any optax transformation, including ``optax.chain``,
      ``optax.inject_hyperparams(...)`` and ``optax.MultiSteps``.
    init_scale: initial scale, in ``[min_scale, max_scale]`` and at most
      ``2**126``. Always stored as float32.
    growth_factor: multiplier after ``growth_interval`` finite steps; > 1.
    backoff_factor: multiplier on a non-finite step; in (0, 1).
    growth_interval: consecutive finite steps before growth; an int in
      ``[1, 2**31 - 1]``.
    min_scale: floor of the scale, in ``[2**-126, 2**126]`` (about 1.2e-38
      to 8.5e37), so that ``1 / scale`` is a normal float32.
    max_scale: cap of the scale; >= ``min_scale``. Any cap above ``2**126``
      (``inf`` included) means ``2**126``, the largest usable scale: the
      gradients are unscaled by multiplying with ``1 / scale``, and
      ``1 / 2**127`` is a float32 subnormal that XLA flushes to 0, which would
      unscale every gradient to 0.

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
  config = ScalingConfig.dynamic(
      init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale
  )
  return _loss_scaling(inner, config)


def static_loss_scaling(
    inner: optax.GradientTransformation | optax.MultiSteps, scale: float
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with a fixed loss scale and skip-on-non-finite.

  Like :func:`dynamic_loss_scaling` but the scale never changes. ``scale=1.0``
  gives skip-on-non-finite alone, for bf16 training that needs no scaling.

  Args:
    inner: any optax transformation.
    scale: the fixed scale, in ``[2**-126, 2**126]`` (so that ``1 / scale``
      is a normal float32).

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
  return _loss_scaling(inner, ScalingConfig.static(scale))


def scaling_update_of(tx: Any) -> ScalingUpdate | None:
  """The :class:`ScalingUpdate` of ``tx`` if ``tx`` is itself a loss-scaling transformation."""
  update = getattr(tx, "update", None)
  return update if isinstance(update, ScalingUpdate) else None


def _is_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def scale_state_paths(opt_state: optax.OptState) -> list[str]:
  """``"opt_state..."`` paths of every :class:`LossScaleState` inside ``opt_state``."""
  def find(prefix: str, tree: Any) -> Iterator[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_scale_state)[0]
    for path, x in flat:
      if _is_scale_state(x):
        yield prefix + jax.tree_util.keystr(path)
        yield from find(f"{prefix}{jax.tree_util.keystr(path)}.inner_state", x.inner_state)

  return list(find("opt_state", opt_state))


def check_outermost(tx: Any, opt_state: optax.OptState) -> None:
  """Refuses a loss-scaling state that is not ``tx``'s own, outermost one.

  Raises:
    ValueError: if ``opt_state`` holds a :class:`LossScaleState` anywhere but
      at its root, or more than one.
  """
  paths = scale_state_paths(opt_state)
  if len(paths) > 1:
    what = f"tx has {len(paths)} loss-scaling states, at {', '.join(paths)}"
  elif paths and not (scaling_update_of(tx) is not None and paths == ["opt_state"]):
    what = f"tx's loss scaling is not outermost: its state is at {paths[0]}"
  else:
    return
  raise ValueError(_OUTERMOST_MSG.format(what=what))


def find_loss_scale_state(opt_state: Any) -> LossScaleState | None:
  """The first :class:`LossScaleState` inside ``opt_state`` (depth-first), or None."""
  for node in jax.tree.leaves(opt_state, is_leaf=_is_scale_state):
    if _is_scale_state(node):
      return node
  return None


def loss_scale_of(opt_state: Any) -> jax.Array:
  """The current loss scale found anywhere inside ``opt_state``; ``1.0`` means no scaling.

  Searches nested states (``optax.chain`` tuples, ``inject_hyperparams``,
  ``MultiSteps``, a ``TrainState``) for the first :class:`LossScaleState`.
  Without one the loss is not scaled: the step multiplies it by ``1.0``.

  Returns:
    A float32 scalar; ``1.0`` if there is no loss-scaling state (no scaling).

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
  """Total skipped steps recorded inside ``opt_state`` (int32).

  Searches nested states like :func:`loss_scale_of`. The count saturates at
  ``2**31 - 1`` instead of wrapping. The step skips non-finite steps of a
  plain optax ``tx`` too, but only a loss-scaling transformation counts them.

  Raises:
    ValueError: if ``opt_state`` holds no :class:`LossScaleState` (nothing
      counted): wrap the optimizer in ``static_loss_scaling(tx, 1.0)``, or
      read ``metrics["grads_finite"]`` per step.

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
    raise ValueError(_NO_COUNTER_MSG.format(what=checks.type_name(opt_state)))
  return state.skipped_steps

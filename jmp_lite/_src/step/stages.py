"""The stages of one train step, each a module-level function over traced values.

:func:`make_train_step`'s jitted body runs them in order::

  inputs  = cast_inputs(config, state, batch)           # compute-dtype view
  grads   = scaled_gradient(config, inputs, scale)      # d(loss * scale)
  guard, opt_state = guarded_update(config, state, inputs, grads)   # the skip
  state'  = write_back(state, guard, opt_state)         # f32 or bf16 masters
  state'.model_state = next_model_state(state, grads.model_state, guard.finite)
  metrics = step_metrics(config, scale, inputs, grads, guard)

Each stage reads the :class:`StepConfig` that :func:`make_train_step`
validated; none of them checks Python arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from typing import Any, Callable, Mapping, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import filtering
from jmp_lite._src import masters
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.scaling import skip
from jmp_lite._src.step import half_share
from jmp_lite._src.step import model_state as step_model_state
from jmp_lite._src.scaling import transform
from jmp_lite._src import tree_utils
from jmp_lite._src.step.train_state import TrainState
from jmp_lite._src.step.train_state import step_rounding_key
from jmp_lite._src.step.train_state import trained_part

_LOSS_MSG = "loss_fn must return a float scalar loss{aux}; got {what}"
_AUX_MSG = "loss_fn was declared with has_aux=True and must return a (loss, aux) pair; got {what}"
_STATE_MSG = (
    "state.model_state is set, so loss_fn(params, model_state, batch) must return "
    "(loss, new_model_state), or (loss, (new_model_state, aux)) with has_aux=True; "
    "{what} was {got}"
)
_STATE_ARITY_MSG = (
    "the state has a model_state, so the step calls loss_fn(params, model_state, "
    "batch), but loss_fn{signature} cannot take those three arguments ({error}); "
    "add the model_state argument (and return (loss, new_model_state)), or build "
    "the state without model_state"
)
_ARITY_MSG = (
    "the state has no model_state, so the step calls loss_fn(params, batch), but "
    "loss_fn{signature} cannot take those two arguments ({error}); for a loss_fn "
    "of (params, model_state, batch), pass model_state= to TrainState.create"
)
_NO_AUX_HINT = (
    "; it returned a pair: if the second element is auxiliary output, build the "
    "step with has_aux=True"
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The step's static configuration, as :func:`make_train_step` validated it.

  Attributes:
    loss_fn: the loss function (already wrapped in :func:`autocast` when asked).
    policy: the precision policy for params and model state.
    batch_policy: the policy that casts the batch, or ``None`` to pass the
      batch as it is (``cast_batch=False``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    track_nonfinite: whether the metrics carry ``nonfinite``.
    extra_args: ``extra_args(loss, aux, batch)`` for ``tx.update``, or ``None``.
    axis_name: the name bound over the batch while ``loss_fn`` runs, or ``None``.
  """

  loss_fn: Callable[..., Any]
  policy: policy_lib.Policy
  batch_policy: policy_lib.Policy | None = None
  has_aux: bool = False
  track_nonfinite: bool = False
  extra_args: Callable[[jax.Array, Any, Any], Mapping[str, Any]] | None = None
  axis_name: str | None = None


class Inputs(NamedTuple):
  """What :func:`cast_inputs` returns: ``loss_fn``'s view and the update's masters.

  Attributes:
    trained: the float32 view of the trained (inexact) master leaves, ``None``
      at the others: what the optimizer updates.
    params: the float32 view of the masters cast by the policy (keep rules
      apply): what ``loss_fn`` sees.
    model_state: the state's model state as stored (never cast), or ``None``.
    batch: the batch, cast by the batch policy unless ``cast_batch=False``.
  """

  trained: optax.Params
  params: Any
  model_state: Any
  batch: Any


class Gradients(NamedTuple):
  """What :func:`scaled_gradient` returns.

  Attributes:
    grads: gradients of ``float32(loss) * scale`` with respect to the
      compute-dtype trained leaves (``None`` at the others).
    loss: the unscaled loss, float32.
    model_state: ``loss_fn``'s new model state (``None`` without one).
    aux: ``loss_fn``'s auxiliary output (``None`` without ``has_aux``).
  """

  grads: optax.Updates
  loss: jax.Array
  model_state: Any
  aux: Any


def cast_inputs(config: StepConfig, state: TrainState, batch: Any) -> Inputs:
  """Casts params, model state and batch to the compute dtype (stage 1).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> state = jmp.TrainState.create(params={"w": jnp.ones(2), "n": 3}, tx=optax.sgd(0.1))
    >>> config = StepConfig(lambda p, b: 0.0, jmp.get_policy("mixed_bfloat16"))
    >>> inputs = cast_inputs(config, state, {"x": jnp.ones(2)})
    >>> inputs.params["w"].dtype, inputs.trained["w"].dtype, inputs.trained["n"]
    (dtype(bfloat16), dtype('float32'), None)
    >>> inputs.batch["x"].dtype  # batch_policy=None: passed as it is.
    dtype('float32')
  """
  return cast_parts(config, state.params, state.model_state, batch)


def cast_parts(config: StepConfig, params: Any, model_state: Any, batch: Any) -> Inputs:
  """:func:`cast_inputs` for params, model state and batch given apart (``make_eval_step``)."""
  if config.batch_policy is not None:
    batch = config.batch_policy.cast_to_compute(batch)
  view = masters.float32_view(params)  # float32 masters: as they are
  # Model state (BatchNorm running statistics, counters) is state, not compute:
  # it stays in its stored dtype, as torch keeps buffers in float32 under autocast,
  # so that an update below half a float16 ulp is not lost.
  return Inputs(trained_part(view), config.policy.cast_to_compute(view), model_state, batch)


def warn_unmatched_keep_rules(config: StepConfig, state: TrainState, batch: Any) -> None:
  """Warns, at trace time (once per compile), for keep rules that select no leaf.

  The policy's rules apply to the params (the model state is never cast),
  the batch rules (``batch_keep_full``) to the batch when it is cast.
  """
  policy_lib.warn_unmatched_keep_rules(config.policy.keep_full, {"params": state.params},
                                       "the policy")
  if config.batch_policy is not None:
    policy_lib.warn_unmatched_keep_rules(
        config.batch_policy.keep_full, {"batch": batch}, "batch_keep_full")


def scaled_gradient(config: StepConfig, inputs: Inputs, scale: jax.Array) -> Gradients:
  """Calls ``loss_fn`` and differentiates ``float32(loss) * scale`` (stage 2).

  Gradients with respect to the compute-dtype copy are the same values as with
  respect to the masters (the cast's transpose is an exact widening), but half
  the bytes to hold until the skip is decided; the guard widens them to the
  masters' dtype as it unscales.

  Raises:
    TypeError: if the loss is not a float scalar, or ``loss_fn`` does not
      return the pair that ``has_aux`` or a model state asks for.
  """
  with_state = inputs.model_state is not None
  call: Callable[..., Any] = functools.partial(_call_loss_fn, config, with_state)
  if config.axis_name is not None:
    call = _bind_axis_name(call, config.axis_name)

  def scaled_loss(trained_c: Any, model_state: Any) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
    # Rebuilt here, so that objects in it (NNX variables, which remember the
    # trace they were made in) belong to this trace and can be mutated.
    model_state = jax.tree.map(lambda x: x, model_state)
    with jax.named_scope(half_share.LOSS_SCOPE):  # Where the first call counts matmuls.
      loss, new_model_state, aux = call(
          tree_utils.merge_floating(trained_c, inputs.params), model_state, inputs.batch)
    return loss * scale, (loss, new_model_state, aux)

  grads, (loss, model_state, aux) = jax.grad(scaled_loss, has_aux=True)(
      trained_part(inputs.params), inputs.model_state)
  return Gradients(grads, loss, model_state, aux)


def guarded_update(
    config: StepConfig, state: TrainState, inputs: Inputs, grads: Gradients
) -> tuple[skip.Guarded, optax.OptState]:
  """The optimizer update under the skip, and the new optimizer state (stage 3).

  An outermost scaler guards its inner update itself (and adjusts its scale);
  a plain optax ``tx`` goes through :func:`skip.guarded_update` without a
  scale. float32 masters take the update inside the guard (one fused pass, and
  a skipped step passes them through); bfloat16 masters round on write-back,
  where an update of ``-0.0`` leaves weight and compensation unchanged.
  """
  extra = config.extra_args(grads.loss, grads.aux, inputs.batch) if config.extra_args else {}
  kwargs = {"value": grads.loss, **extra}
  apply = state.master_dtype != masters.BFLOAT16
  scaler = transform.scaling_update_of(state.tx)
  if scaler is not None:
    # The scaler's own state: check_outermost found it at the root.
    scale_state = cast(transform.LossScaleState, state.opt_state)
    # The skip decides on the loss, whatever `value` extra_args passes to tx.
    return scaler.guarded(grads.grads, scale_state, inputs.trained, apply=apply,
                          skip_loss=grads.loss, **kwargs)
  tx = optax.with_extra_args_support(state.tx)
  guard = skip.guarded_update(
      lambda g, s, p: tx.update(g, s, p, **kwargs),
      grads.grads, state.opt_state, inputs.trained,
      inv_scale=None, value=grads.loss, apply=apply,
  )
  return guard, guard.state


def write_back(state: TrainState, guard: skip.Guarded, opt_state: optax.OptState) -> TrainState:
  """The state after the update: masters, optimizer state, step counter (stage 4).

  float32 masters come from the guard (which applied the update); bfloat16
  masters are written back by :func:`masters.apply_updates` with the state's
  rounding. Non-trained leaves are kept; ``step`` saturates at ``2**31 - 1``.
  """
  if state.master_dtype == masters.BFLOAT16:
    new_trained, compensation = masters.apply_updates(
        trained_part(state.params), cast(optax.Updates, guard.updates),  # apply=False
        rounding=state.rounding,
        key=step_rounding_key(state), compensation=state.compensation,
    )
  else:
    new_trained, compensation = cast(optax.Params, guard.params), None  # apply=True
  return state.replace(
      step=optax.safe_increment(state.step),
      params=tree_utils.merge_floating(new_trained, state.params),
      opt_state=opt_state,
      compensation=compensation,
  )


def next_model_state(state: TrainState, new: Any, finite: jax.Array) -> Any:
  """``loss_fn``'s new model state in the stored dtypes, the old one if skipped (stage 5).

  Static leaves (an Equinox EMA model's activation function, a ``float``
  field, a string tag) are kept as the very same objects; see
  :func:`step_model_state.stored` for what may be stored.

  Raises:
    TypeError: if ``new`` has another tree structure than ``state.model_state``,
      a leaf that cannot be stored in its dtype or a static leaf that changed.
  """
  if state.model_state is None:
    return None
  traced, spec = step_model_state.stored(new, state.model_state)
  # Only the arrays go through the skip; static leaves are the state's own.
  kept = skip.either(finite, lambda old: traced, lambda old: old,
                     filtering.partition(state.model_state)[0])
  return filtering.combine(kept, spec)


def step_metrics(
    config: StepConfig, scale: jax.Array, inputs: Inputs, grads: Gradients, guard: skip.Guarded
) -> dict[str, Any]:
  """The metrics: loss, grads_finite, loss_scale, grad_norm, aux, nonfinite (stage 6)."""
  metrics = {"loss": grads.loss, "grads_finite": guard.finite, "loss_scale": scale,
             "grad_norm": jnp.sqrt(guard.sumsq)}
  if config.has_aux:
    metrics["aux"] = grads.aux
  if config.track_nonfinite:
    metrics["nonfinite"] = jax.tree.map(
        lambda g: jnp.zeros((), bool) if g is None else g,
        _nonfinite_leaves(grads.grads, 1.0 / scale, inputs.trained),
        is_leaf=lambda x: x is None,
    )
  return metrics


def skip_metrics(opt_state: Any) -> dict[str, Any]:
  """``consecutive_skips``: the current run of skipped steps, with a loss-scaling ``tx``.

  A device array read from the new optimizer state (no host synchronisation);
  without a loss-scaling state there is nothing to count and it is absent.
  """
  scaler = transform.find_loss_scale_state(opt_state)
  return {} if scaler is None else {"consecutive_skips": scaler.consecutive_skips}


def _call_loss_fn(
    config: StepConfig, with_state: bool, params: Any, model_state: Any, batch: Any
) -> tuple[jax.Array, Any, Any]:
  """``(float32 loss, new model state, aux)`` from one call of ``loss_fn``."""
  has_aux = config.has_aux
  _check_arity(config.loss_fn, with_state)
  if with_state:
    out = config.loss_fn(params, model_state, batch)
  else:
    out = config.loss_fn(params, batch)
  loss, rest = _split_aux(out, has_aux or with_state, with_state)
  if with_state and has_aux:
    new_model_state, aux = _split_aux(rest, True, with_state, what="the second element")
  else:
    new_model_state, aux = (rest, None) if with_state else (None, rest)
  return _check_loss(loss, has_aux or with_state).astype(jnp.float32), new_model_state, aux


def _check_arity(loss_fn: Callable[..., Any], with_state: bool) -> None:
  """Refuses a ``loss_fn`` whose signature cannot take the step's arguments.

  Checked with :func:`inspect.signature` before the call, so a ``TypeError``
  raised inside ``loss_fn`` is never mistaken for one; functions taking
  ``*args`` and those without a signature are called as they are.
  """
  try:
    signature = inspect.signature(loss_fn)
  except (TypeError, ValueError):
    return
  try:
    signature.bind(*([None] * (3 if with_state else 2)))
  except TypeError as e:
    msg = _STATE_ARITY_MSG if with_state else _ARITY_MSG
    raise TypeError(msg.format(signature=signature, error=e)) from e


def _check_loss(loss: Any, has_aux: bool) -> jax.Array:
  aux = " (as the first element of (loss, aux))" if has_aux else ""
  if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
    hint = _NO_AUX_HINT if isinstance(loss, (tuple, list)) and len(loss) == 2 else ""
    raise TypeError(_LOSS_MSG.format(aux=aux, what=repr(type(loss))) + hint)
  if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(_LOSS_MSG.format(aux=aux, what=f"shape {loss.shape} dtype {loss.dtype}"))
  return loss


def _split_aux(
    out: Any, has_aux: bool, with_state: bool = False, what: str = "it"
) -> tuple[Any, Any]:
  """``out`` as a pair, with a message that says which pair was expected."""
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    if hasattr(out, "shape") and hasattr(out, "dtype"):
      got = f"an array of shape {out.shape} dtype {out.dtype}"
    elif isinstance(out, (tuple, list)):
      got = f"a {type(out).__name__} of length {len(out)}"
    else:
      got = repr(type(out))
    if with_state:
      raise TypeError(_STATE_MSG.format(what=what, got=got))
    raise TypeError(_AUX_MSG.format(what=got))
  return out[0], out[1]


def _bind_axis_name(fn: Callable[..., Any], axis_name: str) -> Callable[..., Any]:
  """``fn`` with ``axis_name`` bound over the whole (global) batch.

  Collectives over ``axis_name`` inside the model (``BatchNorm(axis_name=...)``'s
  ``pmean`` of its statistics, which are already means over the global batch
  under ``jit``) run over a single member and are the identity, so a
  data-parallel ``pmap``-style model runs unchanged on a sharded ``jit`` step.
  """

  def bound(params: Any, model_state: Any, batch: Any) -> Any:
    # Only the array leaves get the axis; static ones (a "split": "train"
    # tag) reach fn as they are, as without axis_name (filtering's rule).
    traced, spec = filtering.partition(batch)
    expanded = [None if x is None else jnp.asarray(x)[None] for x in traced]
    out = jax.vmap(lambda b: fn(params, model_state, filtering.combine(b, spec)),
                   axis_name=axis_name, axis_size=1)(expanded)
    return jax.tree.map(lambda x: x[0], out)

  return bound


def _nonfinite_leaves(grads: optax.Updates, inv_scale: jax.Array, params: optax.Params) -> Any:
  """Per leaf: True if its gradient has an inf/NaN or its squared norm overflows.

  When no single leaf is non-finite but the global sum of squares overflows,
  the leaves whose squared norm exceeds ``float32 max / number of leaves``
  (at least one must) are marked: they are the largest contributions.
  """
  sums = jax.tree.map(lambda g, p: skip.unscaled_sumsq(g, inv_scale, p), grads, params)
  leaves = jax.tree.leaves(sums)
  if not leaves:
    return jax.tree.map(lambda _: jnp.zeros((), bool), sums)
  total = functools.reduce(operator.add, leaves)  # sum(leaves), typed as an array.
  share = jnp.finfo(total.dtype).max / len(leaves)
  sum_overflow = ~jnp.isfinite(total) & jnp.all(jnp.isfinite(jnp.stack(leaves)))
  return jax.tree.map(lambda s: ~jnp.isfinite(s) | (sum_overflow & (s > share)), sums)

"""A jit-compiled mixed-precision train step over fp32 master params."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import policy as policy_lib
from jmp_lite._src import transform
from jmp_lite._src import tree_utils

_LOSS_MSG = "loss_fn must return a float scalar loss{aux}; got {what}"
_AUX_MSG = "loss_fn was declared with has_aux=True and must return a (loss, aux) pair; got {what}"
_STRUCTURE_MSG = (
    "the {what} tree changed structure between calls of the same train step "
    "(the step was first called with one structure and would silently recompile "
    "for another).\n  expected: {expected}\n  received: {received}\n"
    "Pass trees of the first structure, or build a separate step with "
    "make_train_step for the new one."
)


def _to_master(x: Any) -> Any:
  """Floating leaves become float32 (or float64) jax arrays; others are kept.

  Leaves narrower than float32 (bf16, f16, f8) are upcast to float32, numpy
  floating arrays become jax arrays (float64 ones follow ``jax_enable_x64``),
  and Python floats become float32 arrays (otherwise they would be treated as
  constants and never trained).
  """
  if isinstance(x, float):
    return jnp.asarray(x, jnp.float32)
  if tree_utils.is_floating_array(x):
    if jnp.finfo(x.dtype).bits < 32:
      return jnp.asarray(x, jnp.float32)
    return jnp.asarray(x)
  return x


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Step counter, fp32 master params and optimizer state. A pytree.

  ``step``, ``params`` and ``opt_state`` are pytree children; ``tx`` is static.
  Build it with :meth:`create`. It checkpoints with
  ``orbax.checkpoint.StandardCheckpointer`` and restores into a template made by
  :meth:`create`.

  Attributes:
    step: int32 scalar, the number of steps taken (skipped steps included).
    params: master params. Floating leaves are float32 (or float64); other
      leaves (int counters, PRNG keys) are kept as they are and never updated.
    opt_state: ``tx``'s state over the floating leaves of ``params``
      (non-floating leaves are ``None`` holes).
    tx: the optax transformation.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, *, params: Any, tx: optax.GradientTransformation) -> "TrainState":
    """A fresh state: step 0, master params and ``tx.init`` over them.

    Floating leaves narrower than float32 (bf16, f16, f8) are upcast to
    float32, so the state always holds full-precision master weights; a
    Python float leaf becomes a float32 array. float32 and float64 leaves keep
    their dtype. Non-floating leaves (int counters, PRNG keys) are kept as they
    are; ``tx.init`` sees ``None`` in their place.

    Args:
      params: a pytree of parameters.
      tx: an optax transformation, usually wrapped in
        :func:`dynamic_loss_scaling` or :func:`static_loss_scaling`.

    Returns:
      A ``TrainState`` with ``step`` 0 (int32).

    Raises:
      TypeError: if ``tx`` is not an optax transformation.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_lite as jmp
      >>> state = jmp.TrainState.create(params={"w": jnp.ones(2, jnp.bfloat16)}, tx=optax.sgd(0.1))
      >>> state.params["w"].dtype, state.step.dtype
      (dtype('float32'), dtype('int32'))
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
      raise TypeError(f"tx must be an optax transformation, got {tx!r}")
    params = jax.tree.map(_to_master, params)
    return cls(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(tree_utils.floating_part(params)),
        tx=tx,
    )

  def replace(self, **changes: Any) -> "TrainState":
    """A copy with some fields replaced (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState, data_fields=["step", "params", "opt_state"], meta_fields=["tx"]
)


def _check_loss(loss: Any, has_aux: bool) -> jax.Array:
  aux = " (as the first element of (loss, aux))" if has_aux else ""
  if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
    raise TypeError(_LOSS_MSG.format(aux=aux, what=repr(type(loss))))
  if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(_LOSS_MSG.format(aux=aux, what=f"shape {loss.shape} dtype {loss.dtype}"))
  return loss


def _check_master_params(params: Any) -> None:
  """Refuses half-precision masters (runs at trace time, so once per compile)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if tree_utils.is_floating_array(leaf) and jnp.finfo(leaf.dtype).bits < 32:
      raise TypeError(
          f"state.params must hold float32 (or float64) master weights, but "
          f"{tree_utils.path_str(path)!r} is {leaf.dtype}; build the state with "
          "TrainState.create, which upcasts half-precision params"
      )


def _split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    if hasattr(out, "shape") and hasattr(out, "dtype"):
      what = f"an array of shape {out.shape} dtype {out.dtype}"
    elif isinstance(out, (tuple, list)):
      what = f"a {type(out).__name__} of length {len(out)}"
    else:
      what = repr(type(out))
    raise TypeError(_AUX_MSG.format(what=what))
  return out[0], out[1]


class _TrainStep:
  """The jitted step plus a check that params and batch keep their structure.

  The check compares tree structures on the Python side (cheap) before the
  call. Attribute access (``lower``, ``trace``, ``eval_shape``, ...) goes to the
  underlying ``jax.jit`` object.
  """

  def __init__(self, jitted: Callable[..., Any]):
    self._jitted = jitted
    self._structures: tuple[Any, Any] | None = None
    self.__wrapped__ = jitted

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    if not isinstance(state, TrainState):
      raise TypeError(
          f"state must be a jmp_lite.TrainState (see TrainState.create), got {type(state).__name__}"
      )
    structures = (jax.tree.structure(state.params), jax.tree.structure(batch))
    if self._structures is not None:
      for what, expected, received in zip(("params", "batch"), self._structures, structures):
        if expected != received:
          raise ValueError(
              _STRUCTURE_MSG.format(what=what, expected=expected, received=received)
          )
    out = self._jitted(state, batch)
    if self._structures is None:
      self._structures = structures
    return out

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name == "_jitted":
      raise AttributeError(name)
    return getattr(self._jitted, name)


def _update_and_apply(tx, grads, opt_state, params, scale):
  """``tx.update`` + ``optax.apply_updates``, skipping non-finite gradients.

  Returns ``(params, opt_state, sumsq)``, where ``sumsq`` is the sum of squares
  of the unscaled gradients: finite iff the step is applied, and the square of
  the ``grad_norm`` metric. The loss-scaling transformation computes the same
  expression for its own decision, and XLA computes it once.
  """
  sumsq = transform.unscaled_sumsq(grads, 1.0 / scale)
  if transform.find_loss_scale_state(opt_state) is not None:
    updates, opt_state = tx.update(grads, opt_state, params)
  else:
    # A plain optax transformation: the same skip, without a scale to adjust.
    updates, opt_state = transform.cond_update(
        jnp.isfinite(sumsq), tx.update, grads, opt_state, params
    )
  return optax.apply_updates(params, updates), opt_state, sumsq


def make_train_step(
    loss_fn: Callable[..., Any],
    policy: policy_lib.Policy,
    *,
    has_aux: bool = False,
    donate: bool = True,
    track_nonfinite: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
  """Builds ``step(state, batch) -> (state, metrics)``, compiled with ``jax.jit``.

  Each call::

    scale   = loss_scale_of(state.opt_state)          # 1.0 if tx has no scaling
    p_c     = policy.cast_to_compute(state.params)    # half copy, inside the step only
    loss    = loss_fn(p_c, cast floating batch leaves to policy.compute_dtype)
    grads   = d(float32(loss) * scale) / d(master params)   # through the cast
    updates, opt_state = tx.update(grads, opt_state, params)
    params  = optax.apply_updates(params, updates)

  Only ``loss_fn``'s view of the params is in ``policy.compute_dtype``
  (``keep_full`` leaves stay float32): the gradients, the optimizer update and
  the stored params are float32. ``policy.param_dtype`` and ``output_dtype`` are
  not used by the step. Non-floating leaves of params (int counters, PRNG keys)
  and of the batch (labels) are passed through as they are; param ones are not
  differentiated and come back unchanged.

  Skipped steps: when a gradient is inf or NaN (or the global norm of the
  unscaled gradients overflows float32), the optimizer update is skipped under
  ``lax.cond`` and its updates are ``-0.0``, so params and the inner optimizer
  state (Adam's count, schedules) are unchanged bit for bit while the scale
  backs off. One sum of squares of the unscaled gradients gives both the skip
  decision and ``grad_norm``. ``state.step`` still increments: it counts
  calls, skipped ones included (the skipped ones are in
  :func:`skipped_steps_of`). A plain optax ``tx`` (no loss scaling) is guarded
  the same way, without a scale to adjust or a skip counter.

  The step compiles once per distinct input shapes and shardings, skipped steps
  included. It remembers the tree structure of the params and the batch of its
  first call and refuses another structure with a ``ValueError`` rather than
  recompiling silently. It runs unchanged on sharded inputs (a
  ``jax.sharding.Mesh`` with ``NamedSharding``s on the state and the batch):
  XLA inserts the reductions, and the skip decision covers every shard.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a float scalar, or
      ``(loss, aux)`` when ``has_aux``.
    policy: the precision policy; its keep rules apply to params.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state's buffers to the step (default on): the state
      passed in, and the params given to :meth:`TrainState.create` if they were
      already float32 jax arrays, are deleted by the call. Use the returned
      state, or pass ``donate=False`` to keep the old one.
    track_nonfinite: add ``metrics["nonfinite"]``, a bool pytree over params
      marking the leaves whose (scaled) gradients were non-finite.

  Returns:
    The jitted step. ``metrics`` holds ``loss`` (float32, unscaled),
    ``grads_finite`` (bool; False means the step was skipped), ``loss_scale``
    (the scale used this step), ``grad_norm`` (float32 global norm of the
    unscaled gradients; inf or NaN on a skipped step), ``aux`` when ``has_aux``
    and ``nonfinite`` when ``track_nonfinite``.

  Raises:
    TypeError: if ``loss_fn`` is not callable or ``policy`` is not a
      :class:`Policy`; when the step is called, if ``state`` is not a
      :class:`TrainState`, or (at trace time) if the loss is not a float
      scalar or ``has_aux`` is set and ``loss_fn`` does not return a pair.
    ValueError: when the step is called with params or a batch whose tree
      structure differs from the first call's.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)
    >>> state = jmp.TrainState.create(params={"w": jnp.zeros((3, 1))}, tx=tx)
    >>> step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.ones((4, 1))}
    >>> state, metrics = step(state, batch)
    >>> metrics["loss"].dtype, bool(metrics["grads_finite"]), int(state.step)
    (dtype('float32'), True, 1)
  """
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy, got {policy!r}")
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  compute_dtype = policy.compute_dtype

  def step(state: TrainState, batch: Any):
    _check_master_params(state.params)
    scale = transform.loss_scale_of(state.opt_state)
    batch = tree_utils.cast_floating(batch, compute_dtype)
    float_params = tree_utils.floating_part(state.params)

    def scaled_loss(float_params):
      params = tree_utils.merge_floating(float_params, state.params)
      loss, aux = _split_aux(loss_fn(policy.cast_to_compute(params), batch), has_aux)
      loss = _check_loss(loss, has_aux).astype(jnp.float32)
      return loss * scale, (loss, aux)

    grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(float_params)
    new_float, opt_state, sumsq = _update_and_apply(
        state.tx, grads, state.opt_state, float_params, scale
    )
    new_state = state.replace(
        step=state.step + 1,
        params=tree_utils.merge_floating(new_float, state.params),
        opt_state=opt_state,
    )
    metrics = {
        "loss": loss,
        "grads_finite": jnp.isfinite(sumsq),
        "loss_scale": scale,
        "grad_norm": jnp.sqrt(sumsq),
    }
    if has_aux:
      metrics["aux"] = aux
    if track_nonfinite:
      metrics["nonfinite"] = jax.tree.map(
          lambda g: jnp.zeros((), bool) if g is None else ~jnp.isfinite(g).all(),
          grads,
          is_leaf=lambda x: x is None,
      )
    return new_state, metrics

  return _TrainStep(jax.jit(step, donate_argnums=(0,) if donate else ()))

"""A jit-compiled mixed-precision train step over fp32 master params."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import autocast as autocast_lib
from jmp_lite._src import checks
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import skip
from jmp_lite._src import transform
from jmp_lite._src import tree_utils

_LOSS_MSG = "loss_fn must return a float scalar loss{aux}; got {what}"
_AUX_MSG = "loss_fn was declared with has_aux=True and must return a (loss, aux) pair; got {what}"
_NO_AUX_HINT = (
    "; it returned a pair: if the second element is auxiliary output, build the "
    "step with has_aux=True"
)
_STRUCTURE_MSG = (
    "the {what} tree changed structure between calls of the same train step "
    "(the step was first called with one structure and would silently recompile "
    "for another).\n  expected: {expected}\n  received: {received}\n"
    "Pass trees of the first structure, or build a separate step with "
    "make_train_step for the new one."
)
_DELETED_MSG = (
    "{where} was deleted: a donating step (make_train_step(..., donate=True), the "
    "default) consumed the state it was part of. Keep using the state each call "
    "returns (state, metrics = step(state, batch)), or build the step with "
    "donate=False to keep old states alive."
)
_ALIASED_MSG = (
    "{first} and {second} are the same array, and a donating step cannot donate "
    "one buffer twice (or donate a buffer it also reads from the batch). Give "
    "them separate arrays (TrainState.create copies every leaf, so build states "
    "with it), or build the step with donate=False."
)


def _own_leaf(x: Any) -> Any:
  """The state's own copy of a params leaf (see :meth:`TrainState.create`)."""
  if isinstance(x, bool):
    return jnp.asarray(x, jnp.bool_)
  if isinstance(x, int):
    return jnp.asarray(x, jnp.int32)
  if isinstance(x, float):
    return jnp.asarray(x, jnp.float32)
  if tree_utils.is_floating_array(x) and jnp.finfo(x.dtype).bits < 32:
    return jnp.asarray(x, jnp.float32)
  # A fresh, strongly typed buffer: donation only ever consumes the state's own.
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # PRNG keys.
      return jax.random.wrap_key_data(jnp.array(jax.random.key_data(x), copy=True),
                                      impl=jax.random.key_impl(x))
    return jnp.array(x, dtype=x.dtype, copy=True)
  if tree_utils.is_inexact_array(x):  # NumPy floating: a jax array, as before.
    return jnp.array(x, copy=True)
  return x


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Step counter, fp32 master params and optimizer state. A pytree.

  ``step``, ``params`` and ``opt_state`` are pytree children; ``tx`` is static.
  Build it with :meth:`create`. It checkpoints with
  ``orbax.checkpoint.StandardCheckpointer`` and restores into a template made by
  :meth:`create`.

  Attributes:
    step: int32 scalar, the number of steps taken (skipped steps included);
      it saturates at ``2**31 - 1``.
    params: master params. Floating leaves are float32 (or float64); other
      leaves (int counters, PRNG keys) are kept as they are and never updated.
    opt_state: ``tx``'s state over the floating leaves of ``params``
      (non-floating leaves are ``None`` holes).
    tx: the optax transformation.
  """

  step: jax.Array
  params: optax.Params
  opt_state: optax.OptState
  tx: optax.GradientTransformation = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, *, params: optax.Params, tx: optax.GradientTransformation) -> "TrainState":
    """A fresh state: step 0, master params and ``tx.init`` over them.

    The state owns its buffers: every array leaf is copied once, so a donating
    step only ever deletes the state's arrays, never the caller's. Floating
    leaves narrower than float32 (bf16, f16, f8) become float32, so the state
    always holds full-precision master weights; float32, float64 and complex
    leaves keep their dtype. Python numbers become strongly typed arrays
    (float32, int32, bool), and weakly typed arrays become strong, so that
    every step sees the same types. Non-floating leaves (int counters, PRNG
    keys) are kept (copied); ``tx.init`` sees ``None`` in their place.

    Args:
      params: a pytree of parameters.
      tx: an optax transformation, usually wrapped in
        :func:`dynamic_loss_scaling` or :func:`static_loss_scaling`
        (outermost).

    Returns:
      A ``TrainState`` with ``step`` 0 (int32).

    Raises:
      TypeError: if ``tx`` is not an optax transformation.
      ValueError: if ``tx`` holds a loss-scaling transformation that is not
        outermost, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jmp_lite as jmp
      >>> state = jmp.TrainState.create(params={"w": jnp.ones(2, jnp.bfloat16)}, tx=optax.sgd(0.1))
      >>> state.params["w"].dtype, state.step.dtype
      (dtype('float32'), dtype('int32'))
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
      raise TypeError(f"tx must be an optax transformation, got {tx!r}")
    params = jax.tree.map(_own_leaf, params)
    opt_state = tx.init(_trained_part(params))
    transform.check_outermost(tx, opt_state)
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, tx=tx)

  def replace(self, **changes: Any) -> "TrainState":
    """A copy with some fields replaced (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(TrainState)


def _trained_part(params: optax.Params) -> optax.Params:
  """The leaves the step differentiates and updates; the others are ``None``."""
  return jax.tree.map(lambda x: x if tree_utils.is_inexact_array(x) else None, params)


def _check_loss(loss: Any, has_aux: bool) -> jax.Array:
  aux = " (as the first element of (loss, aux))" if has_aux else ""
  if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
    hint = _NO_AUX_HINT if isinstance(loss, (tuple, list)) and len(loss) == 2 else ""
    raise TypeError(_LOSS_MSG.format(aux=aux, what=repr(type(loss))) + hint)
  if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(_LOSS_MSG.format(aux=aux, what=f"shape {loss.shape} dtype {loss.dtype}"))
  return loss


def _check_master_params(params: optax.Params) -> None:
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


def _named_leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(prefix + jax.tree_util.keystr(p), x) for p, x in flat]


def _donation_problem(state: TrainState, batch: Any) -> str | None:
  """Why a donating call failed on its inputs (deleted or aliased arrays), if it did."""
  leaves = _named_leaves("state", state) + _named_leaves("batch", batch)
  seen: dict[int, str] = {}
  for name, x in leaves:
    if not isinstance(x, jax.Array):
      continue
    if x.is_deleted():
      return _DELETED_MSG.format(where=name)
    if id(x) in seen:
      return _ALIASED_MSG.format(first=seen[id(x)], second=name)
    seen[id(x)] = name
  return None


class _TrainStep:
  """The jitted step plus the checks that need Python: tree structures, donation.

  The structure check compares tree structures on the Python side (cheap)
  before the call. Deleted or aliased input arrays are diagnosed only when the
  call fails, so they cost nothing otherwise. Attribute access (``lower``,
  ``trace``, ``eval_shape``, ...) goes to the underlying ``jax.jit`` object.
  """

  def __init__(self, jitted: Callable[..., Any], donate: bool):
    self._jitted = jitted
    self._donate = donate
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
    try:
      out = self._jitted(state, batch)
    except (RuntimeError, ValueError) as e:
      problem = _donation_problem(state, batch) if self._donate else None
      if problem is None:
        raise
      raise ValueError(problem) from e
    if self._structures is None:
      self._structures = structures
    return out

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name == "_jitted":
      raise AttributeError(name)
    return getattr(self._jitted, name)


def _nonfinite_leaves(grads: optax.Updates, inv_scale: jax.Array) -> Any:
  """Per leaf: True if its gradient has an inf/NaN or its squared norm overflows.

  When no single leaf is non-finite but the global sum of squares overflows,
  the leaves whose squared norm exceeds ``float32 max / number of leaves``
  (at least one must) are marked: they are the largest contributions.
  """
  sums = jax.tree.map(lambda g: skip.unscaled_sumsq(g, inv_scale), grads)
  leaves = jax.tree.leaves(sums)
  if not leaves:
    return jax.tree.map(lambda _: jnp.zeros((), bool), sums)
  total = sum(leaves)
  share = jnp.finfo(total.dtype).max / len(leaves)
  sum_overflow = ~jnp.isfinite(total) & jnp.all(jnp.isfinite(jnp.stack(leaves)))
  return jax.tree.map(lambda s: ~jnp.isfinite(s) | (sum_overflow & (s > share)), sums)


def make_train_step(
    loss_fn: Callable[..., Any],
    policy: policy_lib.Policy,
    *,
    has_aux: bool = False,
    donate: bool = True,
    track_nonfinite: bool = False,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
    extra_args: Callable[[jax.Array, Any, Any], Mapping[str, Any]] | None = None,
    autocast: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
  """Builds ``step(state, batch) -> (state, metrics)``, compiled with ``jax.jit``.

  Each call::

    scale   = loss_scale_of(state.opt_state)          # 1.0 if tx has no scaling
    p_c     = policy.cast_to_compute(state.params)    # half copy, inside the step only
    loss    = loss_fn(p_c, cast floating batch leaves to policy.compute_dtype)
    grads   = d(float32(loss) * scale) / d(master params)   # through the cast
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params  = optax.apply_updates(params, updates)

  Only ``loss_fn``'s view of the params is in ``policy.compute_dtype``
  (``keep_full`` leaves stay float32): the gradients, the optimizer update and
  the stored params are float32. ``policy.param_dtype`` and ``output_dtype`` are
  not used by the step. Non-floating leaves of params (int counters, PRNG keys)
  and of the batch (labels) are passed through as they are; param ones are not
  differentiated and come back unchanged.

  Skipped steps: when a gradient is inf or NaN, the global norm of the
  unscaled gradients overflows, or the loss itself is inf or NaN, the
  optimizer update is skipped under ``lax.cond`` and its updates are ``-0.0``,
  so params and the inner optimizer state (Adam's count, schedules) are
  unchanged bit for bit while the scale backs off. One sum of squares of the
  unscaled gradients gives both the skip decision and ``grad_norm``: with an
  outermost :func:`dynamic_loss_scaling`/:func:`static_loss_scaling` it is the
  transformation's own, otherwise (a plain optax ``tx``) the step guards the
  update the same way, without a scale to adjust or a skip counter. A scaler
  nested inside another transformation is refused (``ValueError``).
  ``state.step`` still increments: it counts calls, skipped ones included.

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
      passed in is deleted by the call (never the arrays given to
      :meth:`TrainState.create`, which copies them). Use the returned state,
      or pass ``donate=False`` to keep the old one.
    track_nonfinite: add ``metrics["nonfinite"]``, a bool pytree over params
      marking the leaves whose gradients were inf or NaN (or, when only the
      global norm overflowed, the leaves that contributed most). It costs one
      more reduction per leaf.
    cast_batch: cast the batch's floating leaves to ``policy.compute_dtype``
      (default). ``False`` passes the batch to ``loss_fn`` as it is.
    batch_keep_full: keep rules for the batch (the same grammar as
      :class:`Policy`'s ``keep_full``: a regex on the ``/``-joined key path,
      or a callable ``(path, leaf) -> bool``): the leaves they select stay
      float32. Use them for values a half dtype cannot hold, such as
      regression targets above 65504 in float16.
    extra_args: ``extra_args(loss, aux, batch)`` returning more keyword
      arguments for ``tx.update``, merged over the default ``value=loss``
      (the unscaled float32 loss, optax's name for it, which e.g.
      ``optax.contrib.reduce_on_plateau`` reads).
    autocast: run ``loss_fn`` under :func:`autocast` with
      ``policy.compute_dtype``. ``loss_fn`` still receives the params and the
      batch cast as above (keep rules included); autocast then runs its
      exp/log/pow/reductions (softmax, norms, losses) in float32 and its
      matmuls and convolutions in the compute dtype. Loss scaling, float32
      masters and the skip are unchanged. Needs a float16 or bfloat16
      compute dtype.

  Returns:
    The jitted step. ``metrics`` holds ``loss`` (float32, unscaled),
    ``grads_finite`` (bool; False means the step was skipped), ``loss_scale``
    (the scale used this step), ``grad_norm`` (global norm of the unscaled
    gradients, float32 or float64 with float64 masters; inf or NaN on a
    skipped step), ``aux`` when ``has_aux`` and ``nonfinite`` when
    ``track_nonfinite``.

  Raises:
    TypeError: if ``loss_fn`` is not callable, ``policy`` is not a
      :class:`Policy` or a flag is not a bool; when the step is called, if
      ``state`` is not a :class:`TrainState`, or (at trace time) if the loss
      is not a float scalar or ``has_aux`` is set and ``loss_fn`` does not
      return a pair.
    ValueError: if ``autocast`` is set and ``policy.compute_dtype`` is not
      float16 or bfloat16; when the step is called with params or a batch
      whose tree structure differs from the first call's, with a deleted
      (already donated) or aliased array, or with a nested loss-scaling
      transformation.

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
  has_aux = checks.boolean("has_aux", has_aux)
  donate = checks.boolean("donate", donate)
  track_nonfinite = checks.boolean("track_nonfinite", track_nonfinite)
  cast_batch = checks.boolean("cast_batch", cast_batch)
  if checks.boolean("autocast", autocast):
    loss_fn = autocast_lib.autocast(loss_fn, policy.compute_dtype)
  if extra_args is not None and not callable(extra_args):
    raise TypeError(f"extra_args must be a callable (loss, aux, batch) -> dict, got {extra_args!r}")
  batch_policy = policy_lib.Policy(
      policy.param_dtype, policy.compute_dtype, policy.output_dtype, keep_full=batch_keep_full
  )

  def step(state: TrainState, batch: Any):
    _check_master_params(state.params)
    transform.check_outermost(state.tx, state.opt_state)
    scale = transform.loss_scale_of(state.opt_state)
    if cast_batch:
      batch = batch_policy.cast_to_compute(batch)
    trained = _trained_part(state.params)

    def scaled_loss(trained):
      params = tree_utils.merge_floating(trained, state.params)
      loss, aux = _split_aux(loss_fn(policy.cast_to_compute(params), batch), has_aux)
      loss = _check_loss(loss, has_aux).astype(jnp.float32)
      return loss * scale, (loss, aux)

    grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(trained)
    kwargs = {"value": loss, **(extra_args(loss, aux, batch) if extra_args else {})}
    scaler = transform.scaling_update_of(state.tx)
    if scaler is not None:
      updates, opt_state, sumsq = scaler.guarded(grads, state.opt_state, trained, **kwargs)
      finite = opt_state.consecutive_skips == 0
    else:
      tx = optax.with_extra_args_support(state.tx)
      guard = skip.guarded_update(
          lambda g, s, p: tx.update(g, s, p, **kwargs),
          grads, state.opt_state, trained, inv_scale=None, value=loss,
      )
      updates, opt_state, sumsq, finite = guard
    new_state = state.replace(
        step=optax.safe_increment(state.step),
        params=tree_utils.merge_floating(optax.apply_updates(trained, updates), state.params),
        opt_state=opt_state,
    )
    metrics = {"loss": loss, "grads_finite": finite, "loss_scale": scale,
               "grad_norm": jnp.sqrt(sumsq)}
    if has_aux:
      metrics["aux"] = aux
    if track_nonfinite:
      metrics["nonfinite"] = jax.tree.map(
          lambda g: jnp.zeros((), bool) if g is None else g,
          _nonfinite_leaves(grads, 1.0 / scale),
          is_leaf=lambda x: x is None,
      )
    return new_state, metrics

  return _TrainStep(jax.jit(step, donate_argnums=(0,) if donate else ()), donate)

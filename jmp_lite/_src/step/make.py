"""The train step: :func:`make_train_step` validates its arguments and composes the stages.

The jitted body is the sequence of :mod:`jmp_lite._src.step.stages` (cast,
scaled gradient, guarded update, write-back, model state, metrics), after the
trace-time checks of the state; :class:`step_call.TrainStep` adds the checks
that need Python (tree structures, static batch leaves, donation).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from jmp_lite._src.autocast import autocast as autocast_lib
from jmp_lite._src import checks
from jmp_lite._src.fp8 import known as fp8_known
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.step import half_share
from jmp_lite._src.step import half_sums
from jmp_lite._src.step import stages
from jmp_lite._src.scaling import transform
from jmp_lite._src.fp8.recipe import Float8Recipe
from jmp_lite._src.fp8.recipe import as_recipe
from jmp_lite._src.step.call import TrainStep
from jmp_lite._src.step.train_state import TrainState
from jmp_lite._src.step.train_state import check_masters


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
    axis_name: str | None = None,
    autocast: bool = False,
    fp8: bool | Float8Recipe | None = None,
    warn_no_half: bool = True,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
  """Builds ``step(state, batch) -> (state, metrics)``, compiled with ``jax.jit``.

  Each call::

    scale   = loss_scale_of(state.opt_state)          # 1.0 if tx has no scaling
    p_c     = policy.cast_to_compute(state.params)    # half copy, inside the step only
    loss    = loss_fn(p_c, cast floating batch leaves to policy.compute_dtype)
    grads   = d(float32(loss) * scale) / d(master params)   # through the cast
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params  = apply_updates(params, updates, rounding=state.rounding, ...)

  Only ``loss_fn``'s view of the params is in ``policy.compute_dtype``
  (``keep_full`` leaves stay float32): the gradients, the optimizer update and
  the stored params are float32. With bfloat16 masters
  (``TrainState.create(..., master_dtype=jnp.bfloat16, rounding=...)``) the
  "master params" above are their float32 view ``float32(p)`` (with
  ``rounding="kahan"`` the compensation only enters the write-back):
  ``loss_fn``, the gradients and ``tx`` see float32 exactly as with float32
  masters, and only the write-back rounds to bfloat16, as
  :func:`apply_updates` does; step ``t`` rounds stochastically with
  ``jax.random.fold_in(state.rounding_key, t)``.
  ``policy.param_dtype`` and ``output_dtype`` are not used by the step.
  Non-floating leaves of params (int counters, PRNG keys) and of the batch
  (labels) are passed through as they are; param ones are not differentiated
  and come back unchanged.

  Skipped steps: when a gradient is inf or NaN, the global norm of the
  unscaled gradients overflows, or the loss itself is inf or NaN, the
  optimizer update is skipped under ``lax.cond`` and its updates are ``-0.0``,
  so params, the Kahan compensation and the inner optimizer state (Adam's
  count, schedules) are unchanged bit for bit while the scale backs off (a
  skipped step still advances ``state.step``, so the next step rounds with
  fresh random bits). One sum of squares of the unscaled gradients gives
  both the skip decision and ``grad_norm``: with an
  outermost :func:`dynamic_loss_scaling`/:func:`static_loss_scaling` it is the
  transformation's own, otherwise (a plain optax ``tx``) the step guards the
  update the same way, without a scale to adjust or a skip counter. A scaler
  nested inside another transformation is refused (``ValueError``).
  ``state.step`` still increments: it counts calls, skipped ones included.

  The step compiles once per distinct input shapes and shardings, skipped steps
  included. Array leaves are traced; any other leaf (a Python number or string
  in the batch, an Equinox module's activation function) is static, part of
  the compilation key, as under ``eqx.filter_jit``. The step remembers the
  tree structure of the params and the batch of its first call, and the
  batch's static leaves, and refuses another structure or a changed static
  leaf with a ``ValueError`` rather than recompiling silently (pass
  ``jnp.asarray(x)`` for a value that changes per step). It runs unchanged on
  sharded inputs (a ``jax.sharding.Mesh`` with a ``NamedSharding`` per array
  of the state and the batch): XLA inserts the reductions, and the skip
  decision covers every shard.

  Model state: when ``state.model_state`` is set (:meth:`TrainState.create`'s
  ``model_state``: Flax ``batch_stats``, NNX non-param variables), the step
  calls ``loss_fn(params, model_state, batch)``, with ``model_state`` cast by
  the policy (keep rules apply), and ``loss_fn`` returns ``(loss,
  new_model_state)``, or ``(loss, (new_model_state, aux))`` with
  ``has_aux``. The new model state is stored in the state's dtypes, except on
  a skipped step, where the old one is kept bit for bit. Its static leaves
  (an Equinox EMA model's activation functions, a module's ``float`` field,
  a string tag) are kept as the very same objects, as the params' are;
  ``loss_fn`` must return them unchanged.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a float scalar, or
      ``(loss, aux)`` when ``has_aux``; ``loss_fn(params, model_state,
      batch)`` when the state has a model state (see above).
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
      ``optax.contrib.reduce_on_plateau`` reads). A ``value`` given here
      reaches ``tx`` but never decides the skip: that is always the loss's
      and the gradients'.
    axis_name: a name to bind over the whole batch while ``loss_fn`` runs,
      for models written for ``pmap`` whose collectives name the
      data-parallel axis (Flax ``BatchNorm(axis_name="batch")``). Under
      ``jit`` the batch statistics are already the global batch's, so those
      collectives are the identity; the step runs unchanged on a sharded mesh.
    autocast: run ``loss_fn`` under :func:`autocast` with
      ``policy.compute_dtype``. ``loss_fn`` still receives the params and the
      batch cast as above (keep rules included); autocast then runs its
      exp/log/pow/reductions (softmax, norms, losses) in float32 and its
      matmuls and convolutions in the compute dtype. Loss scaling, float32
      masters and the skip are unchanged. Needs a float16 or bfloat16
      compute dtype.
    fp8: ``True`` or a :class:`Float8Recipe`: autocast's matmuls run in FP8
      (``autocast(loss_fn, policy.compute_dtype, fp8=fp8)``; by default
      those whose GEMM sizes are all >= ``Float8Recipe.min_size``), with per-tensor
      current scaling; loss scaling, the masters and the skip are unchanged
      (a non-finite value in a matmul stays non-finite, so the skip sees it).
      Needs ``autocast=True``.
    warn_no_half: warn (:class:`NothingInHalfWarning`, once, at the first
      call) when the policy computes in half, or ``autocast`` is set, but
      under a tenth of the FLOPs of the matmuls and convolutions of
      ``loss_fn`` and its gradient run in half: a model whose layers pin
      ``dtype=jnp.float32`` saves nothing. The message names the cause as
      :func:`precision_lint` does. Default on; ``False`` where float32 is
      intended. The first call traces the step with ``jax.jit(...).trace``,
      which the call reuses: nothing is traced twice.

  Returns:
    The jitted step. ``metrics`` holds ``loss`` (float32, unscaled),
    ``grads_finite`` (bool; False means the step was skipped), ``loss_scale``
    (the scale used this step), ``grad_norm`` (global norm of the unscaled
    gradients, float32 or float64 with float64 masters; inf or NaN on a
    skipped step), ``consecutive_skips`` (int32, the current run of
    skipped steps; 0 after an applied step) when ``tx`` scales the loss,
    ``aux`` when ``has_aux`` and ``nonfinite`` when ``track_nonfinite``.
    Every metric is a device array: reading one is the only host sync.

  Raises:
    TypeError: if ``loss_fn`` is not callable, ``policy`` is not a
      :class:`Policy` or a flag is not a bool; when the step is called, if
      ``state`` is not a :class:`TrainState`, or (at trace time) if the loss
      is not a float scalar, ``loss_fn``'s signature cannot take
      ``(params, batch)`` (or ``(params, model_state, batch)`` with a model
      state), ``has_aux`` is set and ``loss_fn`` does not return a pair, or the params' dtypes are not the state's
      ``master_dtype`` (a hand-built state).
    ValueError: if ``autocast`` is set and ``policy.compute_dtype`` is not
      float16 or bfloat16, or ``fp8`` is set without ``autocast``; when the step is called with params or a batch
      whose tree structure differs from the first call's, with a static batch
      leaf whose value differs from the first call's, with a deleted
      (already donated) or aliased array, with a nested loss-scaling
      transformation, or with a state whose compensation or rounding key does
      not fit its ``rounding``.

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
  check_fn_and_policy("loss_fn", loss_fn, policy)
  has_aux = checks.boolean("has_aux", has_aux)
  donate = checks.boolean("donate", donate)
  track_nonfinite = checks.boolean("track_nonfinite", track_nonfinite)
  cast_batch = checks.boolean("cast_batch", cast_batch)
  warn_no_half = checks.boolean("warn_no_half", warn_no_half)
  if axis_name is not None and not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a string or None, got {axis_name!r}")
  loss_fn = under_autocast(loss_fn, policy, autocast, fp8)
  if extra_args is not None and not callable(extra_args):
    raise TypeError(f"extra_args must be a callable (loss, aux, batch) -> dict, got {extra_args!r}")
  batch_policy = policy_lib.Policy(
      policy.param_dtype, policy.compute_dtype, policy.output_dtype, keep_full=batch_keep_full
  )
  config = stages.StepConfig(
      loss_fn, policy, batch_policy if cast_batch else None, has_aux=has_aux,
      track_nonfinite=track_nonfinite, extra_args=extra_args, axis_name=axis_name,
  )

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    check_masters(state)
    transform.check_outermost(state.tx, state.opt_state)
    scale = transform.loss_scale_of(state.opt_state)
    stages.warn_unmatched_keep_rules(config, state, batch)
    inputs = stages.cast_inputs(config, state, batch)
    with fp8_known.given(fp8_known.by_path(state.weight_amaxes)):  # FP8 scales, known before.
      grads = stages.scaled_gradient(config, inputs, scale)
    guard, opt_state = stages.guarded_update(config, state, inputs, grads)
    new_state = stages.write_back(state, guard, opt_state).replace(
        model_state=stages.next_model_state(state, grads.model_state, guard.finite))
    metrics = stages.step_metrics(config, scale, inputs, grads, guard)
    return new_state, {**metrics, **stages.skip_metrics(opt_state)}

  checks_sums = np.dtype(policy.compute_dtype).itemsize <= 2 and not autocast

  def inspect(jaxpr: Any, state: TrainState, batch: Any) -> None:
    """Reads the first call's traced program: what runs in half, and what should not."""
    if checks_sums:
      half_sums.check(jaxpr, half_share.LOSS_SCOPE)
    if warn_no_half:
      half_share.check(jaxpr, state, batch, loss_fn=loss_fn, policy=policy, autocast=autocast,
                       options={"cast_batch": cast_batch, "batch_keep_full": batch_keep_full})

  return TrainStep(step, donate, inspect if checks_sums or warn_no_half else None)


def check_fn_and_policy(name: str, fn: Any, policy: Any) -> None:
  """Refuses a ``policy`` that is not a :class:`Policy` and an ``fn`` that is not callable."""
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy, got {policy!r}")
  if not callable(fn):
    raise TypeError(f"{name} must be callable, got {fn!r}")


def under_autocast(
    fn: Callable[..., Any], policy: policy_lib.Policy, autocast: Any, fp8: Any
) -> Callable[..., Any]:
  """``fn`` as the step runs it: under :func:`autocast` (with FP8 matmuls) if asked.

  Raises:
    TypeError: if ``autocast`` is not a bool or ``fp8`` not a bool or recipe.
    ValueError: if ``fp8`` is set without ``autocast``, or ``autocast`` with
      a float32 compute dtype.
  """
  recipe = as_recipe(fp8)
  if checks.boolean("autocast", autocast):
    return autocast_lib.step_autocast(fn, policy.compute_dtype, recipe)
  if recipe is not None:
    raise ValueError(f"fp8={fp8!r} needs autocast=True: the FP8 matmuls are autocast's")
  return fn

"""A jit-compiled mixed-precision train step over fp32 master params."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jmp_lite._src import loss_scale
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import transform
from jmp_lite._src import tree_utils

_LOSS_MSG = "loss_fn must return a float scalar loss{aux}; got {what}"


def _to_master(x: Any) -> Any:
  """Floating leaves narrower than float32 are upcast; f32/f64 are kept."""
  if tree_utils.is_floating_array(x) and jnp.finfo(x.dtype).bits < 32:
    return x.astype(jnp.float32)
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
    float32, so the state always holds full-precision master weights.

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

  If ``tx`` carries no loss-scaling state (plain optax), the step still refuses
  non-finite gradients: it keeps the old params and optimizer state by a
  select. Wrap ``tx`` in :func:`static_loss_scaling` (scale 1) to skip cheaply
  under ``lax.cond`` instead.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a float scalar, or
      ``(loss, aux)`` when ``has_aux``.
    policy: the precision policy; its keep rules apply to params.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state's buffers to the step (default on).
    track_nonfinite: add ``metrics["nonfinite"]``, a bool pytree over params
      marking the leaves whose gradients were non-finite.

  Returns:
    The jitted step. ``metrics`` holds ``loss`` (float32, unscaled),
    ``grads_finite`` (bool), ``loss_scale`` (the scale used this step),
    ``grad_norm`` (float32 global norm of the unscaled gradients), ``aux`` when
    ``has_aux`` and ``nonfinite`` when ``track_nonfinite``.

  Raises:
    TypeError: at trace time, if the loss is not a float scalar.

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
    scale = transform.loss_scale_of(state.opt_state)
    batch = policy_lib._cast_floating(batch, compute_dtype)
    float_params = tree_utils.floating_part(state.params)

    def scaled_loss(float_params):
      params = tree_utils.merge_floating(float_params, state.params)
      out = loss_fn(policy.cast_to_compute(params), batch)
      loss, aux = out if has_aux else (out, None)
      loss = _check_loss(loss, has_aux).astype(jnp.float32)
      return loss * scale, (loss, aux)

    grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(float_params)
    updates, opt_state = state.tx.update(grads, state.opt_state, float_params)
    new_float = optax.apply_updates(float_params, updates)
    scale_state = transform.find_loss_scale_state(opt_state)
    if scale_state is None:
      grads_finite = loss_scale.all_finite(grads)
      new_float, opt_state = loss_scale.select_tree(
          grads_finite, (new_float, opt_state), (float_params, state.opt_state)
      )
    else:
      grads_finite = scale_state.consecutive_skips == 0
    new_state = state.replace(
        step=state.step + 1,
        params=tree_utils.merge_floating(new_float, state.params),
        opt_state=opt_state,
    )
    inv_scale = 1.0 / scale
    metrics = {
        "loss": loss,
        "grads_finite": grads_finite,
        "loss_scale": scale,
        "grad_norm": optax.tree.norm(tree_utils.map_floating(lambda g: g * inv_scale, grads)),
    }
    if has_aux:
      metrics["aux"] = aux
    if track_nonfinite:
      metrics["nonfinite"] = jax.tree.map(
          lambda g, p: ~jnp.isfinite(g).all() if g is not None else jnp.zeros((), bool),
          grads,
          state.params,
          is_leaf=lambda x: x is None,
      )
    return new_state, metrics

  return jax.jit(step, donate_argnums=(0,) if donate else ())

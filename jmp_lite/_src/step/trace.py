"""Tracing a function as the train step calls it, for the diagnostics that read jaxprs.

:func:`precision_lint` and :func:`precision_report` both look at the jaxpr of
``fn(*args)`` as :func:`make_train_step` would run it: the first argument
(the params) cast by the policy (keep rules apply), the other arguments (the
batch) cast as the step casts its batch (``cast_batch``, ``batch_keep_full``;
a ``model_state`` passed on its own is never cast), optionally under
:func:`autocast` (FP8 included), and optionally differentiated as the step
differentiates it (:func:`step_stages.scaled_gradient`, so the backward pass
is ``grad(autocast(fn))``, never ``autocast(grad(fn))``). Only traced leaves
(arrays and ``jax.ShapeDtypeStruct``s, see ``filtering.py``) become jaxpr
inputs; static leaves (an Equinox module's activation function, a
``"split": "train"`` tag) are closed over.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp

from jmp_lite._src.autocast import autocast as autocast_lib
from jmp_lite._src import checks
from jmp_lite._src import filtering
from jmp_lite._src.fp8 import recipe as fp8_lib
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.step import stages as step_stages

PolicyLike = Union[policy_lib.Policy, str]

_FP8_MSG = "fp8={fp8!r} needs autocast=True: the FP8 matmuls are autocast's"
_GRAD_MSG = (
    "fn is jax.grad (or value_and_grad) of a function: under autocast that traces "
    "autocast(grad(fn)), while make_train_step runs grad(autocast(fn)); pass the loss "
    "itself with backward=True"
)
_GRAD_DOCS = ("Gradient of ", "Value and gradient of ")  # jax.grad's docstrings.


def as_policy(policy: PolicyLike) -> policy_lib.Policy:
  """``policy`` as a :class:`Policy` (a string goes through :func:`get_policy`)."""
  if isinstance(policy, str):
    policy = policy_lib.get_policy(policy)
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy or a policy string, got {policy!r}")
  return policy


@dataclasses.dataclass(frozen=True)
class AsStep:
  """How the diagnostics call ``fn``, as :func:`as_step` validated it.

  Attributes:
    fn: the function, unwrapped if it was made by :func:`autocast`.
    policy: casts the params (keep rules apply); ``None`` traces as given.
    batch_policy: casts the other arguments, or ``None`` (``cast_batch=False``).
    autocast: the :func:`autocast` the step would wrap ``fn`` in (its dtype,
      lists and FP8 recipe), or ``None``.
    backward: trace the step's gradient, not only the forward pass.
    has_aux: ``fn`` returns ``(loss, aux)`` (read with ``backward``).
  """

  fn: Callable[..., Any]
  policy: Union[policy_lib.Policy, None]
  batch_policy: Union[policy_lib.Policy, None]
  autocast: Union[autocast_lib.AutocastCall, None]
  backward: bool = False
  has_aux: bool = False


def autocast_call(fn: Any) -> Union[autocast_lib.AutocastCall, None]:
  """What ``fn`` runs if :func:`autocast` made it (or ``jax.jit`` of it), else ``None``.

  ``functools.wraps`` and ``jax.grad`` copy a function's attributes, so the
  record counts only on the function whose ``__wrapped__`` is the record's own;
  ``jax.jit`` (a function with ``lower``) computes what it wraps, and is looked through.
  """
  while hasattr(fn, "lower") and getattr(fn, "__wrapped__", None) is not None:
    fn = fn.__wrapped__
  record = getattr(fn, "_jmp_autocast", None)
  if isinstance(record, autocast_lib.AutocastCall) and getattr(fn, "__wrapped__", None) is record.fun:
    return record
  return None


def _is_grad(fn: Any) -> bool:
  """Whether ``fn`` is ``jax.grad``/``jax.value_and_grad`` of a function (read from JAX's doc)."""
  doc = getattr(fn, "__doc__", None)
  return (getattr(fn, "__wrapped__", None) is not None and isinstance(doc, str)
          and doc.startswith(_GRAD_DOCS))


def as_step(
    fn: Callable[..., Any],
    policy: Union[PolicyLike, None],
    *,
    autocast: bool = False,
    fp8: Union[bool, fp8_lib.Float8Recipe, None] = None,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
    backward: bool = False,
    has_aux: bool = False,
) -> AsStep:
  """Validates the diagnostics' step options as :func:`make_train_step` validates its own.

  A function made by :func:`autocast` is traced as with ``autocast=True``,
  with its own dtype, lists and recipe.

  Raises:
    TypeError: ``fn`` is not callable, ``policy`` is not a policy, a flag is
      not a bool, or ``fp8`` is not ``None``, a bool or a :class:`Float8Recipe`.
    ValueError: ``autocast``, ``fp8`` or ``batch_keep_full`` without what they
      need (a policy, ``autocast=True``, a half compute dtype), ``fp8`` other
      than the recipe of an autocast ``fn``, or ``autocast=True`` on ``jax.grad(fn)``.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  policy = None if policy is None else as_policy(policy)
  autocast = checks.boolean("autocast", autocast)
  recipe = fp8_lib.as_recipe(fp8)
  flags = {name: checks.boolean(name, value) for name, value in
           (("cast_batch", cast_batch), ("backward", backward), ("has_aux", has_aux))}
  made = autocast_call(fn)
  if made is not None:
    if recipe is not None and recipe != made.fp8:
      raise ValueError(f"fn was made by jmp.autocast with fp8={made.fp8!r}; got fp8={fp8!r}")
  elif autocast:
    if policy is None:
      raise ValueError("autocast=True needs a policy: its compute dtype is the autocast dtype")
    if _is_grad(fn):
      raise ValueError(_GRAD_MSG)
    made = autocast_call(autocast_lib.step_autocast(fn, policy.compute_dtype, recipe))
  elif recipe is not None:
    raise ValueError(_FP8_MSG.format(fp8=fp8))
  if policy is None and batch_keep_full:
    raise ValueError(f"batch_keep_full={batch_keep_full!r} needs a policy: nothing is cast without one")
  batch_policy = None
  if policy is not None and flags["cast_batch"]:
    batch_policy = policy_lib.Policy(policy.param_dtype, policy.compute_dtype,
                                     policy.output_dtype, keep_full=batch_keep_full)
  return AsStep(made.fun if made is not None else fn, policy, batch_policy, made,
                flags["backward"], flags["has_aux"])


class Traced(NamedTuple):
  """A traced function: its jaxpr and what each input of the jaxpr is.

  Attributes:
    jaxpr: the ``jax.extend.core.Jaxpr`` (open); its outputs are the traced
      leaves of the output (the forward pass), or of the step's gradients,
      loss, model state and aux (``backward``).
    roles: per jaxpr input, ``"state"`` (model state), ``"param"`` (the first
      argument), ``"batch"`` (the other arguments) or ``"scale"`` (the loss scale).
  """

  jaxpr: Any
  roles: tuple[str, ...]


def trace(step: AsStep, args: tuple[Any, ...], model_state: Any = None) -> Traced:
  """The jaxpr of ``step.fn(*args)`` as the train step would run it.

  Args:
    step: the validated options (:func:`as_step`).
    args: example arguments: arrays, ``jax.ShapeDtypeStruct``s and static leaves.
    model_state: if not ``None``, ``fn`` is called as
      ``fn(args[0], model_state, *args[1:])``, with ``model_state`` as it is
      (never cast), as the step calls ``loss_fn(params, model_state, batch)``.

  Returns:
    The :class:`Traced` jaxpr.
  """
  fn = step.fn
  if step.autocast is not None:
    fn = step.autocast.apply()
  parts = [filtering.partition(x) for x in (model_state, args[:1], args[1:])]
  counts = [sum(x is not None for x in traced) for traced, _ in parts]
  roles = ("state",) * counts[0] + ("param",) * counts[1] + ("batch",) * counts[2]
  traced = [x for p, _ in parts for x in p if x is not None]
  if step.backward:
    traced, roles = [*traced, jnp.ones((), jnp.float32)], (*roles, "scale")

  def call(*leaves: Any) -> Any:
    # Cast inside the trace, where arrays and ShapeDtypeStructs are both tracers.
    leaves_ = iter(leaves)
    state, params, batch = (
        filtering.combine([None if x is None else next(leaves_) for x in p], spec)
        for p, spec in parts)
    if step.policy is not None:
      params = tuple(step.policy.cast_to_compute(p) for p in params)
    if step.batch_policy is not None:
      batch = tuple(step.batch_policy.cast_to_compute(b) for b in batch)
    if step.backward:
      out = _scaled_gradient(step, fn, params, state, batch, model_state is not None, *leaves_)
    else:
      with_state = (*params, state) if model_state is not None else params
      out = fn(*with_state, *batch)
    return [x for x in jax.tree.leaves(out) if filtering.is_traced(x)]  # Static outputs dropped.

  return Traced(jax.make_jaxpr(call)(*traced).jaxpr, roles)


def _scaled_gradient(
    step: AsStep, fn: Callable[..., Any], params: tuple[Any, ...], state: Any,
    batch: tuple[Any, ...], with_state: bool, scale: jax.Array,
) -> Any:
  """The step's gradient stage (:func:`step_stages.scaled_gradient`) over ``fn``."""
  if not params:
    raise ValueError("backward=True needs the params as the first argument")
  loss_fn, one_batch = fn, batch[0] if len(batch) == 1 else batch
  if len(batch) != 1:  # The step's loss_fn takes one batch: pass the others as one.
    loss_fn = (lambda p, s, b: fn(p, s, *b)) if with_state else (lambda p, b: fn(p, *b))
  config = step_stages.StepConfig(
      loss_fn, step.policy or policy_lib.get_policy("float32"), has_aux=step.has_aux)
  inputs = step_stages.Inputs(params[0], params[0], state, one_batch)  # .trained: unused here
  return step_stages.scaled_gradient(config, inputs, scale)

"""Tracing a function as the train step calls it, for the diagnostics that read jaxprs.

:func:`precision_lint` and :func:`precision_report` both look at the jaxpr of
``fn(*args)`` as :func:`make_train_step` would run it: the first argument
(the params) cast by the policy (keep rules apply), floating leaves of the
other arguments cast to the compute dtype (a ``model_state`` passed on its
own is never cast, as in the step), optionally under
:func:`autocast`. Only traced leaves (arrays and ``jax.ShapeDtypeStruct``s,
see ``filtering.py``) become jaxpr inputs; static leaves (an Equinox
module's activation function, a ``"split": "train"`` tag) are closed over.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax

from jmp_lite._src import autocast as autocast_lib
from jmp_lite._src import checks
from jmp_lite._src import filtering
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree_utils

PolicyLike = Union[policy_lib.Policy, str]


def as_policy(policy: PolicyLike) -> policy_lib.Policy:
  """``policy`` as a :class:`Policy` (a string goes through :func:`get_policy`)."""
  if isinstance(policy, str):
    policy = policy_lib.get_policy(policy)
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy or a policy string, got {policy!r}")
  return policy


def trace(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    policy: Union[policy_lib.Policy, None],
    autocast: bool,
    model_state: Any = None,
    **autocast_options: Any,
) -> Any:
  """The jaxpr (open, with its outputs) of ``fn(*args)`` as the step would run it.

  Args:
    fn: the function, e.g. a loss ``loss_fn(params, batch)``.
    args: example arguments: arrays, ``jax.ShapeDtypeStruct``s and static leaves.
    policy: casts the arguments (see the module docstring); ``None`` traces
      ``fn`` on the arguments as they are.
    autocast: run ``fn`` under :func:`autocast` with the policy's compute dtype.
    model_state: if not ``None``, ``fn`` is called as
      ``fn(args[0], model_state, *args[1:])``, with ``model_state`` as it is
      (never cast), as the step calls ``loss_fn(params, model_state, batch)``.
    **autocast_options: more keyword arguments for :func:`autocast`.

  Returns:
    The ``jax.extend.core.Jaxpr``; its outputs are the traced leaves of
    ``fn``'s output, in ``jax.tree.leaves`` order.

  Raises:
    TypeError: if ``fn`` is not callable or ``autocast`` is not a bool.
    ValueError: if ``autocast`` is set without a half-precision policy.
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  if checks.boolean("autocast", autocast):
    if policy is None:
      raise ValueError("autocast=True needs a policy: its compute dtype is the autocast dtype")
    fn = autocast_lib.autocast(fn, policy.compute_dtype, **autocast_options)
  traced, spec = filtering.partition((model_state, args))

  def call(*leaves: Any) -> Any:
    # Cast inside the trace, where arrays and ShapeDtypeStructs are both tracers.
    state, a = filtering.combine(list(leaves), spec)
    if policy is not None and a:
      a = (policy.cast_to_compute(a[0]),
           *(tree_utils.cast_floating(x, policy.compute_dtype) for x in a[1:]))
    if model_state is not None:
      a = (a[0], state, *a[1:]) if a else (state,)
    out = jax.tree.leaves(fn(*a))
    return [x for x in out if filtering.is_traced(x)]  # Static outputs (a tag) are dropped.

  return jax.make_jaxpr(call)(*traced).jaxpr

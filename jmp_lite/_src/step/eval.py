"""Evaluation in the training precision: :func:`make_eval_step`.

The eval step runs ``fn`` as :func:`make_train_step` runs ``loss_fn``: the
params read through their float32 view and cast by the policy (keep rules
apply), the other arguments' floating leaves cast to the compute dtype as the
batch is, a model state passed as stored, and ``fn`` under the same
:func:`autocast`/FP8 rules; its output is cast to the policy's output dtype.
It shares the step's casting stage (:func:`step_stages.cast_parts`) and its
autocast wrapper (:func:`step.under_autocast`), so the two cannot drift.
"""

from __future__ import annotations

from typing import Any, Callable

from jmp_lite._src import checks
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.step import stages
from jmp_lite._src.fp8.recipe import Float8Recipe
from jmp_lite._src.step.make import check_fn_and_policy
from jmp_lite._src.step.make import under_autocast
from jmp_lite._src.step.call import FilteredJit


def make_eval_step(
    fn: Callable[..., Any],
    policy: policy_lib.Policy,
    *,
    autocast: bool = False,
    fp8: bool | Float8Recipe | None = False,
    model_state: bool = False,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
) -> Callable[..., Any]:
  """Builds ``eval_fn(params, *args)``: ``fn`` in the training precision, compiled.

  Each call::

    p_c = policy.cast_to_compute(float32 view of params)   # keep rules apply
    a_c = floating leaves of args cast to policy.compute_dtype   # batch_keep_full apply
    out = fn(p_c, *a_c)               # under autocast(fn, compute_dtype, fp8=fp8) if asked
    return policy.cast_to_output(out)

  That is what :func:`make_train_step` gives ``loss_fn``, with the same
  batch options (``cast_batch``, ``batch_keep_full``), so a model evaluates "as trained": under autocast its
  matmuls run in the compute dtype (or FP8) whatever the layers' ``dtype``
  fields say. The params are read, never changed or donated: the masters
  stay bit for bit as they were. Static leaves (an Equinox module's
  functions and Python fields, a ``train=False`` flag among the arguments)
  follow the step's rule: they are part of the compilation key and reach
  ``fn`` as the very same objects. The function compiles once per argument
  shapes and static leaves.

  Args:
    fn: ``fn(params, *args)``, or ``fn(params, model_state, *args)`` with
      ``model_state=True``; returns a pytree (logits, a metric dict...).
    policy: the training policy.
    autocast: run ``fn`` under :func:`autocast` with ``policy.compute_dtype``,
      as ``make_train_step(..., autocast=True)`` runs ``loss_fn``.
    fp8: ``True`` or a :class:`Float8Recipe`: autocast's matmuls in FP8, as
      ``make_train_step(..., fp8=...)``. Needs ``autocast=True``.
    model_state: the first argument after the params is a model state
      (BatchNorm statistics, NNX non-param variables): it reaches ``fn`` in
      its stored dtypes, never cast, as the train step passes
      ``state.model_state`` to ``loss_fn``.
    cast_batch: cast the floating leaves of ``args`` to
      ``policy.compute_dtype`` (default), as ``make_train_step``'s option of
      the same name casts the batch; ``False`` passes them as they are.
    batch_keep_full: keep rules for ``args`` (each argument's key paths, as
      the step's rules read its batch's): the leaves they select stay
      float32, as with ``make_train_step(..., batch_keep_full=...)``. A model
      trained with float16 targets past 65504 kept float32 evaluates with them
      kept too.

  Returns:
    ``eval_fn(params, *args)`` (``eval_fn(params, model_state, *args)``),
    returning ``fn``'s output with its floating leaves in
    ``policy.output_dtype``.

  Raises:
    TypeError: if ``fn`` is not callable, ``policy`` is not a :class:`Policy`,
      a flag is not a bool or ``fp8`` is not a bool or a recipe.
    ValueError: if ``fp8`` is set without ``autocast``, or ``autocast`` with a
      compute dtype that is not float16 or bfloat16.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def predict(params, x):
    ...   return x @ params["w"]
    >>> eval_fn = jmp.make_eval_step(predict, jmp.get_policy("mixed_bfloat16"))
    >>> params = {"w": jnp.full((3, 1), 0.1)}
    >>> out = eval_fn(params, jnp.ones((2, 3)))
    >>> out.dtype, out.shape, params["w"].dtype
    (dtype('float32'), (2, 1), dtype('float32'))
  """
  check_fn_and_policy("fn", fn, policy)
  with_state = checks.boolean("model_state", model_state)
  cast_batch = checks.boolean("cast_batch", cast_batch)
  inner = under_autocast(fn, policy, autocast, fp8)
  batch_policy = policy_lib.Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype,
                                   keep_full=batch_keep_full)
  config = stages.StepConfig(inner, policy, None)

  def evaluate(_: None, parts: tuple[Any, Any, tuple[Any, ...]]) -> Any:
    params, state, args = parts
    inputs = stages.cast_parts(config, params, state, args)
    # Each argument is cast as the step casts its one batch: rules read its own paths.
    batch = tuple(batch_policy.cast_to_compute(a) for a in args) if cast_batch else args
    before = (inputs.model_state,) if with_state else ()
    return policy.cast_to_output(inner(inputs.params, *before, *batch))

  jitted = FilteredJit(evaluate, donate=False)

  def eval_fn(params: Any, *args: Any) -> Any:
    if with_state and not args:
      raise TypeError("eval_fn(params, model_state, *args) needs the model state "
                      "(the eval step was built with model_state=True)")
    state, args = (args[0], args[1:]) if with_state else (None, args)
    return jitted(None, (params, state, args))

  return eval_fn

"""Why a function does not trace under a half policy: a float32 value meets a half one.

``lax.conv_general_dilated`` (an Equinox ``Conv2d``) and other ``lax``
primitives do not promote: float32 noise drawn inside a loss
(``jax.random.normal(key, shape)`` without a dtype), added to a half batch,
makes a float32 input for a half convolution, and tracing fails with "requires
arguments to have the same dtypes". :func:`precision_lint` and
:func:`precision_report` must explain that, not fail with it: the function is
traced again as the float32 program (nothing cast), where it traces, and
:mod:`provenance` finds the matmul or convolution whose operands the policy
would give different dtypes: one made float32 inside the function (a random
draw, a constant, a carry, the model state), the other cast to half (a param
or a batch leaf). The finding names that float32 value, the line that made
it, and the fixes: cast it, or use autocast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.diagnostics import provenance
from jmp_lite._src.step import trace as step_trace

# Causes that make a value float32 whatever the policy casts.
_BORN_WIDE = {
    "random": "a random draw made in float32 inside the function (no dtype given)",
    "made": "a float32 value made inside the function (jnp.zeros/ones/arange, a constant)",
    "carry": "a float32 loop carry made inside the function",
    "state": "a float32 model-state leaf (never cast)",
}
# The lax operations that do not promote, by the name their error gives them.
_OPS = {"conv_general_dilated": "conv_general_dilated", "dot_general": "dot_general",
        "select_n": "select"}
_SAME_DTYPES = "same dtype"  # lax's "requires arguments to have the same dtypes".
# The fix for a float32 operand, by its cause: the step never casts model state.
_FIXES = {
    "state": "The step keeps model state in the dtype it was stored in (never cast): build "
             "the step with autocast=True, which runs the {op} in one dtype, or use a layer "
             "that keeps its statistics apart from its output (eqx.nn.BatchNorm(..., "
             "mode=\"batch\"))",
}
_FIX = ("Cast it to {half} where it is made (jax.random.normal(key, shape, x.dtype), "
        ".astype(x.dtype)), or build the step with autocast=True, which casts it for the {op}")


class Mixed(NamedTuple):
  """A mixed-dtype failure, explained: the fields of a ``LintFinding``."""

  op: str
  reason: str
  source: Union[str, None]


def trace_or_explain(
    step: step_trace.AsStep, args: tuple[Any, ...], model_state: Any
) -> Union[step_trace.Traced, Mixed]:
  """:func:`step_trace.trace`, or a :class:`Mixed` where mixed dtypes made it fail."""
  try:
    return step_trace.trace(step, args, model_state)
  except TypeError as error:
    mixed = _explain(step, args, model_state, error)
    if mixed is None:
      raise
    return mixed


def trace_or_raise(
    step: step_trace.AsStep, args: tuple[Any, ...], model_state: Any
) -> step_trace.Traced:
  """:func:`step_trace.trace`; a mixed-dtype failure is a ``TypeError`` that explains it."""
  traced = trace_or_explain(step, args, model_state)
  if isinstance(traced, Mixed):
    raise TypeError(f"{traced.source or '<unknown source>'}: {traced.op}: {traced.reason}")
  return traced


def _explain(
    step: step_trace.AsStep, args: tuple[Any, ...], model_state: Any, error: TypeError
) -> Union[Mixed, None]:
  """The :class:`Mixed` behind ``error``, if it is a mixed-dtype failure of a policy's casts."""
  if step.policy is None or step.autocast is not None or _SAME_DTYPES not in str(error):
    return None
  as_given = dataclasses.replace(step, policy=None, batch_policy=None)
  try:
    traced = step_trace.trace(as_given, args, model_state)
  except Exception:  # Not a float32 program either: the error as raised.
    return None
  found: list[tuple[Any, Any, Any]] = []
  _search(traced.jaxpr, provenance.input_labels(traced.jaxpr, traced.roles), found)
  if not found:
    return None
  # The op the error names (lax.select, lax.conv_general_dilated), else the first.
  eqn, wide, origin = next((f for f in found if f"lax.{_OPS[f[0].primitive.name]} " in
                            str(error)), found[0])
  roots = jaxpr_utils.library_roots()
  half = np.dtype(step.policy.compute_dtype).name
  cause = provenance.ordered(wide & set(_BORN_WIDE))[0]
  where = jaxpr_utils.source_of(eqn, roots) or "<unknown source>"
  op = eqn.primitive.name
  reason = (
      f"mixes float32 and {half} operands, so the function does not trace under the "
      f"policy ({str(error).splitlines()[0]}). The float32 operand is "
      f"{_BORN_WIDE[cause]}, {'read' if cause == 'state' else 'made'} at this line; it meets a {half} param or batch value "
      f"at {where}. " + _FIXES.get(cause, _FIX).format(half=half, op=op))
  return Mixed(op, reason, jaxpr_utils.source_of(origin, roots) or where)


def _search(jaxpr: Any, inputs: list[provenance.Labels], found: list[tuple[Any, Any, Any]]
            ) -> list[provenance.Labels]:
  """Appends ``(eqn, float32 operand's labels, its origin eqn)`` of each mixed matmul/conv."""
  origins = provenance.Origins(jaxpr, inputs)
  producers: dict[Any, Any] = {}
  walk: Callable[[Any, list[provenance.Labels]], list[provenance.Labels]] = (
      lambda sub, labels: _search(sub, labels, found))
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _OPS:  # A select's data operands follow its predicate.
      data = eqn.invars[1:3] if eqn.primitive.name == "select_n" else eqn.invars[:2]
      labels = [origins.of(v) for v in data]
      wide = [bool(l & set(_BORN_WIDE)) for l in labels]
      if wide[0] != wide[1] and all(labels):  # One born float32, one cast to half.
        operand = data[wide.index(True)]
        found.append((eqn, labels[wide.index(True)], _origin(operand, producers, origins)))
    origins.step(eqn, walk)
    producers.update((v, eqn) for v in eqn.outvars)
  return origins.outputs(jaxpr)


def _origin(var: Any, producers: dict[Any, Any], origins: provenance.Origins) -> Any:
  """The equation that made ``var`` float32: back through producers while one is born wide."""
  eqn = None
  while var in producers:
    eqn = producers[var]
    wide = [v for v in eqn.invars if origins.of(v) & set(_BORN_WIDE)]
    if not wide:
      break
    var = wide[0]
  return eqn

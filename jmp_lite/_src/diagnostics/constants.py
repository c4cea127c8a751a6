"""The constants of a function that change value in a half dtype, for :func:`precision_lint`.

``x + 1e-8`` traced with a float16 ``x`` is ``x + 0.0``: the eps is gone
before any operation runs, and ``rsqrt(0 + 0.0)`` is inf. ``-1e9`` is
``-inf``, ``1 - 1e-7`` is ``1.0``. A lint of the program the policy runs sees
only the rounded values, so this module reads the float32 program (the
function traced on its float32 arguments) for its constants, and keeps those
that the half dtype changes (:func:`autocast_promote.fits`) and that the
policy's program rounds at the same source line: a half literal there, or one
that ``jnp.where``/``jnp.clip`` cast to the half operand's dtype. A library
that picks its sentinel by dtype (Flax's mask) or computes a statistic in
float32 (Flax's LayerNorm eps) is not named, nor a ``jnp.where``/``jnp.clip``
whose result is float32 (a layer pinned to float32): the policy's program
never rounds those.
"""

from __future__ import annotations

from typing import Any, Iterator, Union

import numpy as np

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.autocast import promote as rules

# How an operation reads in a finding: an infix symbol, or a function name.
_INFIX = {"add": "+", "add_any": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**",
          "rem": "%"}
_NAMES = {"select_n": "where", "clamp": "clip", "max": "maximum", "min": "minimum"}
# jnp functions that take a Python scalar as float32 and cast it to their other operand's dtype.
_CASTING_CALLS = frozenset({"_where", "where", "clip"})


def _literals(jaxpr: Any) -> Iterator[tuple[Any, int, Any]]:
  """``(eqn, position, value)`` of each floating literal operand, sub-jaxprs included."""
  for eqn in jaxpr_utils.walk(jaxpr):
    for i, v in enumerate(eqn.invars):
      if hasattr(v, "val") and jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v)):
        if np.ndim(v.val) == 0:
          yield eqn, i, v.val


def _rounded_there(eqn: Any, position: int) -> bool:
  """Whether the policy's program rounds this literal to half: it is half, or jnp casts it.

  ``x + 1e-8`` with a half ``x`` holds ``0.0:f16``; ``jnp.where`` and
  ``jnp.clip`` take a Python scalar as float32 and cast it to the other
  operand's dtype inside, when that dtype is half (or when the result is weakly
  typed, two Python scalars, and so takes the half dtype it meets). A float32 literal
  elsewhere (a statistic's eps that a library computes in float32,
  ``jax.random``'s bounds, ``finfo(float32).min`` masking an attention pinned
  to float32) stays float32.
  """
  if jaxpr_utils.dtype_of(eqn.invars[position]) in rules.HALVES:
    return True
  return (eqn.primitive.name == "jit" and eqn.params.get("name") in _CASTING_CALLS
          and any(jaxpr_utils.dtype_of(v) in rules.HALVES or _weak(v) for v in eqn.outvars))


def _weak(var: Any) -> bool:
  """A weakly typed result (``jnp.where(m, 0.0, -1e9)``): it takes the half dtype it meets."""
  return bool(getattr(getattr(var, "aval", None), "weak_type", False))


def _text(value: Any) -> str:
  """A constant as it was written (float32's shortest repr)."""
  return str(np.float32(value))


def _expression(eqn: Any, position: int, value: Any) -> str:
  """``... + 1e-08``: the operation with the constant in its place."""
  name = eqn.primitive.name
  text = _text(value)
  if name in _INFIX and len(eqn.invars) == 2:
    return f"{text} {_INFIX[name]} ..." if position == 0 else f"... {_INFIX[name]} {text}"
  label = eqn.params.get("name", name) if name in ("jit", "closed_call") else _NAMES.get(name, name)
  args = ["..."] * len(eqn.invars)
  args[position] = text
  return f"{label}({', '.join(args)})"


def _short(source: Union[str, None]) -> str:
  """``model.py:12`` of ``path/model.py:12 (fn)``."""
  if source is None:
    return "unknown source"
  return source.split(" (")[0].rsplit("/", 1)[-1]


def changed(float32_jaxpr: Any, policy_jaxpr: Any, dtype: np.dtype,
            roots: tuple[str, ...]) -> list[tuple[str, str, Union[str, None]]]:
  """The ``(op, reason, source)`` findings of the constants ``dtype`` changes.

  Args:
    float32_jaxpr: the function traced on float32 arguments.
    policy_jaxpr: the function traced as the policy runs it.
    dtype: the policy's half dtype.
    roots: the library roots (:func:`jaxpr_utils.library_roots`).

  Returns:
    One ``("constant", "1e-08 is 0.0 in float16: ... + 1e-08 (model.py:12)",
    source)`` per constant and source line, in program order.
  """
  held: dict[Union[str, None], set[float]] = {}
  for eqn, position, value in _literals(policy_jaxpr):
    if _rounded_there(eqn, position):
      held.setdefault(jaxpr_utils.source_of(eqn, roots), set()).add(float(value))
  found, seen = [], set()
  for eqn, position, value in _literals(float32_jaxpr):
    if rules.fits(value, dtype):
      continue
    source = jaxpr_utils.source_of(eqn, roots)
    with np.errstate(over="ignore"):  # -1e9 is -inf in float16: what the finding says.
      rounded = np.asarray(np.float32(value)).astype(dtype) if np.isfinite(value) else value
    there = held.get(source, set())
    if not there & {float(value), float(np.float32(value)), float(rounded)}:
      continue  # The policy's program writes another constant here (a dtype's own sentinel).
    key = (source, float(value))
    if key in seen:
      continue
    seen.add(key)
    reason = (f"{_text(value)} is {float(rounded)} in {dtype.name}: "
              f"{_expression(eqn, position, value)} ({_short(source)}); keep it in float32 "
              f"(autocast=True), or write a constant {dtype.name} holds")
    found.append(("constant", reason, source))
  return found

"""Validation of Python arguments, with messages that name the argument.

Every check runs on concrete values (Python and NumPy numbers, concrete jax
arrays) when an object is built; none of them inspects a traced value
(:func:`is_traced`).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import numpy as np

# The range of a usable loss scale. Gradients are unscaled by multiplying with
# ``1 / scale``: above 2**126 that reciprocal is a float32 subnormal, which XLA
# flushes to 0 (every gradient would unscale to 0); below 2**-126 it overflows
# to inf.
MAX_LOSS_SCALE = 2.0**126
MIN_LOSS_SCALE = 2.0**-126


def is_concrete_number(value: Any) -> bool:
  """True for Python and NumPy real numbers and concrete scalar arrays (not tracers)."""
  if isinstance(value, (bool, np.bool_)):
    return False
  if isinstance(value, (int, float, np.integer, np.floating)):
    return True
  try:
    return np.ndim(value) == 0 and np.isrealobj(np.asarray(value))
  except Exception:  # noqa: BLE001 - tracers and arbitrary objects.
    return False


def is_traced(value: Any) -> bool:
  """True for a tracer (a value inside ``jit``, ``grad``, ``vmap``...): it has no number yet."""
  return isinstance(value, jax.core.Tracer)


def short_repr(value: Any, limit: int = 80) -> str:
  """``repr(value)``, cut to ``limit`` characters (an optimizer state's repr runs to pages).

  Examples:
    >>> short_repr("x" * 100, limit=12)
    "'xxxxxxxx..."
  """
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: Any) -> str:
  """The module-qualified name of ``value``'s class, e.g. ``flax.training.train_state.TrainState``.

  Examples:
    >>> type_name(3)
    'int'
  """
  cls = type(value)
  module = cls.__module__
  return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def real_number(name: str, value: Any) -> float:
  """``value`` as a Python float; bools, strings and non-numbers are a ``TypeError``."""
  if isinstance(value, (bool, np.bool_, str, bytes)):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be a real number, got {value!r}") from e


def positive_finite(name: str, value: Any) -> float:
  """``value`` as a float that is finite and > 0, or a ``ValueError`` naming it."""
  number = real_number(name, value)
  if not (math.isfinite(number) and number > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value!r}")
  return number


def loss_scale(name: str, value: Any) -> float:
  """``value`` as a float in ``[2**-126, 2**126]``, the scales whose reciprocal is normal.

  Non-finite and non-positive values get :func:`positive_finite`'s message;
  finite ones outside the range say why they are refused.

  Examples:
    >>> loss_scale("init_scale", 2.0**126) == 2.0**126
    True
    >>> loss_scale("init_scale", 2.0**127)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: init_scale must be in [2**-126, 2**126] (about 1.2e-38 to 8.5e+37) so that ...
  """
  number = positive_finite(name, value)
  if not MIN_LOSS_SCALE <= number <= MAX_LOSS_SCALE:
    raise ValueError(
        f"{name} must be in [2**-126, 2**126] (about 1.2e-38 to 8.5e+37) so that 1/{name} is "
        "a normal float32 (XLA flushes a subnormal reciprocal to 0, which would unscale every "
        f"gradient to 0), got {value!r}"
    )
  return number


def integer(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
  """``value`` as an int in ``[minimum, maximum]``; floats such as 2.5 or 2.0 are refused."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
  try:
    number = operator.index(value)
  except TypeError as e:
    raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}") from e
  if number < minimum or (maximum is not None and number > maximum):
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
  return number


def boolean(name: str, value: Any) -> bool:
  """``value`` if it is a bool (Python or NumPy), else a ``TypeError`` naming it."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {value!r}")
  return bool(value)

"""Validation of Python arguments, with messages that name the argument.

Every check runs on concrete Python values when an object is built; none of
them inspects a traced value.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np


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

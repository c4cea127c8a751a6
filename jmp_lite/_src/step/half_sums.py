"""Sums by scatter in half precision, which the plain policy leaves to JAX.

``jnp.sum`` of a float16 or bfloat16 array accumulates in float32 by itself,
but a scatter-add (``jax.ops.segment_sum``, ``segment_mean``, ``x.at[i].add``,
graph networks' aggregations) accumulates in its operand's dtype: a float16
sum of 100,000 values of 8.0 stops at 16384. Autocast accumulates such sums in
float32; the plain policy does not rewrite ``loss_fn``, so at the step's first
call :func:`check` reads the traced program and warns (:class:`HalfSumWarning`)
for every scatter-sum that ``loss_fn`` itself runs in half, with its line.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.autocast import lists as autocast_lists

_HALF_ITEMSIZE = 2


class HalfSumWarning(UserWarning):
  """``loss_fn`` sums by scatter (``segment_sum``, ``.at[].add``) in half precision.

  :func:`make_train_step` warns once, at the first call, when a half policy
  without autocast runs such a sum: JAX accumulates it in its operand's dtype,
  so it stops growing at ``2**11`` (float16) or ``2**8`` (bfloat16) times its
  terms. Build the step with ``autocast=True`` (which accumulates it in
  float32) or scatter a float32 copy (``x.astype(jnp.float32)``).
  """


def message(name: str, dtype: Any) -> str:
  """Why a scatter-sum of ``dtype`` loses its sum, and the two ways out."""
  dtype = np.dtype(dtype)
  return (f"{name} (jax.ops.segment_sum, x.at[i].add) accumulates in {dtype.name}: a sum "
          f"stops growing at {2 ** (jnp.finfo(dtype).nmant + 1)} times its terms; build "
          "the step with autocast=True, or scatter a float32 copy (x.astype(jnp.float32))")


def half_sums(jaxpr: Any, scope: str) -> list[tuple[str, Any, Any]]:
  """``(primitive, dtype, source line)`` of the half scatter-sums ``loss_fn`` runs forward.

  The equations under ``scope`` (the named scope the step runs ``loss_fn``
  in), less the backward pass's (an embedding's gradient is a scatter-add of
  the cotangents, which JAX writes, not the user).
  """
  found = []
  for eqn in jaxpr_utils.walk(jaxpr):
    stack = str(eqn.source_info.name_stack)
    if (eqn.primitive.name in autocast_lists.SCATTER_SUMS and scope in stack
        and "transpose" not in stack):
      dtype = jaxpr_utils.dtype_of(eqn.outvars[0])
      if jaxpr_utils.is_floating(dtype) and dtype.itemsize <= _HALF_ITEMSIZE:  # type: ignore[union-attr]
        found.append((eqn.primitive.name, dtype, jaxpr_utils.source_of(eqn, jaxpr_utils.LIBRARIES)))
  return found


def check(jaxpr: Any, scope: str) -> None:
  """Warns (:class:`HalfSumWarning`) for each half scatter-sum of ``loss_fn`` in ``jaxpr``."""
  for name, dtype, line in dict.fromkeys(half_sums(jaxpr, scope)):
    warnings.warn(f"{message(name, dtype)} (at {line})", HalfSumWarning, stacklevel=5)

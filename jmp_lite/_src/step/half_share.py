"""The share of a step's matmul FLOPs that ran in half, and the warning when it is too small.

A policy casts params and inputs; a model whose layers cast back to float32
(a config's ``dtype=jnp.float32``, as flax's wmt example ships) runs every
matmul in float32 under ``mixed_float16``, and nothing in training shows it.
The step traces its program anyway: on its first call :class:`TrainStep`
traces it (``jax.jit(...).trace``, which the call then reuses), and
:func:`check` counts the FLOPs of the matmuls (as autocast counts them:
:func:`autocast_lists.is_matmul`, not a norm's inner product) and
convolutions that ``loss_fn`` and its gradient run (the equations under :data:`LOSS_SCOPE`, a
``jax.named_scope`` that :func:`step_stages.scaled_gradient` opens), by
whether their operands are half (float16, bfloat16 or float8). Under a
tenth in half is a :class:`NothingInHalfWarning`, with its cause as
:func:`precision_lint` names it: the diagnostics register their cause finder
here (:func:`register_explainer`), since the step may not import them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping, Union

import numpy as np

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.autocast import lists as autocast_lists

# The named scope the step runs loss_fn (and so its gradient) in.
LOSS_SCOPE = "jmp_loss_fn"
# Below this share of matmul FLOPs in half, the step warns.
MIN_HALF_SHARE = 0.1
_HALF_ITEMSIZE = 2  # float16, bfloat16 and the float8 formats.
_MSG = (
    "the policy computes in {dtype}, but {half:.0%} of the step's matmul and convolution "
    "FLOPs ({n_half} of {n} operations, forward and backward) run in half precision; the "
    "rest run in float32, so the half policy saves nothing there. {cause}Check with "
    "jmp.precision_report(loss_fn, params, batch, policy=policy, backward=True). If float32 "
    "is intended, build the step with make_train_step(..., warn_no_half=False), or filter "
    "jmp.NothingInHalfWarning."
)
_NO_CAUSE = "precision_lint(loss_fn, params, batch, policy=policy) names the cause. "

# (loss_fn, policy, params, model_state, batch, step options) -> the cause, or None; set by
# the diagnostics (lint).
Explainer = Callable[[Callable[..., Any], Any, Any, Any, Any, Mapping[str, Any]],
                     Union[str, None]]
_EXPLAINERS: list[Explainer] = []


class NothingInHalfWarning(UserWarning):
  """A half policy (or autocast) under which the step runs almost no matmul in half.

  :func:`make_train_step` warns once, at the step's first call, when under a
  tenth of the FLOPs of the matmuls and convolutions of ``loss_fn`` and its
  gradient run in float16, bfloat16 or float8 while the policy computes in
  half: a model whose layers pin ``dtype=jnp.float32`` (flax's wmt example as
  shipped), or that casts its inputs to float32. The message names the cause
  as :func:`precision_lint` does. Pass ``warn_no_half=False`` to
  :func:`make_train_step` where float32 is intended, or filter it with
  ``warnings.filterwarnings("ignore", category=jmp.NothingInHalfWarning)``.
  """


def register_explainer(explainer: Explainer) -> None:
  """Sets the function that names why a step's matmuls run in float32 (the lint's)."""
  _EXPLAINERS[:] = [explainer]


def _flops(eqn: Any) -> int:
  """The multiply-adds of a ``dot_general`` or convolution, times 2."""
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "dot_general":
    (_, rhs_c), (_, rhs_b) = eqn.params["dimension_numbers"]
    free = math.prod(rhs[i] for i in range(len(rhs)) if i not in rhs_c and i not in rhs_b)
    return 2 * math.prod(lhs) * free
  out = eqn.outvars[0].aval.shape
  channels = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
  return 2 * math.prod(out) * (math.prod(rhs) // max(channels, 1))


def _is_product(eqn: Any) -> bool:
  """A convolution, or a ``dot_general`` that autocast counts as a matmul (not a norm)."""
  name = eqn.primitive.name
  return name == "conv_general_dilated" or (name == "dot_general"
                                            and autocast_lists.is_matmul(eqn))


def matmul_flops(jaxpr: Any, inside: bool = False, times: int = 1) -> tuple[int, int, int, int]:
  """``(half FLOPs, all FLOPs, half ops, all ops)`` of the matmuls under :data:`LOSS_SCOPE`.

  A scan body counts ``length`` times; other sub-jaxprs once.
  """
  half = total = n_half = n = 0
  for eqn in jaxpr.eqns:
    here = inside or LOSS_SCOPE in str(eqn.source_info.name_stack)
    name = eqn.primitive.name
    if here and _is_product(eqn):
      dtypes = [jaxpr_utils.dtype_of(v) for v in eqn.invars[:2]]
      if all(jaxpr_utils.is_floating(d) for d in dtypes):
        flops = _flops(eqn) * times
        is_half = all(d.itemsize <= _HALF_ITEMSIZE for d in dtypes)  # type: ignore[union-attr]
        total, n = total + flops, n + 1
        half, n_half = half + flops * is_half, n_half + is_half
    repeat = times * (eqn.params["length"] if name == "scan" else 1)
    for sub in jaxpr_utils.subjaxprs(eqn):
      counts = matmul_flops(sub, here, repeat)
      half, total, n_half, n = (a + b for a, b in zip((half, total, n_half, n), counts))
  return half, total, n_half, n


def check(jaxpr: Any, state: Any, batch: Any, *, loss_fn: Callable[..., Any], policy: Any,
          autocast: bool, options: Mapping[str, Any]) -> None:
  """Warns (:class:`NothingInHalfWarning`) when ``jaxpr`` runs under a tenth of its matmul FLOPs in half.

  ``jaxpr`` is the traced step; nothing is said when the policy computes in
  float32 (without autocast) or the loss runs no matmul. ``options`` are
  the step's ``cast_batch`` and ``batch_keep_full``, for the cause finder.
  """
  dtype = np.dtype(policy.compute_dtype)
  if not autocast and dtype.itemsize > _HALF_ITEMSIZE:
    return
  half, total, n_half, n = matmul_flops(jaxpr)
  if total == 0 or half >= MIN_HALF_SHARE * total:
    return
  cause = None
  for explain in _EXPLAINERS:
    try:
      cause = explain(loss_fn, policy, state.params, state.model_state, batch, options)
    except Exception:  # pylint: disable=broad-except  # A cause is a courtesy.
      cause = None
  found = f"precision_lint names the cause: {cause}. " if cause else _NO_CAUSE
  warnings.warn(_MSG.format(dtype=dtype.name, half=half / total, n_half=n_half, n=n,
                            cause=found), NothingInHalfWarning, stacklevel=5)

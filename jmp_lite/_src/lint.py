"""Precision lint: the operations of a function that are risky in half precision."""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Union

import numpy as np
import jax.numpy as jnp

from jmp_lite._src import jaxpr_utils
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import precision_report
from jmp_lite._src import step_trace

_F16 = np.dtype(jnp.float16)
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_REDUCTIONS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
_F16_ELEMENTWISE = {
    "exp": "exp overflows float16 for inputs above 11.1",
    "exp2": "exp2 overflows float16 for inputs of 16 and above",
    "expm1": "expm1 overflows float16 for inputs above 11.1",
    "log": "log of a float16 value: inputs below 6e-8 flush to 0 and give -inf",
    "log1p": "log1p of a float16 value: 11-bit precision near 0",
}
# Ops a value passes through unchanged in kind, when following data flow.
_SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
                        "convert_element_type"})
_SCALE_OPS = _SHAPE_OPS | {"div", "mul"}


class LintFinding(NamedTuple):
  """One risky operation found by :func:`precision_lint`.

  Attributes:
    op: the primitive (``"dot_general"``, ``"exp"``, ...), ``"softmax/logsumexp"``
      for an exp followed by a sum, or ``"loss"`` for the output.
    reason: what is risky and what to do.
    source: ``"file:line (function)"`` of the user code that emitted it, or
      ``None`` if unknown.
  """

  op: str
  reason: str
  source: Union[str, None]

  def __str__(self) -> str:
    return f"{self.source or '<unknown source>'}: {self.op}: {self.reason}"


def _to_f16(eqn: Any) -> bool:
  return (eqn.primitive.name == "convert_element_type"
          and np.dtype(eqn.params["new_dtype"]) == _F16)


class _Context(NamedTuple):
  """What every level of the walk needs: source roots, the compute dtype, autocast."""

  roots: tuple[str, ...]
  compute: np.dtype
  autocast: bool


def _gemm_dims(eqn: Any) -> dict[str, int]:
  """The GEMM dimensions of a dot or conv that hardware alignment applies to."""
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "dot_general":
    (lhs_c, rhs_c), (_, rhs_b) = eqn.params["dimension_numbers"]
    return {
        "contracting size": math.prod(lhs[i] for i in lhs_c),
        "output features": math.prod(
            rhs[i] for i in range(len(rhs)) if i not in rhs_c and i not in rhs_b),
    }
  spec = eqn.params["dimension_numbers"]
  return {"input channels": lhs[spec.lhs_spec[1]], "output channels": rhs[spec.rhs_spec[0]]}


def _alignment(eqn: Any, dtype: str) -> Union[str, None]:
  """Names the GEMM dims of a half (multiple of 8) or float8 (16) dot/conv that miss it."""
  fp8 = dtype.startswith("float8")
  multiple = 16 if fp8 else 8
  bad = [f"{name} {size}" for name, size in _gemm_dims(eqn).items()
         if size > 1 and size % multiple]
  if not bad:
    return None
  if fp8:
    return (f"{' and '.join(bad)} not a multiple of 16 in an FP8 matmul ({dtype}): "
            "cuBLASLt's FP8 GEMMs need multiples of 16 (pad the layer)")
  return (f"{' and '.join(bad)} not a multiple of 8 in {dtype}: "
          "tensor cores need multiples of 8 (pad the layer)")


def _pinned(eqn: Any, dtype: str, compute: np.dtype) -> Union[str, None]:
  """Why a float32 matmul/conv under a half policy is a finding, if it is one."""
  if compute not in _HALF or dtype != "float32":
    return None
  return (f"runs in float32 although the policy computes in {compute.name}: a layer pins "
          "its dtype (a Flax/Equinox layer built with dtype=float32 or None, or an "
          "x.astype(float32) before it); build the step with autocast=True, or set the "
          f"layer's dtype to {compute.name}")


def _lint_jaxpr(
    jaxpr: Any, ctx: _Context, findings: list[LintFinding], outer: Union[str, None]
) -> None:
  """Appends the findings of ``jaxpr``; ``outer`` is the source of the eqn holding it."""
  def source(eqn: Any) -> Union[str, None]:
    return jaxpr_utils.source_of(eqn, ctx.roots) or outer  # Sub-jaxprs may lack tracebacks.

  readers = jaxpr_utils.consumers(jaxpr)
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  explained: set[int] = set()  # Sums and logs already reported as part of a softmax.
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    in_dtype = jaxpr_utils.dtype_of(eqn.invars[0]) if eqn.invars else None
    if name == "exp" and in_dtype == _F16 and _softmax(eqn, readers, explained):
      findings.append(LintFinding(
          "softmax/logsumexp",
          "exp and its sum computed in float16: exp overflows above 11.1 and the result "
          "has 11 bits; cast the logits to float32 first",
          source(eqn)))
    elif id(eqn) in explained:
      pass
    elif name in _F16_ELEMENTWISE and in_dtype == _F16:
      findings.append(LintFinding(name, _F16_ELEMENTWISE[name], source(eqn)))
    elif name in _REDUCTIONS:
      reason = _reduction(eqn, in_dtype, readers, ctx)
      if reason:
        findings.append(LintFinding(name, reason, source(eqn)))
    elif name in ("dot_general", "conv_general_dilated"):
      dtype = precision_report.matmul_dtype(eqn, producers)
      for reason in (_pinned(eqn, dtype, ctx.compute), _alignment(eqn, dtype)):
        if reason and (dtype != "float32" or reason.startswith("runs")):
          findings.append(LintFinding(name, reason, source(eqn)))
    for sub in jaxpr_utils.subjaxprs(eqn):
      _lint_jaxpr(sub, ctx, findings, source(eqn))


def _softmax(eqn: Any, readers: Any, explained: set[int]) -> bool:
  """Whether a float16 exp is summed (softmax/logsumexp); marks the sum and log explained."""
  sums = jaxpr_utils.reaches(eqn.outvars[0], readers, _SHAPE_OPS,
                             lambda e: e.primitive.name in _REDUCTIONS)
  explained.update(id(e) for e in sums)
  for e in sums:  # logsumexp's log of the sum.
    explained.update(id(log) for log in jaxpr_utils.reaches(
        e.outvars[0], readers, _SHAPE_OPS | {"abs"}, lambda e: e.primitive.name == "log"))
  return bool(sums)


def _reduction(eqn: Any, in_dtype: Any, readers: Any, ctx: _Context) -> Union[str, None]:
  name = eqn.primitive.name
  if in_dtype == _F16:
    return f"{name} accumulates in float16 (max 65504, 11-bit precision)"
  # Under autocast a float32 -> float16 convert of a computed value is kept wide;
  # the converts left are autocast's own casts of half-list (matmul) inputs.
  if not ctx.autocast and jaxpr_utils.reaches(eqn.outvars[0], readers, _SCALE_OPS, _to_f16):
    return (f"{name} of float16 data returns float16 (max 65504): "
            "reduce a float32 copy and keep the result in float32")
  return None


def precision_lint(
    fn: Callable[..., Any],
    *args: Any,
    policy: Union[policy_lib.Policy, str],
    autocast: bool = False,
    model_state: Any = None,
) -> list[LintFinding]:
  """Lists the operations of ``fn(*args)`` that are risky under ``policy``.

  The policy is applied as ``make_train_step`` applies it: ``args[0]`` (the
  params) is cast with ``policy.cast_to_compute``, keep rules included, and the
  floating leaves of every other argument (the batch) are cast to
  ``policy.compute_dtype``. The jaxpr of ``fn`` on those arguments
  (``jax.make_jaxpr``) is then read, sub-jaxprs (``jit``, ``custom_jvp``,
  ``scan``, ``cond``, ...) included. The rules:

  ========================================  ==========================  ===========
  finding                                   when                        dtypes
  ========================================  ==========================  ===========
  ``softmax/logsumexp``                     exp whose output is summed  f16
  ``exp`` ``exp2`` ``expm1`` ``log``        operand dtype               f16
  ``log1p``
  ``reduce_sum`` ``reduce_prod``            operand is f16, or the      f16
  ``cumsum`` ``cumprod`` ``cumlogsumexp``   result is cast back to f16
  ``dot_general``                           contracting size or output  f16, bf16
                                            features not a multiple
                                            of 8
  ``conv_general_dilated``                  input or output channels    f16, bf16
                                            not a multiple of 8
  ``dot_general`` (FP8)                     a GEMM dimension not a      float8
                                            multiple of 16
  ``dot_general`` ``conv_general_dilated``  runs in float32 while the   f32
                                            policy computes in half
  ``loss``                                  the first output is an f16  f16
                                            scalar
  ========================================  ==========================  ===========

  bfloat16 has float32's exponent range, so only the tensor-core alignment
  rule applies to it. ``jnp.sum``/``jnp.mean`` of an f16 array accumulate in
  float32 but return f16, which is what the "cast back" rule catches; a
  reduction that stays in float32 (Flax's normalisation statistics) is not
  flagged. Max/min reductions are exact and never flagged. Dimensions of size
  1 (matrix-vector products) are not flagged, nor is the row count of a
  matmul (the batch size). Each finding's source is the first stack frame
  outside jax, flax, optax, chex, equinox, haiku and jmp_lite (``None`` if
  this JAX release does not expose tracebacks).

  With ``autocast=True`` the function is linted as
  ``make_train_step(..., autocast=True)`` runs it: wrapped in
  :func:`autocast` with ``policy.compute_dtype``, after the casts above.
  Autocast runs exp, log and the reductions in float32 and keeps their
  results in float32, so the ``softmax/logsumexp``, ``exp``/``log`` and
  reduction findings go away (the float16 converts left are autocast's own
  casts of matmul inputs, which are not flagged); the alignment findings of
  its half-precision matmuls and convolutions stay, and the float32-matmul
  findings of a model that pins its dtype go (autocast runs every matmul in
  half).

  A matmul or convolution that runs in float32 under a half policy is a
  finding: a layer pinned its dtype (a Flax module built with
  ``dtype=jnp.float32``, or ``dtype=None`` after an ``x.astype(None)``,
  which is float32), and the step would silently train in float32. Use
  ``autocast=True`` or set the layer's dtype; :func:`precision_report`
  counts what runs in which dtype. A matmul on quantise-dequantised float8
  operands (``autocast(..., fp8=...)``) is an FP8 GEMM: its dimensions must
  be multiples of 16. Linting ``autocast(fn, dtype)`` itself gives
  the same findings.

  Args:
    fn: the function, typically ``loss_fn(params, batch)``.
    *args: example arguments: arrays, ``jax.ShapeDtypeStruct``s (same
      findings), PRNG keys and any other leaves ``fn`` accepts (functions,
      strings, an Equinox module's activation: static, passed through as
      they are, as in the train step).
    policy: a :class:`Policy` or a policy string for :func:`get_policy`.
    autocast: lint ``fn`` under :func:`autocast` (default ``False``).
    model_state: the state's model state (BatchNorm statistics), or ``None``.
      Given, ``fn`` is called as ``fn(args[0], model_state, *args[1:])`` and
      ``model_state`` is not cast, as the step calls
      ``loss_fn(params, model_state, batch)``.

  Returns:
    The findings, in program order.

  Raises:
    TypeError: if ``policy`` is neither a Policy nor a string, or
      ``autocast`` is not a bool.
    ValueError: if ``autocast`` is set and the policy's compute dtype is not
      float16 or bfloat16.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def loss_fn(params, x):
    ...   logits = x @ params["w"]
    ...   return -jnp.mean(jax.nn.log_softmax(logits)[:, 0])
    >>> params, x = {"w": jnp.ones((16, 100))}, jnp.ones((4, 16))
    >>> for finding in precision_lint(loss_fn, params, x, policy="mixed_float16"):
    ...   print(finding.op)
    dot_general
    softmax/logsumexp
    reduce_sum
    loss
    >>> [f.op for f in precision_lint(loss_fn, params, x, policy="mixed_bfloat16")]
    ['dot_general']
    >>> [f.op for f in precision_lint(loss_fn, params, x, policy="mixed_float16", autocast=True)]
    ['dot_general']
  """
  policy = step_trace.as_policy(policy)
  jaxpr = step_trace.trace(fn, args, policy, autocast, model_state)
  roots = jaxpr_utils.library_roots()
  findings: list[LintFinding] = []
  _lint_jaxpr(jaxpr, _Context(roots, np.dtype(policy.compute_dtype), autocast), findings, None)
  out = jaxpr.outvars[0] if jaxpr.outvars else None
  if out is not None and jaxpr_utils.dtype_of(out) == _F16 and out.aval.shape == ():
    producer = next((e for e in jaxpr.eqns if out in e.outvars), None)
    findings.append(LintFinding(
        "loss", "the loss is float16: cast it to float32 before reducing or scaling it",
        jaxpr_utils.source_of(producer, roots)))
  return findings

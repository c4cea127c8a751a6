"""Precision lint: the operations of a function that are risky in half precision."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from typing import Any, Callable, NamedTuple, Sequence, Union

import numpy as np
import jax
import jax.numpy as jnp

from jmp_lite._src import jaxpr_utils
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src.fp8 import recipe as fp8_lib
from jmp_lite._src.diagnostics import mixed_dtypes
from jmp_lite._src.diagnostics import constants
from jmp_lite._src.diagnostics.findings import PINNED as _PINNED
from jmp_lite._src.diagnostics.findings import LintFinding
from jmp_lite._src.diagnostics.findings import LintFindings
from jmp_lite._src.diagnostics import precision_report
from jmp_lite._src.diagnostics import provenance
from jmp_lite._src.step import half_share
from jmp_lite._src.step import half_sums
from jmp_lite._src.step import trace as step_trace

_F16 = np.dtype(jnp.float16)
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_REDUCTIONS = autocast_lists.ACCUMULATIONS
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


# Why a matmul runs in float32 under a half policy (provenance labels), and the fix.
_CAUSES = {
    "carry": "a float32 carry of a scan/while (its initial value is made in float32 inside "
             "the function: Flax's initialize_carry, jnp.zeros((hidden,)))",
    "random": "a random draw made in float32 inside the function "
              "(jax.random.normal(key, shape) without a dtype)",
    "made": "a float32 value made inside the function (jnp.zeros/ones/arange or "
            "jax.nn.one_hot without a dtype, a float32 constant)",
    "state": "a float32 model-state leaf (running statistics, which the step never casts)",
    "param": "a param that a keep rule keeps in float32",
    "batch": "a batch leaf passed in float32 (batch_keep_full or cast_batch=False)",
    "upcast": "a layer pins its dtype (a Flax/Equinox layer built with dtype=float32 or "
              "None, or an x.astype(float32) before it)",
}
_FIXES = {
    "carry": "build the carry in the compute dtype "
             "(jax.tree.map(lambda c: c.astype(x.dtype), cell.initialize_carry(...)), "
             "jnp.zeros(..., x.dtype))",
    "random": "draw in the compute dtype (jax.random.normal(key, shape, x.dtype))",
    "made": "make it in the compute dtype (jnp.zeros(shape, x.dtype))",
    "state": "cast the layer's output to {compute}",
    "param": "cast the kept layer's output to {compute}",
    "batch": "cast that batch leaf to {compute}",
    "upcast": "set the layer's dtype to {compute}",
}


# A float32 matmul's finding until its causes are ranked: this prefix, then its causes.
_PENDING = "\0pinned:"


def _pinned(
    eqn: Any, dtype: str, compute: np.dtype, origins: provenance.Origins
) -> Union[str, None]:
  """A float32 matmul/conv under a half policy: its pending reason (see :func:`_rank_causes`)."""
  if compute not in _HALF or dtype != "float32":
    return None
  if eqn.primitive.name == "dot_general" and not autocast_lists.is_matmul(eqn):
    return None  # An inner product or a weighted sum: a reduction, float32 by autocast's rule.
  causes = provenance.ordered(origins.cause(eqn.invars[:2])) or ["upcast"]
  if {"carry", "random"} & set(causes):  # Made inside the function, said more precisely.
    causes = [c for c in causes if c != "made"]
  return _PENDING + ",".join(causes)


def _rank_causes(findings: LintFindings, compute: np.dtype) -> LintFindings:
  """Writes each float32 matmul's reason, naming first the cause that explains the most.

  A cause's weight is the number of float32 matmuls and convolutions of the
  whole function it explains (ties in :data:`provenance.ORDER`), so that the
  cause behind most of them (a model whose config pins ``dtype=float32``)
  is named first, and alone the fix.
  """
  pending = {i: f.reason[len(_PENDING):].split(",") for i, f in enumerate(findings)
             if f.reason.startswith(_PENDING)}
  weight = collections.Counter(c for causes in pending.values() for c in causes)
  for i, causes in pending.items():
    causes = sorted(causes, key=lambda c: (-weight[c], provenance.ORDER.index(c)))
    also = "".join(f"; also {_CAUSES[c]}" for c in causes[1:])
    findings[i] = findings[i]._replace(reason=(
        f"{_PINNED} although the policy computes in {compute.name}: "
        f"{_CAUSES[causes[0]]}{also}; build the step with autocast=True, or "
        + _FIXES[causes[0]].format(compute=compute.name)))
  return findings


def _lint_jaxpr(
    jaxpr: Any, ctx: _Context, findings: list[LintFinding], outer: Union[str, None],
    inputs: Sequence[provenance.Labels], cached: bool = False,
) -> list[provenance.Labels]:
  """Appends the findings of ``jaxpr``; returns the labels of its outputs.

  ``outer`` is the source of the equation holding ``jaxpr``, ``inputs`` the
  provenance labels of its inputs; ``cached``: ``jaxpr`` is a jit's body.
  """
  def source(eqn: Any) -> Union[str, None]:
    # Sub-jaxprs may lack tracebacks, or only frames inside a library (a Flax scan body),
    # or the traceback of another call site that JAX traced the same body for first.
    own = jaxpr_utils.source_of(eqn, ctx.roots, fallback=outer is None)
    if own is None:
      return outer
    if (cached and outer is not None and not os.path.abspath(outer.rsplit(":", 1)[0]).startswith(ctx.roots)
        and outer not in jaxpr_utils.user_sources(eqn, ctx.roots)):
      return outer  # The user's call is not in this body's traceback: JAX traced it for another.
    return own

  readers = jaxpr_utils.consumers(jaxpr)
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  origins = provenance.Origins(jaxpr, inputs)
  explained: set[int] = set()  # Sums and logs already reported as part of a softmax.
  for eqn in jaxpr.eqns:
    for op, reason in _eqn_findings(eqn, ctx, readers, producers, origins, explained):
      findings.append(LintFinding(op, reason, source(eqn)))
    origins.step(eqn, functools.partial(_lint_sub, ctx, findings, source, eqn))
  return origins.outputs(jaxpr)


def _lint_sub(
    ctx: _Context, findings: list[LintFinding], source: Callable[[Any], Union[str, None]],
    eqn: Any, sub: Any, inputs: list[provenance.Labels],
) -> list[provenance.Labels]:
  """Lints ``sub``, a jaxpr of ``eqn``: its findings fall back to ``eqn``'s source."""
  # A jit's body is traced once per function and types, and JAX hands later callers
  # that jaxpr with its first caller's traceback.
  return _lint_jaxpr(sub, ctx, findings, source(eqn), inputs,
                     cached=eqn.primitive.name in ("jit", "pjit"))


def _eqn_findings(
    eqn: Any, ctx: _Context, readers: Any, producers: Any, origins: provenance.Origins,
    explained: set[int],
) -> list[tuple[str, str]]:
  """The ``(op, reason)`` findings of one equation."""
  name = eqn.primitive.name
  in_dtype = jaxpr_utils.dtype_of(eqn.invars[0]) if eqn.invars else None
  if name == "exp" and in_dtype == _F16 and _softmax(eqn, readers, explained):
    return [("softmax/logsumexp",
             "exp and its sum computed in float16: exp overflows above 11.1 and the result "
             "has 11 bits; cast the logits to float32 first")]
  if id(eqn) in explained:
    return []
  if name in _F16_ELEMENTWISE and in_dtype == _F16:
    return [(name, _F16_ELEMENTWISE[name])]
  if name in _REDUCTIONS:
    reason = _reduction(eqn, in_dtype, readers, producers, ctx)
    return [(name, reason)] if reason else []
  if name in ("dot_general", "conv_general_dilated"):
    dtype = precision_report.matmul_dtype(eqn, producers)
    reasons = (_pinned(eqn, dtype, ctx.compute, origins), _alignment(eqn, dtype))
    return [(name, r) for r in reasons
            if r and (dtype != "float32" or r.startswith(_PENDING))]
  return []


def _softmax(eqn: Any, readers: Any, explained: set[int]) -> bool:
  """Whether a float16 exp is summed (softmax/logsumexp); marks the sum and log explained."""
  sums = jaxpr_utils.reaches(eqn.outvars[0], readers, _SHAPE_OPS,
                             lambda e: e.primitive.name in _REDUCTIONS)
  explained.update(id(e) for e in sums)
  for e in sums:  # logsumexp's log of the sum.
    explained.update(id(log) for log in jaxpr_utils.reaches(
        e.outvars[0], readers, _SHAPE_OPS | {"abs"}, lambda e: e.primitive.name == "log"))
  return bool(sums)


def _widened_f16(var: Any, producers: Any) -> bool:
  """Whether ``var`` is float16 data widened for the reduction (``jnp.sum`` of float16)."""
  for _ in range(8):
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name not in _SHAPE_OPS:
      return False
    if jaxpr_utils.dtype_of(eqn.invars[0]) == _F16:
      return True
    var = eqn.invars[0]
  return False


def _reduction(
    eqn: Any, in_dtype: Any, readers: Any, producers: Any, ctx: _Context
) -> Union[str, None]:
  name = eqn.primitive.name
  if name in autocast_lists.SCATTER_SUMS and in_dtype in _HALF:  # JAX sums it in its dtype.
    return half_sums.message(name, in_dtype)
  if in_dtype == _F16:
    return f"{name} accumulates in float16 (max 65504, 11-bit precision)"
  # Under autocast a float32 -> float16 convert of a computed value is kept wide;
  # the converts left are autocast's own casts of half-list (matmul) inputs. A
  # sum of float32 data (a softmax of float32 logits) is not float16 data's.
  if (not ctx.autocast and _widened_f16(eqn.invars[0], producers)
      and jaxpr_utils.reaches(eqn.outvars[0], readers, _SCALE_OPS, _to_f16)):
    return (f"{name} of float16 data returns float16 (max 65504): "
            "reduce a float32 copy and keep the result in float32")
  return None


def precision_lint(
    fn: Callable[..., Any],
    *args: Any,
    policy: Union[policy_lib.Policy, str],
    autocast: bool = False,
    fp8: Union[bool, fp8_lib.Float8Recipe, None] = None,
    model_state: Any = None,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
) -> LintFindings:
  """Lists the operations of ``fn(*args)`` that are risky under ``policy``.

  The policy is applied as ``make_train_step`` applies it: ``args[0]`` (the
  params) is cast with ``policy.cast_to_compute``, keep rules included, and the
  floating leaves of every other argument (the batch) are cast to
  ``policy.compute_dtype`` unless ``cast_batch=False`` or a
  ``batch_keep_full`` rule keeps them (as the step's options of the same
  names do). The jaxpr of ``fn`` on those arguments
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
  ``scatter-add`` ``scatter-sub``           operand dtype               f16, bf16
  ``scatter-mul``                           (segment_sum, .at[].add)
  ``dot_general``                           contracting size or output  f16, bf16
                                            features not a multiple
                                            of 8
  ``conv_general_dilated``                  input or output channels    f16, bf16
                                            not a multiple of 8
  ``dot_general`` (FP8)                     a GEMM dimension not a      float8
                                            multiple of 16
  ``dot_general`` ``conv_general_dilated``  runs in float32 while the   f32
                                            policy computes in half
  ``constant``                              a literal the half dtype    f16, bf16
                                            changes (1e-8 to 0, -1e9
                                            to -inf, 1 - 1e-7 to 1)
  ``loss``                                  the first output is an f16  f16
                                            scalar
  ========================================  ==========================  ===========

  A ``constant`` finding names a literal of the float32 program (``fn``
  traced on its arguments as given) that the policy's half dtype changes, as
  ``1e-08 is 0.0 in float16: ... + 1e-08 (model.py:12)``: an eps that
  flushes to 0, a sentinel that overflows, a clip bound that rounds to 1
  (:func:`autocast` keeps each in float32). It is not reported with
  ``autocast=True``, nor where the policy's program writes another constant
  at that line (a library that picks its sentinel by dtype). bfloat16 has
  float32's exponent range, so only the alignment and ``constant`` rules
  apply to it. ``jnp.sum``/``jnp.mean`` of an f16 array accumulate in
  float32 but return f16, which is what the "cast back" rule catches; a
  reduction that stays in float32 (Flax's normalisation statistics) is not
  flagged. A scatter that adds or multiplies accumulates in its operand's
  dtype, bfloat16 too. Max/min reductions are exact and never flagged.
  Dimensions of size 1 (matrix-vector products) are not flagged, nor is the row count of a
  matmul (the batch size). Each finding's source is the first stack frame
  outside jax, flax, optax, chex, equinox, haiku and jmp_lite (``None`` if
  this JAX release does not expose tracebacks); inside a loop or call body
  with no such frame (a Flax ``nn.RNN`` cell), the line that called it.

  A matmul or convolution that runs in float32 under a half policy is a
  finding, and the lint names why its operands are float32, following the
  data flow back (:mod:`provenance`): a **float32 carry of a scan/while**
  (Flax's ``initialize_carry`` and ``jnp.zeros((hidden,))`` make float32
  carries, which promote every recurrent matmul), a random draw or another
  float32 value made inside the function, a float32 model-state leaf (NNX
  BatchNorm's statistics), a param or batch leaf kept in float32, or a layer
  that pins its dtype (``dtype=jnp.float32``, or ``dtype=None`` after an
  ``x.astype(None)``, which is float32). Each message names first the cause
  that explains the most float32 matmuls of the function, and its fix, and
  printed findings list those matmuls first; ``autocast=True`` fixes them all.

  With ``autocast=True`` the function is linted as
  ``make_train_step(..., autocast=True, fp8=fp8)`` runs it: wrapped in
  :func:`autocast` with ``policy.compute_dtype``, after the casts above.
  Autocast runs exp, log, the reductions and summing scatters in float32
  and keeps their results in float32, so the ``softmax/logsumexp``,
  ``exp``/``log``, reduction and scatter findings go away (the float16
  converts left are autocast's own casts of matmul inputs, which are not flagged); the alignment findings of
  its half-precision matmuls and convolutions stay, and the float32-matmul
  findings go (autocast runs every matmul in half). A matmul on
  quantise-dequantised float8 operands (``fp8=True``) is an FP8 GEMM: its
  dimensions must be multiples of 16. A function made by
  ``jmp.autocast(loss_fn, dtype, fp8=...)`` is linted as with
  ``autocast=True`` (its own dtype, lists and recipe): the findings are the
  same.

  The findings come back as a :class:`LintFindings` list; ``print`` it for
  one line per distinct finding, repeats grouped with a count.

  Args:
    fn: the function, typically ``loss_fn(params, batch)``.
    *args: example arguments: arrays, ``jax.ShapeDtypeStruct``s (same
      findings), PRNG keys and any other leaves ``fn`` accepts (functions,
      strings, an Equinox module's activation: static, passed through as
      they are, as in the train step).
    policy: a :class:`Policy` or a policy string for :func:`get_policy`.
    autocast: lint ``fn`` under :func:`autocast` (default ``False``).
    fp8: with ``autocast``, the FP8 recipe, as ``make_train_step``'s
      ``fp8=`` (``None``/``False``, ``True`` or a :class:`Float8Recipe`).
    model_state: the state's model state (BatchNorm statistics), or ``None``.
      Given, ``fn`` is called as ``fn(args[0], model_state, *args[1:])`` and
      ``model_state`` is not cast, as the step calls
      ``loss_fn(params, model_state, batch)``.
    cast_batch: cast the floating leaves of ``args[1:]`` (default), as the step.
    batch_keep_full: keep rules for ``args[1:]``, as the step's.

  Returns:
    The findings, in program order (a :class:`LintFindings`).

  Raises:
    TypeError: if ``policy`` is neither a Policy nor a string, a flag is not
      a bool, or ``fp8`` is not ``None``, a bool or a :class:`Float8Recipe`.
    ValueError: if ``autocast`` is set and the policy's compute dtype is not
      float16 or bfloat16, ``fp8`` is set without ``autocast``, or
      ``autocast`` is set on a ``jax.grad`` function.

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
  step = step_trace.as_step(fn, policy, autocast=autocast, fp8=fp8, cast_batch=cast_batch,
                            batch_keep_full=batch_keep_full)
  traced = mixed_dtypes.trace_or_explain(step, args, model_state)
  if isinstance(traced, mixed_dtypes.Mixed):  # It does not trace: say why.
    return LintFindings([LintFinding(*traced)])
  jaxpr = traced.jaxpr
  roots = jaxpr_utils.library_roots()
  findings = LintFindings()
  ctx = _Context(roots, np.dtype(policy.compute_dtype), step.autocast is not None)
  _lint_jaxpr(jaxpr, ctx, findings, None, provenance.input_labels(jaxpr, traced.roles))
  if step.autocast is None and ctx.compute in _HALF:  # Constants the half dtype changes.
    unpoliced = dataclasses.replace(step, policy=None, batch_policy=None)
    float32 = step_trace.trace(unpoliced, args, model_state).jaxpr
    findings.extend(LintFinding(*f) for f in constants.changed(float32, jaxpr, ctx.compute, roots))
  out = jaxpr.outvars[0] if jaxpr.outvars else None
  if out is not None and jaxpr_utils.dtype_of(out) == _F16 and out.aval.shape == ():
    producer = next((e for e in jaxpr.eqns if out in e.outvars), None)
    findings.append(LintFinding(
        "loss", "the loss is float16: cast it to float32 before reducing or scaling it",
        jaxpr_utils.source_of(producer, roots)))
  return _rank_causes(findings, ctx.compute)


def _step_cause(
    loss_fn: Callable[..., Any], policy: policy_lib.Policy, params: Any, model_state: Any,
    batch: Any, options: Any,
) -> Union[str, None]:
  """Why a step's matmuls run in float32, as its lint's most frequent float32 matmul says.

  The step's :class:`NothingInHalfWarning` names it (:mod:`half_share`);
  ``loss_fn`` is linted on the shapes of the step's arguments.
  """
  def shapes(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)

  found = precision_lint(loss_fn, shapes(params), shapes(batch), policy=policy,
                         model_state=shapes(model_state), **options)
  pinned = [f.reason for f in found if f.reason.startswith(_PINNED)]
  if not pinned:
    return None
  return collections.Counter(pinned).most_common(1)[0][0].split(": ", 1)[1]


half_share.register_explainer(_step_cause)

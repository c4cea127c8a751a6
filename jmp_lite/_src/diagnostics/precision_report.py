"""Precision report: which operations of a function ran in which dtype.

A policy casts params and inputs; it cannot see a layer that casts back to
float32 (a Flax module built with ``dtype=jnp.float32``, an
``x.astype(config.dtype)``). :func:`precision_report` reads the jaxpr the
step would run and counts each compute operation by class and dtype, so one
line confirms that a model computes in half.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Union

import numpy as np
import jax.numpy as jnp
from jax.extend import core as jex_core

from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src.diagnostics import mixed_dtypes
from jmp_lite._src.fp8 import recipe as fp8_lib
from jmp_lite._src import jaxpr_utils
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.step import trace as step_trace

# The classes, in table order, and the primitives in each. "norm stats" are
# reductions whose result reaches an rsqrt/sqrt/div (a mean and a variance
# feeding a normalisation); they are taken out of "reduction".
KINDS = ("matmul", "conv", "exp/log", "reduction", "norm stats", "other")
_MATMULS = frozenset({"dot_general", "ragged_dot_general"})
_CONVS = frozenset({"conv_general_dilated"})
_EXP_LOG = frozenset({"exp", "exp2", "expm1", "log", "log1p", "pow", "logistic",
                      "cumlogsumexp"})
# Sums, products (a summing scatter's too: jax.ops.segment_sum) and exact reductions.
_REDUCTIONS = frozenset({"reduce_max", "reduce_min", "cummax", "cummin", "argmax",
                         "argmin"}) | autocast_lists.ACCUMULATIONS
# Primitives that move or relabel data, compute nothing, and are not counted.
_MOVES = frozenset({
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "transpose", "rev", "slice", "dynamic_slice", "dynamic_update_slice", "gather",
    "concatenate", "pad", "split", "copy", "copy_p", "stop_gradient", "device_put",
    "sharding_constraint", "reshard", "optimization_barrier", "iota", "select_n",
    "squeeze", "pvary", "name", "reduce_precision",
})
_TO_NORM = frozenset({"rsqrt", "sqrt"})
_NORM_PATH = frozenset({"add", "sub", "mul", "div", "max", "integer_pow", "square",
                        "convert_element_type", "broadcast_in_dim", "reshape", "squeeze"})
# A float8 operand reaches a matmul through these (quantise-dequantise: convert to
# float8, convert back, multiply by the inverse scale).
_DEQUANT_PATH = frozenset({"convert_element_type", "mul", "broadcast_in_dim", "reshape",
                           "transpose", "squeeze"})


class PrecisionReport(NamedTuple):
  """What :func:`precision_report` counted: operations per class and dtype.

  Attributes:
    counts: ``{kind: {dtype name: number of operations}}`` for the kinds in
      ``KINDS`` order: ``"matmul"`` (``dot_general``), ``"conv"``,
      ``"exp/log"``, ``"reduction"`` (an inner product or a weighted sum
      of a few vectors, which autocast does not count as a matmul, is one, and
      so is a summing scatter: ``jax.ops.segment_sum``), ``"norm stats"`` (reductions feeding
      an ``rsqrt``/``sqrt``: means and variances of a normalisation) and
      ``"other"`` (every other floating computation). A matmul on
      quantise-dequantised float8 operands is counted under its float8
      format(s), e.g. ``"float8_e4m3fn"``. Every kind is a key, in that
      order; a kind with no operations maps to ``{}`` (``counts["conv"]`` of a
      model without convolutions). ``count(kind, dtype)`` reads one number,
      0 where none ran.
  """

  counts: Mapping[str, Mapping[str, int]]

  def count(self, kind: str, dtype: Any = None) -> int:
    """How many ``kind`` operations ran in ``dtype`` (a dtype or its name; all if None)."""
    if kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    per_dtype = self.counts.get(kind, {})
    if dtype is None:
      return sum(per_dtype.values())
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return per_dtype.get(name, 0)

  def table(self) -> str:
    """The counts as a short fixed-width table, one row per kind."""
    names = sorted({d for per in self.counts.values() for d in per}, key=_dtype_order)
    head = ["kind", *names, "total"]
    rows = [[k, *(str(self.counts.get(k, {}).get(d, 0)) for d in names),
             str(self.count(k))] for k in KINDS]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [head, *rows])

  def __str__(self) -> str:
    return self.table()


def _dtype_order(name: str) -> tuple[int, str]:
  bits = {"float8": 8, "bfloat16": 16, "float16": 16, "float32": 32, "float64": 64}
  return (next((b for p, b in bits.items() if name.startswith(p)), 99), name)


def _float8_source(var: Any, producers: Mapping[Any, Any]) -> Union[np.dtype, None]:
  """The float8 dtype a matmul operand was dequantised from, if it was."""
  frontier = [var]
  for _ in range(6):
    nxt = []
    for v in frontier:
      dtype = jaxpr_utils.dtype_of(v)
      if dtype is not None and dtype.itemsize == 1 and jaxpr_utils.is_floating(dtype):
        return dtype
      eqn = producers.get(v) if isinstance(v, jex_core.Var) else None
      if eqn is not None and eqn.primitive.name in _DEQUANT_PATH:
        nxt.extend(eqn.invars)
    frontier = nxt
  return None


def matmul_dtype(eqn: Any, producers: Mapping[Any, Any]) -> str:
  """The dtype name a matmul computes in: its operands', or their float8 formats."""
  formats = [_float8_source(v, producers) for v in eqn.invars[:2]]
  if all(f is not None for f in formats):
    return "+".join(sorted({np.dtype(f).name for f in formats}))
  return _in_dtype(eqn)


def _in_dtype(eqn: Any) -> str:
  dtypes = [jaxpr_utils.dtype_of(v) for v in eqn.invars]
  floats = [d for d in dtypes if jaxpr_utils.is_floating(d)]
  return np.dtype(jnp.result_type(*floats)).name if floats else ""


def _kind(eqn: Any, readers: Mapping[Any, list[Any]]) -> Union[str, None]:
  name = eqn.primitive.name
  if name in _MATMULS:  # An inner product or weighted sum is a reduction (autocast's rule).
    return "reduction" if name == "dot_general" and not autocast_lists.is_matmul(eqn) else "matmul"
  if name in _CONVS:
    return "conv"
  if name in _EXP_LOG:
    return "exp/log"
  if name in _REDUCTIONS:
    norm = jaxpr_utils.reaches(eqn.outvars[0], readers, _NORM_PATH,
                               lambda e: e.primitive.name in _TO_NORM, max_hops=10)
    return "norm stats" if norm else "reduction"
  if name in _MOVES or any(True for _ in jaxpr_utils.subjaxprs(eqn)):
    return None
  return "other"


def count_ops(jaxpr: Any, counts: dict[str, dict[str, int]]) -> None:
  """Adds the operations of ``jaxpr`` and its sub-jaxprs to ``counts``."""
  readers = jaxpr_utils.consumers(jaxpr)
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  for eqn in jaxpr.eqns:
    kind = _kind(eqn, readers)
    if kind == "matmul":  # Two float8 formats have no common dtype: named by both.
      dtype = matmul_dtype(eqn, producers)
    else:
      dtype = _in_dtype(eqn) if kind is not None else ""
    if dtype:
      per = counts.setdefault(kind, {})  # type: ignore[arg-type]  # kind is set here.
      per[dtype] = per.get(dtype, 0) + 1
    if kind is None:  # A counted operation's own jaxpr (a scatter's combiner) is not counted.
      for sub in jaxpr_utils.subjaxprs(eqn):
        count_ops(sub, counts)


def precision_report(
    fn: Callable[..., Any],
    *args: Any,
    policy: Union[policy_lib.Policy, str, None] = None,
    autocast: bool = False,
    fp8: Union[bool, fp8_lib.Float8Recipe, None] = None,
    model_state: Any = None,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
    backward: bool = False,
    has_aux: bool = False,
) -> PrecisionReport:
  """Counts the operations of ``fn(*args)`` by class and by the dtype they ran in.

  ``fn`` is traced (never run) as :func:`make_train_step` would call it:
  with a ``policy``, the first argument (the params) is cast by the policy
  and the floating leaves of the other arguments (the batch) to its compute
  dtype (unless ``cast_batch=False``; ``batch_keep_full`` rules keep leaves in
  float32, as the step's options of the same names); with ``autocast=True``,
  ``fn`` runs under :func:`autocast` (with ``fp8``: its FP8 matmuls, counted
  under their float8 formats). Every operation of the program is counted
  once, including those in nested ``jit``, ``scan`` and ``cond`` bodies (a
  loop body counts once, not per iteration); operations whose results reach
  no output are not, as XLA drops them (``jax.grad(fn)`` does not return the
  loss, so a last matmul that only the loss needs does not run). Data movement and converts are not
  counted. A function made by ``jmp.autocast(fn, dtype, fp8=...)`` is
  traced as with ``autocast=True``, with its own dtype, lists and recipe.

  ``backward=True`` counts the step's forward and backward pass: the
  gradient of ``float32(loss) * scale`` with respect to the params cast by
  the policy, through the very stage the step runs, so under autocast that
  is ``grad(autocast(fn))`` (each matmul's two backward matmuls run in the
  forward's dtype, FP8 ones on float8 operands). ``fn`` must then return the
  loss as the step's ``loss_fn`` does (``(loss, aux)`` with ``has_aux``,
  ``(loss, new_model_state)`` with a ``model_state``). Passing
  ``jax.grad(fn)`` with ``autocast=True`` is refused: it would count
  ``autocast(grad(fn))``, which the step never runs.

  Args:
    fn: the function, e.g. ``loss_fn(params, batch)`` or ``model.apply``.
    *args: example arguments: arrays, ``jax.ShapeDtypeStruct`` values (nothing
      is computed) and static leaves (an Equinox module's functions, strings).
    policy: a :class:`Policy` or policy string, or ``None`` (trace as given).
    autocast: trace ``fn`` under :func:`autocast` with the policy's compute dtype.
    fp8: with ``autocast``, the FP8 recipe, as ``make_train_step``'s ``fp8=``
      (``None``/``False``, ``True`` or a :class:`Float8Recipe`).
    model_state: the state's model state (BatchNorm statistics), or ``None``.
      Given, ``fn`` is called as ``fn(args[0], model_state, *args[1:])`` and
      ``model_state`` is not cast, as the step calls
      ``loss_fn(params, model_state, batch)``.
    cast_batch: cast the floating leaves of ``args[1:]`` (default), as the step.
    batch_keep_full: keep rules for ``args[1:]``, as the step's (needs a policy).
    backward: count the step's gradient computation too (see above).
    has_aux: with ``backward``, ``fn`` returns ``(loss, aux)``, as the step's.

  Returns:
    A :class:`PrecisionReport`; ``print`` it for a table.

  Raises:
    TypeError: if ``fn`` is not callable, ``policy`` is not a policy, a flag
      is not a bool, or ``fp8`` is not ``None``, a bool or a
      :class:`Float8Recipe`; with ``backward``, as the step raises for a
      ``loss_fn`` that does not return a float scalar loss; if ``fn`` does
      not trace under the policy because a float32 value made inside it
      meets a half matmul or convolution (the message names that value, its
      line and the fixes, as :func:`precision_lint`'s finding does).
    ValueError: if ``autocast`` or ``batch_keep_full`` is set without a
      policy, ``autocast`` with a compute dtype that is not half, ``fp8``
      without ``autocast``, or ``autocast`` on a ``jax.grad`` function.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def loss_fn(params, x):
    ...   h = jnp.tanh(x @ params["w1"])
    ...   h = h.astype(jnp.float32) @ params["w2"].astype(jnp.float32)  # pinned
    ...   return jnp.mean(jax.nn.log_softmax(h))
    >>> params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    >>> report = jmp.precision_report(loss_fn, params, jnp.ones((2, 8)), policy="mixed_float16")
    >>> report.count("matmul", jnp.float16), report.count("matmul", jnp.float32)
    (1, 1)
    >>> print(report.table().splitlines()[0])
    kind        float16  float32  total
    >>> both = jmp.precision_report(loss_fn, params, jnp.ones((2, 8)), policy="mixed_float16",
    ...                             autocast=True, backward=True)
    >>> both.count("matmul", jnp.float16), both.count("matmul", jnp.float32)  # 2 forward, 3 backward
    (5, 0)
  """
  step = step_trace.as_step(fn, policy, autocast=autocast, fp8=fp8, cast_batch=cast_batch,
                            batch_keep_full=batch_keep_full, backward=backward, has_aux=has_aux)
  jaxpr = jaxpr_utils.without_dead_code(mixed_dtypes.trace_or_raise(step, args, model_state).jaxpr)
  counts: dict[str, dict[str, int]] = {}
  count_ops(jaxpr, counts)
  return PrecisionReport({k: counts.get(k, {}) for k in KINDS})

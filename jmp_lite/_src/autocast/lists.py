"""The op lists of autocast: which primitives run in half, in float32, or promoted.

The three default tables (:data:`HALF_OPS`, :data:`FLOAT32_OPS`,
:data:`PROMOTE_OPS`) follow ``torch.autocast``'s lists, as the JAX primitives
torch's ops lower to; :class:`AutocastLists` holds a validated variant of
them. :data:`OWN_RULES` names the primitives that are in no list because
autocast decides them itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Sequence, Union

from jax import lax
from jax.extend import core as jex_core

from jmp_lite._src import jaxpr_utils

# torch's lower-precision (fp16) list: matmuls, convolutions and the ops built on
# them (linear, bmm, einsum, RNN cells, attention). In JAX all of these lower to
# these primitives. A dot_general that is no matrix product (see is_matmul) runs
# as traced instead, as torch's dot, vdot and tensordot do.
HALF_OPS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

# Accumulations: their result's range grows with the number of terms, and a half
# running sum stops growing at 2048 (bfloat16: 256) times its terms. Reductions
# (jnp.sum, jnp.mean, jnp.var, jnp.prod, jnp.cumsum, ...; jnp accumulates a half
# array's in float32 itself) and scatters that add or multiply into their operand
# (jax.ops.segment_sum, segment_prod, x.at[i].add: graph networks' aggregations,
# which JAX accumulates in the operand's dtype).
REDUCTIONS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
SCATTER_SUMS = frozenset({"scatter-add", "scatter-sub", "scatter-mul"})
ACCUMULATIONS = REDUCTIONS | SCATTER_SUMS

# torch's fp32 and fp32_set_opt_dtype lists, as the primitives their ops lower to:
# softmax, log_softmax, logsumexp, norms, variances and losses are built from
# these, so they run in float32 too.
FLOAT32_OPS = frozenset({
    # Pointwise ops that overflow or lose precision in half.
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "erf_inv", "acos", "asin", "cosh", "sinh", "tan",
}) | ACCUMULATIONS

# torch's promote list, widened to every primitive that computes in the dtype of
# its floating inputs: it runs in the widest floating dtype among them.
PROMOTE_OPS = frozenset({
    # Arithmetic and comparisons.
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min",
    "nextafter", "atan2", "clamp", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "is_finite", "floor", "ceil", "round",
    # Pointwise functions that are safe in half precision.
    "sqrt", "cbrt", "sin", "cos", "tanh", "atan", "acosh", "asinh", "atanh", "logistic",
    "erf", "erfc", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma",
    "zeta", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "reduce_precision",
    # Exact reductions, sorting and windows.
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin", "sort", "top_k",
    "approx_top_k", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    # Data movement.
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "split", "tile", "stack",
    "unstack", "copy", "stop_gradient", "zeros_like", "optimization_barrier",
    "device_put", "name",
    # Sharding and collectives (their operands keep their dtypes).
    "sharding_constraint", "reshard", "psum", "psum_invariant", "pmax", "pmin", "pvary",
    "pbroadcast", "all_gather", "all_gather_invariant", "all_to_all", "ppermute",
    "reduce_scatter",
})

# Primitives autocast has its own rule for, so that no list may hold them: the
# control-flow handlers of autocast_control (it recurses into their bodies) and
# convert_element_type (the interpreter decides it). The interpreter refuses to
# register a handler for a name missing here.
OWN_RULES = frozenset({
    "jit", "closed_call", "call", "remat2", "scan", "while", "cond", "custom_jvp_call",
    "custom_vjp_call", "shard_map", "convert_element_type",
})

# A contraction over fewer terms than this, one of whose operands is a vector of
# weights, is a weighted sum of a few vectors: a Runge-Kutta stage sum or error
# estimate (diffrax's tableaus have at most 14 stages), not a layer.
FEW_TERMS = 16


def contraction_sizes(eqn: Any) -> tuple[int, int, int]:
  """A ``dot_general``'s sizes ``(M, K, N)``: lhs free, contracting, rhs free (batch dims left out)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])

  def free(shape: Sequence[int], dims: set[int]) -> int:
    return math.prod(d for i, d in enumerate(shape) if i not in dims)

  return (free(lhs, {*lc, *lb}), math.prod(lhs[i] for i in lc), free(rhs, {*rc, *rb}))


def _asks_highest(eqn: Any) -> bool:
  """Whether the program asked for ``Precision.HIGHEST`` (full float32) on both operands."""
  p = eqn.params.get("precision")
  both = p if isinstance(p, tuple) else (p, p)
  return all(x == lax.Precision.HIGHEST for x in both)


def is_matmul(eqn: Any, constant: tuple[bool, bool] = (False, False)) -> bool:
  """Whether a ``dot_general`` is a matrix product, which autocast runs in half.

  Two contractions are not, and run in the dtypes of the traced program
  (float32 for a float32 program):

  * an inner product, where neither operand has a free dimension
    (``jnp.dot`` of two vectors, a norm's sum of squares, their batched forms
    under ``vmap``): a reduction, as torch's ``dot`` and ``vdot`` are;
  * a weighted sum of fewer than :data:`FEW_TERMS` vectors, where one operand
    is a vector of weights over the contracted dimension that is a constant
    or that the program contracts at ``Precision.HIGHEST`` (diffrax's
    ``vector_tree_dot`` of a tableau row and the stages asks for it).

  A solver's step-size control reads both. A layer (weights by a batch of
  activations) is a matrix product at any size, and so is one activation by
  a weight matrix (torch's ``mv``): ``vmap(autocast(f))`` and
  ``autocast(vmap(f))`` agree.

  Args:
    eqn: a ``dot_general`` equation (of the traced program or evaluated).
    constant: whether each operand is a constant of the program.

  Returns:
    ``True`` for a matrix product.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def dots(eqns):
    ...   return [is_matmul(e) for e in eqns if e.primitive.name == "dot_general"]
    >>> x, w, stages = jnp.ones((32, 64)), jnp.ones((64, 8)), jnp.ones((7, 64))
    >>> dots(jax.make_jaxpr(lambda x, w: (x @ w, x[0] @ w))(x, w).eqns)
    [True, True]
    >>> row_sum = lambda r, k: jnp.tensordot(r, k, axes=1, precision=jax.lax.Precision.HIGHEST)
    >>> dots(jax.make_jaxpr(row_sum)(jnp.ones(7), stages).eqns)
    [False]
    >>> dots(jax.make_jaxpr(jax.vmap(lambda v: jnp.dot(v, v)))(x).eqns)
    [False]
  """
  m, k, n = contraction_sizes(eqn)
  if m == 1 and n == 1:
    return False
  if min(m, n) > 1 or k >= FEW_TERMS:
    return True
  return not (constant[0 if m == 1 else 1] or _asks_highest(eqn))


_TARGETS = ("half", "float32", "promote", "original")

_LISTS_MSG = "{field} must be a collection of primitive names (or jax Primitives), got {value!r}"
_UNKNOWN_MSG = ("unknown primitive name(s) {names} for AutocastLists.{field}: not a primitive "
                "of JAX or of an imported library (e.g. 'exp', 'dot_general', 'reduce_sum')")
_OWN_MSG = ("{names} for AutocastLists.{field}: autocast has its own rule for it "
            "(it recurses into control flow, calls and custom derivatives, and decides "
            "convert_element_type itself)")
_OVERLAP_MSG = "primitive(s) {names} appear in both AutocastLists.{a} and AutocastLists.{b}"


def _as_names(field: str, value: Any) -> frozenset[str]:
  if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
    raise TypeError(_LISTS_MSG.format(field=field, value=value))
  names = set()
  for item in value:
    if isinstance(item, jex_core.Primitive):
      item = item.name
    if not isinstance(item, str):
      raise TypeError(_LISTS_MSG.format(field=field, value=value))
    names.add(item)
  return frozenset(names)


def _check_known(field: str, names: frozenset[str]) -> None:
  own = names & OWN_RULES
  if own:
    raise ValueError(_OWN_MSG.format(names=sorted(own), field=field))
  new = names - HALF_OPS - FLOAT32_OPS - PROMOTE_OPS
  if new:  # Only names beyond the defaults need the (slower) registry scan.
    unknown = new - jaxpr_utils.primitive_names()
    if unknown:
      raise ValueError(_UNKNOWN_MSG.format(names=sorted(unknown), field=field))


@dataclasses.dataclass(frozen=True)
class AutocastLists:
  """The op lists of :func:`autocast`: which primitives run in which precision.

  Every primitive (by its jaxpr name, ``jax.extend.core.Primitive.name``) is in
  at most one list:

  * ``half``: floating inputs are cast to the autocast dtype, and so is the
    output (by default ``dot_general``, ``conv_general_dilated``,
    ``ragged_dot_general``: matmuls and convolutions).
  * ``float32``: half inputs are cast to float32; the output is float32
    (by default exp, log, pow, rsqrt, sums, products, summing scatters, ...).
  * ``promote``: floating inputs are cast to the widest floating dtype among
    them, constants not counting unless they do not fit (by default every
    other primitive that computes in its inputs' dtype).
  * in none of them ("original"): the primitive runs in the dtypes of the
    traced program; inputs that autocast changed are cast back first. This is
    also what happens to primitives autocast does not know (callbacks,
    Pallas kernels, linear algebra, scatters that set or take a max, anything
    new).

  Build a variant with :meth:`move`. Unknown names are a ``ValueError``.

  Attributes:
    half: names of the half-list primitives.
    float32: names of the float32-list primitives.
    promote: names of the promote-list primitives.

  Examples:
    >>> import jmp_lite as jmp
    >>> lists = jmp.AutocastLists().move("tanh", "logistic", to="float32")
    >>> "tanh" in lists.float32, "tanh" in lists.promote
    (True, False)
    >>> lists.rule("dot_general"), lists.rule("pure_callback")
    ('half', 'original')
  """

  half: frozenset[str] = HALF_OPS
  float32: frozenset[str] = FLOAT32_OPS
  promote: frozenset[str] = PROMOTE_OPS

  def __post_init__(self) -> None:
    fields = ("half", "float32", "promote")
    for field in fields:
      object.__setattr__(self, field, _as_names(field, getattr(self, field)))
    for i, a in enumerate(fields):
      for b in fields[i + 1:]:
        both = getattr(self, a) & getattr(self, b)
        if both:
          raise ValueError(_OVERLAP_MSG.format(names=sorted(both), a=a, b=b))
    for field in fields:
      _check_known(field, getattr(self, field))

  def move(self, *names: Union[str, jex_core.Primitive], to: str) -> "AutocastLists":
    """A copy with ``names`` moved to list ``to`` (out of any other list).

    Args:
      *names: primitive names (``"tanh"``) or primitives (``jax.lax.tanh_p``).
      to: ``"half"``, ``"float32"``, ``"promote"``, or ``"original"`` (no list:
        run in the traced program's dtypes).

    Returns:
      The new lists.

    Raises:
      ValueError: if ``to`` is not one of those, or a name is not a known
        primitive or is one autocast has its own rule for.
      TypeError: if a name is not a string or primitive.
    """
    if to not in _TARGETS:
      raise ValueError(f"to must be one of {_TARGETS}, got {to!r}")
    moved = _as_names("names", names)
    _check_known(to, moved)
    lists = {f: getattr(self, f) - moved for f in ("half", "float32", "promote")}
    if to != "original":
      lists[to] = lists[to] | moved
    return AutocastLists(**lists)

  def rule(self, name: str) -> str:
    """``"half"``, ``"float32"``, ``"promote"`` or ``"original"`` for primitive ``name``."""
    return self._rules.get(name, "original")

  @functools.cached_property
  def _rules(self) -> dict[str, str]:
    return {n: f for f in ("half", "float32", "promote") for n in getattr(self, f)}

"""Autocast's dtype decisions: what each value is, and the dtype each operation runs in.

The interpreter keeps, next to each floating value, a :class:`Meta`: its
*kind* and how much data it carries (its *info*: its number of elements, or
fewer for a broadcast bias, scale or statistic). The kinds:

* ``HALF``: a half value (float16 or bfloat16), an activation if it carries
  as much data as the operation's output.
* ``DATA``: float32 the program holds on its own: float32 arguments
  (parameters, data, noise) and what is computed from them.
* ``STAT``: float32 from a reduction (a sum, a mean, a norm, a loss): its
  range grows with the number of elements, so it is never narrowed.
* ``WIDE``: float32 that autocast widened from half values element-wise
  (``exp(h)``, ``h**3``): the program had it in half.
* ``CONST``: a literal, a weakly typed Python scalar, or a value computed from
  constants only.

:func:`promote` decides a promote-list operation (see its docstring), and
:func:`float32_kind` the kind of a float32-list result.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple, Sequence, Union

import jax.numpy as jnp
import numpy as np

from jmp_lite._src.autocast import lists as autocast_lists


F32 = np.dtype(jnp.float32)
HALVES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

HALF, DATA, STAT, WIDE, CONST, OTHER = "half", "data", "stat", "wide", "const", "other"
# Among float32 values, which kind a result inherits when operands differ.
_PRIORITY = {STAT: 3, DATA: 2, WIDE: 1, CONST: 0}

# Float32-list operations whose result is a statistic (its range grows with the size).
REDUCTIONS = autocast_lists.ACCUMULATIONS

# Element-wise primitives: their result carries no more data than their operands
# (a product of a broadcast statistic and a broadcast scale is still small).
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min",
    "nextafter", "atan2", "clamp", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "is_finite", "floor", "ceil", "round", "sqrt", "cbrt", "sin", "cos", "tanh", "atan",
    "acosh", "asinh", "atanh", "logistic", "erf", "erfc", "lgamma", "digamma", "igamma",
    "igammac", "igamma_grad_a", "polygamma", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta", "reduce_precision", "stop_gradient", "copy", "pvary",
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt",
    "erf_inv", "acos", "asin", "cosh", "sinh", "tan",
})

# Element-wise operations whose result does not grow with a total's magnitude.
COMPRESSING = frozenset({"div", "rsqrt", "sqrt", "cbrt", "log", "log1p", "tanh", "logistic",
                         "erf", "atan", "sign"})

# Arithmetic: rounding its operands to half first is not the same as rounding its
# result, so with a float32 operand it computes in float32 and stores half.
ARITHMETIC = frozenset({"add", "add_any", "sub", "mul", "div", "rem", "atan2", "nextafter"})
# ...and so do comparisons (their result is not a float).
_EXACT_IN_F32 = ARITHMETIC | {"eq", "ne", "lt", "le", "gt", "ge"}


class Meta(NamedTuple):
  """What autocast knows of a value besides its dtype.

  Attributes:
    kind: ``HALF``, ``DATA``, ``STAT``, ``WIDE``, ``CONST`` or ``OTHER``.
    info: how many elements of data it carries (fewer than its size for a
      broadcast or an element-wise function of broadcasts).
    source: a token naming the activation it is an element-wise function
      of (``x`` for ``x**3``, ``x - mean`` or ``jnp.where(x > 0, x, 0.0)``);
      ``None`` for constants.
    total: for a ``STAT``, whether it is a raw total (a sum or product, its
      magnitude growing with the number of elements) rather than a
      normalised statistic (a mean, ``rsqrt(var + eps)``, a ``logsumexp``:
      it went through a division, a root or a log).
    unfit: for a ``CONST`` computed inside the function (``jnp.where(mask,
      0.0, -1e9)``, a mask times a sentinel), whether a constant it was made
      from changes value in the half dtype (see :func:`fits`).
  """

  kind: str
  info: int
  source: Any = None
  total: bool = False
  unfit: bool = False


_TOKENS = itertools.count()


def fresh() -> int:
  """A new source token."""
  return next(_TOKENS)


class Operand(NamedTuple):
  """One floating operand of an operation, as :func:`promote` sees it.

  Attributes:
    dtype: its dtype (the half dtype for a virtual value, see
      :mod:`autocast_regions`).
    meta: its :class:`Meta`.
    fits: for a constant, whether its value survives the half dtype
      (:func:`fits`; a computed constant's :attr:`Meta.unfit`).
    virtual: whether it is a half value still held in float32.
  """

  dtype: np.dtype
  meta: Meta
  fits: bool
  virtual: bool


class Decision(NamedTuple):
  """How an operation runs: ``compute`` dtype, and the half dtype it stores (``virtual``)."""

  compute: np.dtype
  virtual: Union[np.dtype, None]
  meta: Meta


def size(shape: Sequence[int]) -> int:
  return math.prod(shape)


def default_meta(dtype: Union[np.dtype, None], shape: Sequence[int], weak: bool = False) -> Meta:
  """The meta of a value autocast knows nothing more of (an argument, a loop's output)."""
  if dtype in HALVES:
    return Meta(HALF, size(shape), fresh())
  if dtype == F32:
    return Meta(CONST, size(shape)) if weak else Meta(DATA, size(shape), fresh())
  return Meta(OTHER, size(shape))


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
  out = dtypes[0]
  for d in dtypes[1:]:
    out = np.dtype(jnp.promote_types(out, d))
  return out


def _info(name: str, ops: Sequence[Operand], out_size: int) -> int:
  if name not in ELEMENTWISE:
    return out_size
  infos = [o.meta.info for o in ops if o.meta.kind != CONST]
  return min(out_size, max(infos, default=1))


def _source(ops: Sequence[Operand], out_size: int) -> int:
  """The one activation a result is an element-wise function of, or a new token."""
  full = {o.meta.source for o in ops if o.meta.kind != CONST and o.meta.info >= out_size}
  return full.pop() if len(full) == 1 and None not in full else fresh()


def _f32_kind(ops: Sequence[Operand], out_size: int) -> str:
  """The kind of a float32 result: from its full-size operands first, half ones count as WIDE."""
  nonconst = [o for o in ops if o.meta.kind != CONST]
  if not nonconst:
    return CONST
  full = [o for o in nonconst if o.meta.info >= out_size] or nonconst
  kinds = [WIDE if o.dtype in HALVES else o.meta.kind for o in full]
  return max(kinds, key=lambda k: _PRIORITY.get(k, 0))


def float32_kind(name: str, ops: Sequence[Operand], out_size: int) -> Meta:
  """The meta of a float32-list result: a reduction's is a STAT, else its operands'."""
  if name in REDUCTIONS:
    return Meta(STAT, out_size, fresh(), total=True)
  kind = _f32_kind(ops, out_size)
  if kind == CONST:
    return Meta(CONST, 1, unfit=any(not o.fits for o in ops))
  return Meta(kind, _info(name, ops, out_size), _source(ops, out_size), _total(name, ops))


def _total(name: str, ops: Sequence[Operand]) -> bool:
  return name not in COMPRESSING and any(o.meta.total for o in ops)


def promote(name: str, ops: Sequence[Operand], out_size: int) -> Decision:
  """The dtypes of a promote-list operation on floating operands ``ops``.

  * An operand is an *activation* if it is half, not a constant, and carries
    as much data as the output. A float32 operand is *strong* if it carries
    as much data as the output and is ``DATA`` or ``STAT`` (float32 data, a
    per-example loss), or ``WIDE`` from another activation (``t * exp(x)``),
    or if it is a raw total of any size (``x * jnp.sum(y)``); every other
    float32 operand is *weak*: a broadcast bias, scale or
    statistic, a scalar, or a value autocast widened from the activation it
    meets (a GELU's ``x + 0.044715 * x**3``, softplus' ``max(x, 0) +
    log1p(exp(-|x|))``): an element-wise function of one activation returns
    its dtype, as torch's activation kernels do.
  * With a strong operand the operation runs in float32 (as torch promotes
    tensors).
  * A constant that changes value in the half dtype (:func:`fits`: ``1e-8``
    becomes 0, ``1 - 1e-7`` becomes 1, ``-1e9`` becomes ``-inf``), written
    as a literal or computed from literals (``jnp.where(mask, 0.0, -1e9)``),
    keeps the operation in float32 with a float32 result, wherever it sits:
    ``log(p + 1e-8)``, ``clip(p, 1e-7, 1 - 1e-7)``, ``s + bias``,
    ``jnp.where(mask, s, -1e30) / t``. Only float32's own extremes
    (``jnp.finfo`` sentinels) in a select, max or min saturate instead (see
    :func:`saturate`).
  * Else, with an activation, the result is half: constants never widen it,
    and neither do weak operands. An arithmetic
    operation with a weak or a virtual operand computes in float32 and holds
    its result as a virtual half value (rounded once, when it leaves its
    float32 region), as torch's fused kernels do, and so does a comparison;
    other operations (selects, max, data movement) cast the weak operands to
    half (constants saturate at the half dtype's largest finite value, as
    ``jnp.finfo``'s sentinels mean).
  * With neither, the operation runs in the widest dtype among its
    non-constant operands, and a constant widens it only if it does not fit.

  Args:
    name: the primitive's name.
    ops: its floating operands.
    out_size: the number of elements of its output.

  Returns:
    The :class:`Decision`.

  Examples:
    >>> h = Operand(np.dtype("float16"), Meta(HALF, 8, 1), True, False)
    >>> bias = Operand(F32, Meta(DATA, 2, 2), True, False)
    >>> promote("add", [h, bias], 8).virtual, promote("max", [h, bias], 8).compute
    (dtype('float16'), dtype('float16'))
    >>> promote("add", [h, Operand(F32, Meta(DATA, 8, 3), True, False)], 8).compute
    dtype('float32')
    >>> cube = Operand(F32, Meta(WIDE, 8, 1), True, False)  # x**3, widened from h
    >>> promote("add", [h, cube], 8).virtual, promote("add", [h, cube._replace(
    ...     meta=Meta(WIDE, 8, 4))], 8).virtual  # from h itself; from another activation
    (dtype('float16'), None)
  """
  info = _info(name, ops, out_size)
  nonconst = [o for o in ops if o.meta.kind != CONST]
  if not nonconst:
    dtype = _widest([o.dtype for o in ops])
    return Decision(dtype, None, Meta(CONST, 1, unfit=any(not o.fits for o in ops)))
  source = _source(ops, out_size)
  acts = [o for o in nonconst if o.dtype in HALVES and o.meta.info >= out_size]
  mine = {o.meta.source for o in acts}
  strong = [o for o in nonconst if o.dtype == F32 and (o.meta.total or (
      o.meta.info >= out_size and (o.meta.kind in (DATA, STAT)
                                   or (o.meta.kind == WIDE and o.meta.source not in mine))))]
  unfit = any(o.meta.kind == CONST and not o.fits for o in ops)
  widen = strong or unfit  # log(p + 1e-8) in float16, clip(p, 1e-7, 1 - 1e-7)
  store = _widest([o.dtype for o in acts]) if acts and not widen else F32
  if store in HALVES:
    weak = any(o.dtype == F32 for o in nonconst)
    if any(o.virtual for o in nonconst) or (name in _EXACT_IN_F32 and (weak or unfit)):
      return Decision(F32, store, Meta(HALF, info, source))
    return Decision(store, None, Meta(HALF, info, source))
  total = _total(name, ops)
  if strong:
    kind = max((o.meta.kind for o in strong), key=lambda k: _PRIORITY[k])
    return Decision(F32, None, Meta(kind, info, source, total))
  unfit_dtypes = [o.dtype for o in ops if o.meta.kind == CONST and not o.fits]
  target = _widest([o.dtype for o in nonconst] + unfit_dtypes)
  if target in HALVES:
    virtual = any(o.virtual for o in nonconst)
    return Decision(F32 if virtual else target, target if virtual else None,
                    Meta(HALF, info, source))
  kind = _f32_kind(ops, out_size) if target == F32 else OTHER
  return Decision(target, None, Meta(kind, info, source, total))


def _changes(value: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per element of a constant, in ``dtype``: (changed by rounding, past its range, lost beside 1).

  Changed by rounding: subnormal, flushed to 0, or rounded to exactly 1 or
  -1. Lost beside 1: nonzero, and ``1 + |value|`` rounds to 1.
  """
  v = np.abs(np.asarray(value, np.float64))
  info = jnp.finfo(dtype)
  with np.errstate(over="ignore"):
    rounded = np.abs(np.asarray(np.asarray(v, dtype), np.float64))
  finite = (v != 0) & np.isfinite(v)
  one = (rounded == 1) & (v != 1)
  changed = finite & ((v < float(info.tiny)) | one)
  beside_one = finite & ((v <= float(info.eps) / 2) | one)  # 1 + eps / 2 rounds to 1 (to even).
  return changed, finite & (v > float(info.max)), beside_one


def fits(value: np.ndarray, dtype: np.dtype) -> bool:
  """Whether a constant keeps its value in ``dtype`` (zero, inf and NaN do).

  A constant does not fit if it overflows (``-1e9`` in float16), is
  subnormal or flushes to 0 (``1e-8`` in float16), or rounds to exactly
  1 or -1 (``1 - 1e-7`` in float16 and bfloat16): each changes what the
  program computes (``log(1 - p)`` of a clipped ``p`` is ``-inf``). Other
  roundings (``0.1``) lose only the half dtype's precision, and fit.

  Examples:
    >>> f16, bf16 = np.dtype("float16"), np.dtype(jnp.bfloat16)
    >>> fits(1e-8, f16), fits(1e-8, bf16), fits(1 - 1e-7, bf16), fits(-1e9, f16), fits(0.1, f16)
    (False, True, False, False, True)
  """
  changed, past, _ = _changes(value, dtype)
  return not bool(np.any(changed | past))


def finer(value: np.ndarray, dtype: np.dtype) -> bool:
  """Whether a constant marks a difference that ``dtype`` cannot resolve near 1.

  A nonzero value that 1 does not survive being added to in ``dtype`` (an
  eps: ``1e-8``, or ``1e-3`` in bfloat16), or that rounds to exactly 1 or
  -1 itself (a clip bound, ``1 - 1e-7``): a value it is added to, or that
  it clips, must be held more finely than ``dtype`` holds a probability
  near 1 (``log(1 - p + 1e-8)``, ``clip(p, 1e-7, 1 - 1e-7)``). A value past
  the range (a sentinel, ``-1e9``) is not: it changes the operation, not
  what the operation needs of its other operands.

  Examples:
    >>> f16, bf16 = np.dtype("float16"), np.dtype(jnp.bfloat16)
    >>> finer(1e-8, bf16), finer(1e-3, bf16), finer(1e-3, f16), finer(1 - 1e-7, bf16)
    (True, True, False, True)
    >>> finer(-1e9, f16), finer(0.5, f16), finer(0.0, f16)
    (False, False, False)
  """
  return bool(np.any(_changes(value, dtype)[2]))


def operand_fits(const: Any, meta: Meta, dtype: np.dtype, name: str) -> bool:
  """Whether a constant operand of ``name`` is one the half dtype holds (:attr:`Operand.fits`).

  A literal fits if :func:`fits` says so, or if it is a float32 sentinel read
  by an operation that only passes values on (a select, max or min: it
  saturates); a constant computed in the function (``const`` is ``None``) if
  none it was made from was unfit.
  """
  if const is None:
    return not meta.unfit
  return fits(const, dtype) or (name not in ARITHMETIC and sentinel(const))


def sentinel(value: np.ndarray) -> bool:
  """Whether a constant is float32's largest magnitude (``jnp.finfo(jnp.float32).min``/``max``).

  Such a constant means "the largest value" (``jnp.nan_to_num``'s, Flax's
  attention mask's): in a select, max or min it saturates at the half
  dtype's largest finite value (:func:`saturate`) and keeps its meaning.
  """
  v = np.abs(np.asarray(value, np.float64))
  return bool(np.all(v >= float(jnp.finfo(jnp.float32).max) / 2))


def saturate(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """A constant in ``dtype``, finite values beyond its range clipped to its largest finite one.

  ``jnp.finfo(jnp.float32).max`` and ``.min`` (``jnp.nan_to_num``'s and Flax's
  attention mask's sentinels, traced in float32) become the half dtype's.

  Examples:
    >>> float(saturate(np.float32(-3.4e38), np.dtype("float16")))
    -65504.0
    >>> float(saturate(np.inf, np.dtype("float16")))
    inf
  """
  v = np.asarray(value, np.float64)
  big = float(jnp.finfo(dtype).max)
  v = np.where(np.isfinite(v), np.clip(v, -big, big), v)
  return np.asarray(v, dtype)[()] if np.ndim(value) == 0 else np.asarray(v, dtype)

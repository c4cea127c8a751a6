"""Gradient report: where gradients under- or overflow a half dtype, and which leaf blew up.

* :func:`gradient_report` measures, on device, what casting ``g * loss_scale``
  to a half dtype would do to a gradient tree, suggests a loss scale and keeps
  the histogram of log2|g| (drawn by ``GradientReport.plot``).
* :func:`nonfinite_paths` turns ``metrics["nonfinite"]`` from
  ``make_train_step(..., track_nonfinite=True)`` into key paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike, DTypeLike

from jmp_lite._src import checks
from jmp_lite._src.diagnostics import plotting
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree_utils

# Histogram bins: bin i counts the elements with floor(log2|g|) == _EDGE_LO + i.
# They cover every normal float32 (2^-126 .. 2^128); values outside (float64)
# are counted in the first or last bin.
_EDGE_LO, _EDGE_HI = -128, 128
_NUM_BINS = _EDGE_HI - _EDGE_LO
# The suggested scale is clamped to the usable loss scales (checks.loss_scale):
# the powers of two from 2^-126 to 2^126, whose reciprocals are normal float32s.
_MIN_SCALE_EXP = int(math.log2(checks.MIN_LOSS_SCALE))
_MAX_SCALE_EXP = int(math.log2(checks.MAX_LOSS_SCALE))


class LeafStats(NamedTuple):
  """Statistics of one gradient leaf (see :func:`gradient_report`).

  The fractions are float32; ``max_abs`` is in the widest dtype of the
  report's leaves (float32, or float64 for float64 leaves), which holds it.
  """

  underflow_fraction: jax.Array
  overflow_fraction: jax.Array
  zero_fraction: jax.Array
  max_abs: jax.Array


def pow2_str(x: float) -> str:
  """``2^k`` for a power of two (other than 1 and 2), else ``%g``."""
  if x > 0 and math.isfinite(x):
    m, e = math.frexp(x)
    if m == 0.5:
      return f"2^{e - 1}" if e - 1 not in (0, 1) else f"{x:g}"
  return f"{x:g}"


@dataclasses.dataclass(frozen=True)
class GradientReport:
  """What casting ``grads * loss_scale`` to ``dtype`` does. A pytree.

  Array fields are pytree children (so a report can be returned from a jitted
  function); ``dtype`` is static, and the leaf names are the static keys of
  ``per_leaf``. Build it with :func:`gradient_report`.

  Attributes:
    underflow_fraction: over all floating leaves, the fraction of non-zero
      elements whose cast is exactly 0.
    overflow_fraction: over all floating leaves, the fraction of non-zero
      elements whose cast is +-inf or NaN (non-finite inputs included).
    zero_fraction: the fraction of all elements that are exactly 0.
    max_abs: the largest finite ``|g|`` (0 if there is none), in the widest
      dtype of the leaves (float32, or float64 for float64 leaves).
    leaf_stats: a :class:`LeafStats` of vectors, one entry per leaf
      in the order of ``leaf_paths`` (:attr:`per_leaf` is the same as a dict).
    histogram: int32 counts of ``floor(log2|g|)`` over the finite non-zero
      elements of unscaled ``g``, in the bins given by :attr:`bin_edges`.
    suggested_loss_scale: the largest power of two ``s`` with
      ``max_abs * s * 2 <= finfo(dtype).max``, never more than half of
      ``loss_scale`` when something overflowed (see :func:`gradient_report`).
    loss_scale: the scale the fractions were measured at (float32).
    dtype: the dtype the gradients were cast to.
    leaf_paths: the leaves' key paths (static). Paths are ``"/"``-joined
      (``"params/Dense_0/kernel"``); two leaves whose joined paths would
      collide are named by :func:`jax.tree_util.keystr` instead.
  """

  underflow_fraction: jax.Array
  overflow_fraction: jax.Array
  zero_fraction: jax.Array
  max_abs: jax.Array
  leaf_stats: LeafStats
  histogram: jax.Array
  suggested_loss_scale: jax.Array
  loss_scale: jax.Array
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
  leaf_paths: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def per_leaf(self) -> dict[str, LeafStats]:
    """Key path -> :class:`LeafStats` of scalars, in flattening order."""
    return {
        path: LeafStats(*(v[i] for v in self.leaf_stats))
        for i, path in enumerate(self.leaf_paths)
    }

  @property
  def bin_edges(self) -> np.ndarray:
    """The ``len(histogram) + 1`` edges, in log2 units: bin i is [edges[i], edges[i+1])."""
    return np.arange(_EDGE_LO, _EDGE_HI + 1)

  def summary(self, top: int = 10) -> str:
    """A text table of the ``top`` worst leaves (most overflow, then most underflow).

    Args:
      top: how many leaves to list; an int >= 1.

    Returns:
      The table, a header line first.

    Raises:
      TypeError: if ``top`` is not an int.
      ValueError: if ``top`` < 1.

    Examples:
      >>> import jax.numpy as jnp
      >>> report = gradient_report({"w": jnp.array([2.0**-30, 1.0])})
      >>> print(report.summary())  # doctest: +NORMALIZE_WHITESPACE
      float16 at loss scale 1: underflow 50.00%, overflow 0.00%, zero 0.00%,
      max|g| 1e+00, suggested loss scale 2^14
      leaf  underflow  overflow    zero   max|g|
      w        50.00%     0.00%   0.00%    1e+00
    """
    top = checks.integer("top", top, minimum=1)
    columns = [np.asarray(v, np.float64) for v in self.leaf_stats]
    rows = {path: [float(c[i]) for c in columns] for i, path in enumerate(self.leaf_paths)}
    worst = sorted(rows, key=lambda p: (-rows[p][1], -rows[p][0], p))[:top]
    header = (
        f"{self.dtype.name} at loss scale {pow2_str(float(self.loss_scale))}: "
        f"underflow {float(self.underflow_fraction):.2%}, "
        f"overflow {float(self.overflow_fraction):.2%}, "
        f"zero {float(self.zero_fraction):.2%},\n"
        f"max|g| {float(self.max_abs):.0e}, "
        f"suggested loss scale {pow2_str(float(self.suggested_loss_scale))}"
    )
    width = max([len("leaf"), *(len(p) for p in worst)])
    lines = [header, f"{'leaf':<{width}}  underflow  overflow    zero   max|g|"]
    for p in worst:
      under, over, zero, max_abs = rows[p]
      lines.append(f"{p:<{width}}  {under:>9.2%}  {over:>8.2%}  {zero:>6.2%}  {max_abs:>7.0e}")
    if len(rows) > top:
      lines.append(f"... {len(rows) - top} more leaves")
    return "\n".join(lines)

  def plot(self, path: Union[str, os.PathLike[str], None] = None, *, ax: Any = None) -> Any:
    """Draws the histogram of log2|g| against ``dtype``'s range; saves a PNG to ``path``.

    The x axis is log2 of a magnitude. The grey outline is the histogram of
    the unscaled gradients; the filled bars are the same histogram moved by
    ``log2(loss_scale)``, i.e. of ``g * loss_scale``, the values that get cast.
    The shaded bands are ``dtype``'s normal range and its subnormal range;
    left of them values flush to 0, right of them they overflow. The title
    gives the underflow and overflow fractions.

    Args:
      path: where to write the PNG; ``None`` writes nothing.
      ax: a matplotlib ``Axes`` to draw into; by default a new figure.

    Returns:
      The matplotlib ``Figure``.

    Raises:
      ImportError: if matplotlib is not installed (it is in the ``examples``
        extra).
    """
    return plotting.plot_log2_histogram(
        self.histogram,
        self.bin_edges,
        loss_scale=float(self.loss_scale),
        dtype=self.dtype,
        title=(f"{self.dtype.name} at loss scale {pow2_str(float(self.loss_scale))}: underflow "
               f"{float(self.underflow_fraction):.1%}, overflow {float(self.overflow_fraction):.1%}"),
        scale_label=f"x loss scale {pow2_str(float(self.loss_scale))}",
        path=path,
        ax=ax,
    )


jax.tree_util.register_dataclass(GradientReport)


def _fraction(num: jax.Array, den: Any) -> jax.Array:
  den = jnp.asarray(den, jnp.float32)
  return jnp.where(den > 0, num.astype(jnp.float32) / jnp.maximum(den, 1), 0.0)


def _suggested_scale(
    max_abs: jax.Array, dtype: np.dtype, scale: jax.Array, overflowed: jax.Array
) -> jax.Array:
  """The largest 2^k with ``max_abs * 2^k * 2 <= finfo(dtype).max``, exactly.

  With ``max_abs = mM * 2^eM`` and ``fmax = mF * 2^eF`` (mantissas in
  [0.5, 1)), the condition ``mM * 2^(eM + k + 1) <= mF * 2^eF`` holds for
  every ``k <= eF - eM - 2`` and for ``k = eF - eM - 1`` iff ``mM <= mF``.
  Exponents are compared as integers, so nothing overflows on the way.

  When something ``overflowed`` at ``scale`` (a non-finite gradient, which no
  scale fixes, included), ``k`` is at most that of the largest power of two
  <= ``scale / 2``: with ``scale = mS * 2^eS``, that is ``eS - 2``.
  """
  m_f, e_f = np.frexp(np.float64(jnp.finfo(dtype).max))
  m_m, e_m = jnp.frexp(jnp.where(max_abs > 0, max_abs, 1.0))
  k = jnp.where(m_m <= m_f, e_f - e_m - 1, e_f - e_m - 2)
  k = jnp.where(max_abs > 0, k, _MAX_SCALE_EXP)
  k = jnp.where(overflowed, jnp.minimum(k, jnp.frexp(scale)[1] - 2), k)
  k = jnp.clip(k, _MIN_SCALE_EXP, _MAX_SCALE_EXP)
  return jnp.ldexp(jnp.float32(1.0), k.astype(jnp.int32))


def _real_view(g: jax.Array) -> jax.Array:
  """The real elements of a leaf, widened: a complex leaf counts its two parts."""
  wide = tree_utils.wide_dtype(g.dtype)
  if jnp.issubdtype(wide, jnp.complexfloating):
    return jnp.stack([jnp.real(g), jnp.imag(g)]).ravel()
  return g.astype(wide).ravel()


@functools.partial(jax.jit, static_argnames=("dtype", "paths"))
def _report(leaves: tuple[jax.Array, ...], scale: jax.Array, dtype: np.dtype,
            paths: tuple[str, ...]) -> GradientReport:
  """One compiled computation per tree structure (inlined under an outer jit).

  Every leaf is flattened into one vector, so the work is a fixed number of
  fused operations (one histogram, four segment sums, one segment max)
  whatever the number of leaves, and the per-leaf statistics come out as
  vectors (slicing them into per-leaf scalars inside the computation would
  cost XLA a kernel per leaf).
  """
  parts = [_real_view(g) for g in leaves]
  wide = functools.reduce(jnp.promote_types, [p.dtype for p in parts])
  x = jnp.concatenate([p.astype(wide) for p in parts])
  sizes = [p.size for p in parts]
  ids = jnp.repeat(jnp.arange(len(parts)), np.array(sizes), total_repeat_length=x.size)
  cast = (x * scale.astype(wide)).astype(dtype)
  nonzero = x != 0  # NaN and inf are non-zero.
  finite_nonzero = nonzero & jnp.isfinite(x)
  magnitude = jnp.where(finite_nonzero, jnp.abs(x), 1)
  # floor(log2|g|) from the exponent, exactly (log2 rounds near powers of two).
  exponent = jnp.frexp(magnitude)[1] - 1
  bins = jnp.clip(exponent - _EDGE_LO, 0, _NUM_BINS - 1)
  bins = jnp.where(finite_nonzero, bins, _NUM_BINS)  # An extra bin, dropped.
  hist = jnp.bincount(bins, length=_NUM_BINS + 1)[:_NUM_BINS].astype(jnp.int32)

  def per_leaf(mask: jax.Array) -> jax.Array:
    return jax.ops.segment_sum(mask.astype(jnp.int32), ids, len(parts), indices_are_sorted=True)

  nz = per_leaf(nonzero)
  under = per_leaf(nonzero & (cast == 0))
  over = per_leaf(nonzero & ~jnp.isfinite(cast))
  zero = per_leaf(~nonzero)
  leaf_max = jax.ops.segment_max(
      jnp.where(finite_nonzero, jnp.abs(x), 0), ids, len(parts), indices_are_sorted=True
  )
  # In the wide dtype, which holds every finite |g| (a float64 1e300 is inf in
  # float32). Empty leaves give -inf.
  leaf_max = jnp.maximum(leaf_max, 0)
  size = jnp.asarray(sizes, jnp.float32)
  leaf_stats = LeafStats(
      underflow_fraction=_fraction(under, nz),
      overflow_fraction=_fraction(over, nz),
      zero_fraction=_fraction(zero, size),
      max_abs=leaf_max,
  )
  def total(c: jax.Array) -> jax.Array:
    return jnp.sum(c.astype(jnp.float32))

  max_abs = jnp.max(leaf_max)
  overflowed = total(over) > 0
  return GradientReport(
      underflow_fraction=_fraction(total(under), total(nz)),
      overflow_fraction=_fraction(total(over), total(nz)),
      zero_fraction=_fraction(total(zero), float(x.size)),
      max_abs=max_abs,
      leaf_stats=leaf_stats,
      histogram=hist,
      suggested_loss_scale=_suggested_scale(max_abs, dtype, scale, overflowed),
      loss_scale=scale,
      dtype=dtype,
      leaf_paths=paths,
  )


def gradient_report(
    grads: optax.Updates, *, dtype: DTypeLike = jnp.float16, loss_scale: ArrayLike = 1.0
) -> GradientReport:
  """Measures what casting ``grads * loss_scale`` to ``dtype`` does, on device.

  For every floating leaf ``g`` (other leaves and ``None`` are ignored; a
  complex leaf counts its real and imaginary parts as two elements each),
  ``g * loss_scale`` is computed in float32 (float64 for float64 leaves) and
  cast to ``dtype``. Then, counting elements::

    non-zero  = g != 0                          (NaN and +-inf are non-zero)
    underflow = non-zero and cast == 0
    overflow  = non-zero and cast is +-inf or NaN
    underflow_fraction = underflow / non-zero   (0 when there is no non-zero)
    overflow_fraction  = overflow / non-zero
    zero_fraction      = (g == 0) / size
    max_abs            = max |g| over finite g  (in float32, float64 for float64 leaves)

  per leaf and over the whole tree. Backends that flush float32 subnormals
  (XLA on CPU and GPU) treat gradients below 2^-126 as zero.

  ``suggested_loss_scale`` is the largest power of two ``s`` such that
  ``max_abs * s * 2 <= finfo(dtype).max``: no finite element overflows at
  ``s``, with a factor of 2 of headroom. It is clamped to [2^-126, 2^126] (the
  usable loss scales: ``1 / 2^127`` flushes to 0), and is 2^126 when there is
  no finite non-zero element. Underflow only falls as the scale grows, so
  whenever ``loss_scale`` already left that headroom, ``s >= loss_scale`` and
  underflow at ``s`` is no worse. If ``loss_scale`` overflowed, ``s`` is
  smaller, and the overflow is gone at the price of some underflow.

  A suggestion never grows a scale that overflows: whenever any element
  overflows at ``loss_scale`` (``overflow_fraction > 0``, non-finite gradients
  included, which no scale can fix), ``s`` is at most the largest power of two
  <= ``loss_scale / 2``, a back-off like a dynamic scaler's. Values that
  overflow ``dtype`` even at 2^-126 (a float64 1e300 cast to float16) get
  2^-126 and still overflow there.

  The histogram counts floor(log2|g|) of the finite non-zero unscaled
  elements in unit bins from 2^-128 to 2^128 (:attr:`GradientReport.bin_edges`).

  All leaves are measured in one flattened vector, so the compiled work does
  not grow with the number of leaves (1000 leaves compile in about a second).
  The function is jit-compatible (``dtype`` must then be static).

  Args:
    grads: a pytree of gradients (unscaled).
    dtype: the dtype to cast to, float16 by default.
    loss_scale: a positive scale: a Python number or a scalar float array.

  Returns:
    A :class:`GradientReport`.

  Raises:
    ValueError: if ``grads`` has no floating leaf, or ``loss_scale`` is a
      concrete value that is not a finite positive scalar.
    TypeError: if ``dtype`` is not a floating dtype, or ``loss_scale`` is not
      a real scalar.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> grads = {"a": jnp.array([2.0**-30, 1.0, 0.0]), "b": jnp.array([7e4])}
    >>> report = gradient_report(grads)
    >>> float(report.underflow_fraction), float(report.overflow_fraction)
    (0.3333333432674408, 0.3333333432674408)
    >>> float(report.per_leaf["a"].zero_fraction)
    0.3333333432674408
    >>> float(gradient_report(grads, loss_scale=2.0**10).per_leaf["a"].underflow_fraction)
    0.0
    >>> float(report.suggested_loss_scale)  # 7e4 * 0.25 * 2 <= 65504
    0.25
    >>> float(gradient_report({"g": jnp.array([jnp.nan, 1.0])}, loss_scale=8.0)
    ...       .suggested_loss_scale)  # 2^14 would fit 1.0, but a NaN overflowed at 8
    4.0
    >>> jax.jit(gradient_report)(grads).underflow_fraction.dtype
    dtype('float32')
  """
  dtype = policy_lib.normalize_dtype(dtype, "dtype")
  scale = _check_loss_scale(loss_scale)
  flat = [
      (path, g)
      for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
      if tree_utils.is_inexact_array(g)
  ]
  if not flat:
    raise ValueError(f"gradient_report needs a pytree with floating array leaves, got {grads!r}")
  paths = tuple(tree_utils.unique_path_strs([p for p, _ in flat]))
  return _report(tuple(g for _, g in flat), scale, dtype, paths)


def _check_loss_scale(loss_scale: Any) -> jax.Array:
  """A float32 scalar; concrete values must be finite and > 0."""
  shape = np.shape(loss_scale)
  if shape != ():
    raise ValueError(f"loss_scale must be a scalar, got shape {shape}")
  if checks.is_concrete_number(loss_scale):
    checks.positive_finite("loss_scale", loss_scale)
  elif not (isinstance(loss_scale, jax.Array) and jnp.issubdtype(loss_scale.dtype, jnp.floating)):
    raise TypeError(f"loss_scale must be a real number or a float scalar array, got {loss_scale!r}")
  return jnp.asarray(loss_scale, jnp.float32)


def nonfinite_paths(tree: Any) -> list[str]:
  """The ``/``-joined key paths of the ``True`` leaves of a bool pytree.

  Use it on ``metrics["nonfinite"]`` from ``make_train_step(...,
  track_nonfinite=True)`` to name the parameters whose gradients were
  non-finite on that step. A leaf counts as ``True`` if any of its elements
  is. It needs concrete values: call it outside ``jit``.

  Args:
    tree: a pytree of bool arrays or Python bools.

  Returns:
    The paths, in the tree's flattening order.

  Raises:
    TypeError: if a leaf is not boolean.

  Examples:
    >>> import jax.numpy as jnp
    >>> nonfinite_paths({"params": {"Dense_0": {"bias": jnp.bool_(False),
    ...                                         "kernel": jnp.bool_(True)}}})
    ['params/Dense_0/kernel']
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = []
  for name, (_, leaf) in zip(tree_utils.unique_path_strs([p for p, _ in flat]), flat):
    value = np.asarray(leaf)
    if value.dtype != np.bool_:
      raise TypeError(
          f"nonfinite_paths expects a pytree of bools (metrics['nonfinite']); the leaf "
          f"at {name!r} has dtype {value.dtype}"
      )
    if value.any():
      out.append(name)
  return out

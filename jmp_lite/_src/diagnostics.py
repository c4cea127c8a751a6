"""Diagnostics: where gradients under- or overflow, which leaf blew up, risky ops.

* :func:`gradient_report` measures, on device, what casting ``g * loss_scale``
  to a half dtype would do to a gradient tree, suggests a loss scale and draws
  the histogram of log2|g| against the dtype's range.
* :func:`nonfinite_paths` turns ``metrics["nonfinite"]`` from
  ``make_train_step(..., track_nonfinite=True)`` into key paths.
* :func:`precision_lint` reads the jaxpr of a loss function under a policy and
  lists the operations that are risky in half precision, with their source line.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.typing import ArrayLike, DTypeLike

from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree_utils

# Histogram bins: bin i counts the elements with floor(log2|g|) == _EDGE_LO + i.
# They cover every normal float32 (2^-126 .. 2^128); values outside (float64)
# are counted in the first or last bin.
_EDGE_LO, _EDGE_HI = -128, 128
_NUM_BINS = _EDGE_HI - _EDGE_LO
# The suggested scale is clamped to the powers of two that float32 (the dtype
# of every loss scale) represents as normal numbers.
_MIN_SCALE_EXP, _MAX_SCALE_EXP = -126, 127

_MATPLOTLIB_MSG = (
    "GradientReport.plot needs matplotlib, an optional dependency: "
    "pip install 'jmp_lite[examples]' (or pip install matplotlib)"
)


class LeafStats(NamedTuple):
  """Statistics of one gradient leaf (float32 scalars; see :func:`gradient_report`)."""

  underflow_fraction: jax.Array
  overflow_fraction: jax.Array
  zero_fraction: jax.Array
  max_abs: jax.Array


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
    max_abs: the largest finite |g| (0 if there is none).
    per_leaf: ``"/"``-joined key path -> :class:`LeafStats`.
    histogram: int32 counts of floor(log2|g|) over the finite non-zero
      elements of unscaled ``g``, in the bins given by :attr:`bin_edges`.
    suggested_loss_scale: the largest power of two ``s`` with
      ``max_abs * s * 2 <= finfo(dtype).max``.
    loss_scale: the scale the fractions were measured at (float32).
    dtype: the dtype the gradients were cast to.
  """

  underflow_fraction: jax.Array
  overflow_fraction: jax.Array
  zero_fraction: jax.Array
  max_abs: jax.Array
  per_leaf: dict[str, LeafStats]
  histogram: jax.Array
  suggested_loss_scale: jax.Array
  loss_scale: jax.Array
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))

  @property
  def bin_edges(self) -> np.ndarray:
    """The ``len(histogram) + 1`` edges, in log2 units: bin i is [edges[i], edges[i+1])."""
    return np.arange(_EDGE_LO, _EDGE_HI + 1)

  def summary(self, top: int = 10) -> str:
    """A text table of the ``top`` worst leaves (most overflow, then most underflow).

    Examples:
      >>> import jax.numpy as jnp
      >>> report = gradient_report({"w": jnp.array([2.0**-30, 1.0])})
      >>> print(report.summary())  # doctest: +NORMALIZE_WHITESPACE
      float16 at loss scale 1: underflow 50.00%, overflow 0.00%, zero 0.00%,
      max|g| 1e+00, suggested loss scale 2^14
      leaf  underflow  overflow    zero   max|g|
      w        50.00%     0.00%   0.00%    1e+00
    """
    if top < 1:
      raise ValueError(f"top must be >= 1, got {top!r}")
    rows = {path: [float(v) for v in stats] for path, stats in self.per_leaf.items()}
    worst = sorted(rows, key=lambda p: (-rows[p][1], -rows[p][0], p))[:top]
    header = (
        f"{self.dtype.name} at loss scale {_pow2(float(self.loss_scale))}: "
        f"underflow {float(self.underflow_fraction):.2%}, "
        f"overflow {float(self.overflow_fraction):.2%}, "
        f"zero {float(self.zero_fraction):.2%},\n"
        f"max|g| {float(self.max_abs):.0e}, "
        f"suggested loss scale {_pow2(float(self.suggested_loss_scale))}"
    )
    width = max([len("leaf"), *(len(p) for p in worst)])
    lines = [header, f"{'leaf':<{width}}  underflow  overflow    zero   max|g|"]
    for p in worst:
      under, over, zero, max_abs = rows[p]
      lines.append(f"{p:<{width}}  {under:>9.2%}  {over:>8.2%}  {zero:>6.2%}  {max_abs:>7.0e}")
    if len(rows) > top:
      lines.append(f"... {len(rows) - top} more leaves")
    return "\n".join(lines)

  def plot(self, path: Union[str, os.PathLike, None] = None, *, ax: Any = None) -> Any:
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
    try:
      import matplotlib
      if ax is None:
        matplotlib.use("Agg")
      import matplotlib.pyplot as plt
    except ImportError as e:
      raise ImportError(_MATPLOTLIB_MSG) from e
    counts = np.asarray(self.histogram)
    scale = float(self.loss_scale)
    shift = math.log2(scale)
    edges = self.bin_edges.astype(np.float64)
    info = jnp.finfo(self.dtype)
    lo_sub, lo_norm = math.log2(float(info.smallest_subnormal)), math.log2(float(info.tiny))
    hi = math.log2(float(info.max))
    if ax is None:
      fig, ax = plt.subplots(figsize=(7, 4))
      own = True
    else:
      fig, own = ax.figure, False
    nonempty = np.nonzero(counts)[0]
    if nonempty.size:
      x_min = min(edges[nonempty[0]], edges[nonempty[0]] + shift, lo_sub) - 4
      x_max = max(edges[nonempty[-1] + 1], edges[nonempty[-1] + 1] + shift, hi) + 4
    else:
      x_min, x_max = lo_sub - 4, hi + 4
    ax.axvspan(lo_sub, lo_norm, color="tab:olive", alpha=0.15, label=f"{self.dtype.name} subnormal")
    ax.axvspan(lo_norm, hi, color="tab:green", alpha=0.15, label=f"{self.dtype.name} normal")
    ax.axvspan(x_min, lo_sub, color="tab:red", alpha=0.08, label="flushes to 0")
    ax.axvspan(hi, x_max, color="tab:purple", alpha=0.08, label="overflows")
    ax.stairs(counts, edges, color="0.4", label="unscaled gradients")
    ax.stairs(counts, edges + shift, fill=True, color="tab:blue", alpha=0.7,
              label=f"x loss scale {_pow2(scale)}")
    if nonempty.size and shift:
      peak = int(np.argmax(counts))
      x0 = 0.5 * (edges[peak] + edges[peak + 1])
      y = 0.5 * counts[peak]
      ax.annotate("", xy=(x0 + shift, y), xytext=(x0, y),
                  arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_xlim(x_min, x_max)
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("elements")
    ax.set_title(
        f"{self.dtype.name} at loss scale {_pow2(scale)}: underflow "
        f"{float(self.underflow_fraction):.1%}, overflow {float(self.overflow_fraction):.1%}",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
    if path is not None:
      if own:
        fig.tight_layout()
      fig.savefig(path, format="png", dpi=110)
    if own and path is not None:
      plt.close(fig)
    return fig


jax.tree_util.register_dataclass(
    GradientReport,
    data_fields=[
        "underflow_fraction", "overflow_fraction", "zero_fraction", "max_abs",
        "per_leaf", "histogram", "suggested_loss_scale", "loss_scale",
    ],
    meta_fields=["dtype"],
)


def _pow2(x: float) -> str:
  """``2^k`` for a power of two, else ``%g``."""
  if x > 0 and math.isfinite(x):
    m, e = math.frexp(x)
    if m == 0.5:
      return f"2^{e - 1}" if e - 1 not in (0, 1) else f"{x:g}"
  return f"{x:g}"


class _Counts(NamedTuple):
  nonzero: jax.Array
  under: jax.Array
  over: jax.Array
  zero: jax.Array
  size: int
  max_abs: jax.Array
  hist: jax.Array


def _leaf_counts(g: jax.Array, dtype: np.dtype, scale: jax.Array) -> _Counts:
  wide = jnp.promote_types(g.dtype, jnp.float32)
  x = g.astype(wide)
  cast = (x * scale.astype(wide)).astype(dtype)
  nonzero = x != 0  # NaN and inf are non-zero.
  finite_nonzero = nonzero & jnp.isfinite(x)
  count = lambda m: jnp.sum(m, dtype=jnp.int32)
  magnitude = jnp.where(finite_nonzero, jnp.abs(x), 1)
  # floor(log2|g|) from the exponent, exactly (log2 rounds near powers of two).
  exponent = jnp.frexp(magnitude)[1] - 1
  bins = jnp.clip(exponent - _EDGE_LO, 0, _NUM_BINS - 1)
  bins = jnp.where(finite_nonzero, bins, _NUM_BINS)  # An extra bin, dropped.
  hist = jnp.bincount(bins.ravel(), length=_NUM_BINS + 1)[:_NUM_BINS].astype(jnp.int32)
  return _Counts(
      nonzero=count(nonzero),
      under=count(nonzero & (cast == 0)),
      over=count(nonzero & ~jnp.isfinite(cast)),
      zero=count(~nonzero),
      size=x.size,
      max_abs=jnp.max(jnp.where(finite_nonzero, jnp.abs(x), 0), initial=0).astype(jnp.float32),
      hist=hist,
  )


def _fraction(num: jax.Array, den: Any) -> jax.Array:
  den = jnp.asarray(den, jnp.float32)
  return jnp.where(den > 0, num.astype(jnp.float32) / jnp.maximum(den, 1), 0.0)


def _suggested_scale(max_abs: jax.Array, dtype: np.dtype) -> jax.Array:
  """The largest 2^k with ``max_abs * 2^k * 2 <= finfo(dtype).max``, exactly.

  With ``max_abs = mM * 2^eM`` and ``fmax = mF * 2^eF`` (mantissas in
  [0.5, 1)), the condition ``mM * 2^(eM + k + 1) <= mF * 2^eF`` holds for
  every ``k <= eF - eM - 2`` and for ``k = eF - eM - 1`` iff ``mM <= mF``.
  Exponents are compared as integers, so nothing overflows on the way.
  """
  m_f, e_f = np.frexp(np.float64(jnp.finfo(dtype).max))
  m_m, e_m = jnp.frexp(jnp.where(max_abs > 0, max_abs, 1.0))
  k = jnp.where(m_m <= m_f, e_f - e_m - 1, e_f - e_m - 2)
  k = jnp.where(max_abs > 0, k, _MAX_SCALE_EXP)
  k = jnp.clip(k, _MIN_SCALE_EXP, _MAX_SCALE_EXP)
  return jnp.ldexp(jnp.float32(1.0), k.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames="dtype")
def _report(leaves: dict[str, jax.Array], scale: jax.Array, dtype: np.dtype) -> GradientReport:
  """One compiled computation per tree structure (inlined under an outer jit)."""
  counts = {path: _leaf_counts(g, dtype, scale) for path, g in leaves.items()}
  per_leaf = {
      path: LeafStats(
          underflow_fraction=_fraction(c.under, c.nonzero),
          overflow_fraction=_fraction(c.over, c.nonzero),
          zero_fraction=_fraction(c.zero, c.size),
          max_abs=c.max_abs,
      )
      for path, c in counts.items()
  }
  total = lambda field: sum(getattr(c, field).astype(jnp.float32) for c in counts.values())
  max_abs = jnp.max(jnp.stack([c.max_abs for c in counts.values()]))
  return GradientReport(
      underflow_fraction=_fraction(total("under"), total("nonzero")),
      overflow_fraction=_fraction(total("over"), total("nonzero")),
      zero_fraction=_fraction(total("zero"), sum(c.size for c in counts.values())),
      max_abs=max_abs,
      per_leaf=per_leaf,
      histogram=sum(c.hist for c in counts.values()),
      suggested_loss_scale=_suggested_scale(max_abs, dtype),
      loss_scale=scale,
      dtype=dtype,
  )


def gradient_report(
    grads: Any, *, dtype: DTypeLike = jnp.float16, loss_scale: ArrayLike = 1.0
) -> GradientReport:
  """Measures what casting ``grads * loss_scale`` to ``dtype`` does, on device.

  For every floating leaf ``g`` (other leaves and ``None`` are ignored),
  ``g * loss_scale`` is computed in float32 (float64 for float64 leaves) and
  cast to ``dtype``. Then, counting elements::

    non-zero  = g != 0                          (NaN and +-inf are non-zero)
    underflow = non-zero and cast == 0
    overflow  = non-zero and cast is +-inf or NaN
    underflow_fraction = underflow / non-zero   (0 when there is no non-zero)
    overflow_fraction  = overflow / non-zero
    zero_fraction      = (g == 0) / size
    max_abs            = max |g| over finite g

  per leaf and over the whole tree. Backends that flush float32 subnormals
  (XLA on CPU and GPU) treat gradients below 2^-126 as zero.

  ``suggested_loss_scale`` is the largest power of two ``s`` such that
  ``max_abs * s * 2 <= finfo(dtype).max``: no finite element overflows at
  ``s``, with a factor of 2 of headroom. It is clamped to [2^-126, 2^127], and
  is 2^127 when there is no finite non-zero element. Underflow only falls as the
  scale grows, so whenever ``loss_scale`` already left that headroom,
  ``s >= loss_scale`` and underflow at ``s`` is no worse. If ``loss_scale``
  overflowed, ``s`` is smaller, and the overflow is gone at the price of some
  underflow.

  The histogram counts floor(log2|g|) of the finite non-zero unscaled
  elements in unit bins from 2^-128 to 2^128 (:attr:`GradientReport.bin_edges`).

  The function is jit-compatible (``dtype`` must then be static).

  Args:
    grads: a pytree of gradients (unscaled).
    dtype: the dtype to cast to, float16 by default.
    loss_scale: a positive scale; a Python number or a float32 array.

  Returns:
    A :class:`GradientReport`.

  Raises:
    ValueError: if ``grads`` has no floating leaf, or ``loss_scale`` is a number
      that is not finite and positive.
    TypeError: if ``dtype`` is not a floating dtype.

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
    >>> jax.jit(gradient_report)(grads).underflow_fraction.dtype
    dtype('float32')
  """
  dtype = policy_lib._normalize_dtype(dtype, "dtype")
  if isinstance(loss_scale, (int, float)) and not (math.isfinite(loss_scale) and loss_scale > 0):
    raise ValueError(f"loss_scale must be finite and > 0, got {loss_scale!r}")
  scale = jnp.asarray(loss_scale, jnp.float32)
  leaves = [
      (tree_utils.path_str(path), g)
      for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
      if tree_utils.is_floating_array(g)
  ]
  if not leaves:
    raise ValueError(f"gradient_report needs a pytree with floating array leaves, got {grads!r}")
  return _report(dict(leaves), scale, dtype)


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
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    value = np.asarray(leaf)
    if value.dtype != np.bool_:
      raise TypeError(
          f"nonfinite_paths expects a pytree of bools (metrics['nonfinite']); the leaf "
          f"at {tree_utils.path_str(path)!r} has dtype {value.dtype}"
      )
    if value.any():
      out.append(tree_utils.path_str(path))
  return out


# ---------------------------------------------------------------------------
# Precision lint.

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
_MAX_HOPS = 4
_LIBRARIES = ("jax", "flax", "optax", "chex", "equinox", "haiku", "jmp", "jmp_lite")


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


def _library_roots() -> tuple[str, ...]:
  roots = []
  for name in _LIBRARIES:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None):
      roots.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
  return tuple(roots)


def _source(eqn: Any, roots: tuple[str, ...]) -> Union[str, None]:
  from jax._src import source_info_util  # Frames of the trace; no public API yet.

  frames = list(source_info_util.user_frames(eqn.source_info.traceback))
  user = [f for f in frames if not os.path.abspath(f.file_name).startswith(roots)]
  frame = (user or frames or [None])[0]
  if frame is None:
    return None
  name = frame.file_name
  try:
    rel = os.path.relpath(name)
    name = rel if not rel.startswith("..") else name
  except ValueError:  # Another drive on Windows.
    pass
  return f"{name}:{frame.start_line} ({frame.function_name})"


def _dtype(v: Any) -> Union[np.dtype, None]:
  aval = getattr(v, "aval", None)
  return np.dtype(aval.dtype) if hasattr(aval, "dtype") else None


def _subjaxprs(params: Mapping[str, Any]):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jex_core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jex_core.Jaxpr):
        yield item


def _reaches(var: Any, consumers: Mapping[Any, list], through: frozenset, hit: Callable) -> list:
  """Eqns satisfying ``hit`` reachable from ``var`` through ``through`` ops."""
  found, frontier, seen = [], [var], set()
  for _ in range(_MAX_HOPS):
    nxt = []
    for v in frontier:
      for eqn in consumers.get(v, ()):
        if id(eqn) in seen:
          continue
        seen.add(id(eqn))
        if hit(eqn):
          found.append(eqn)
        elif eqn.primitive.name in through:
          nxt.extend(eqn.outvars)
    frontier = nxt
  return found


def _to_f16(eqn: Any) -> bool:
  return (eqn.primitive.name == "convert_element_type"
          and np.dtype(eqn.params["new_dtype"]) == _F16)


def _alignment(eqn: Any) -> Union[str, None]:
  """Names the GEMM dims of a half dot/conv that are not multiples of 8."""
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "dot_general":
    (lhs_c, rhs_c), (_, rhs_b) = eqn.params["dimension_numbers"]
    dims = {
        "contracting size": math.prod(lhs[i] for i in lhs_c),
        "output features": math.prod(
            rhs[i] for i in range(len(rhs)) if i not in rhs_c and i not in rhs_b),
    }
  else:
    spec = eqn.params["dimension_numbers"]
    dims = {"input channels": lhs[spec.lhs_spec[1]], "output channels": rhs[spec.rhs_spec[0]]}
  bad = [f"{name} {size}" for name, size in dims.items() if size > 1 and size % 8]
  if not bad:
    return None
  return (f"{' and '.join(bad)} not a multiple of 8 in {_dtype(eqn.invars[0]).name}: "
          "tensor cores need multiples of 8 (pad the layer)")


def _lint_jaxpr(
    jaxpr: Any, roots: tuple[str, ...], findings: list[LintFinding], outer: Union[str, None]
) -> None:
  """Appends the findings of ``jaxpr``; ``outer`` is the source of the eqn holding it."""
  source = lambda eqn: _source(eqn, roots) or outer  # Sub-jaxprs may lack tracebacks.
  consumers = collections.defaultdict(list)
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        consumers[v].append(eqn)
  explained = set()  # Sums and logs already reported as part of a softmax.
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    in_dtype = _dtype(eqn.invars[0]) if eqn.invars else None
    if name == "exp" and in_dtype == _F16:
      sums = _reaches(eqn.outvars[0], consumers, _SHAPE_OPS,
                      lambda e: e.primitive.name in _REDUCTIONS)
      if sums:
        explained.update(id(e) for e in sums)
        for e in sums:  # logsumexp's log of the sum.
          explained.update(id(log) for log in _reaches(
              e.outvars[0], consumers, _SHAPE_OPS | {"abs"}, lambda e: e.primitive.name == "log"))
        findings.append(LintFinding(
            "softmax/logsumexp",
            "exp and its sum computed in float16: exp overflows above 11.1 and the result "
            "has 11 bits; cast the logits to float32 first",
            source(eqn)))
        continue
    if id(eqn) in explained:
      pass
    elif name in _F16_ELEMENTWISE and in_dtype == _F16:
      findings.append(LintFinding(name, _F16_ELEMENTWISE[name], source(eqn)))
    elif name in _REDUCTIONS:
      if in_dtype == _F16:
        reason = f"{name} accumulates in float16 (max 65504, 11-bit precision)"
      elif _reaches(eqn.outvars[0], consumers, _SCALE_OPS, _to_f16):
        reason = (f"{name} of float16 data returns float16 (max 65504): "
                  "reduce a float32 copy and keep the result in float32")
      else:
        reason = None
      if reason:
        findings.append(LintFinding(name, reason, source(eqn)))
    elif name in ("dot_general", "conv_general_dilated") and in_dtype in _HALF:
      reason = _alignment(eqn)
      if reason:
        findings.append(LintFinding(name, reason, source(eqn)))
    for sub in _subjaxprs(eqn.params):
      _lint_jaxpr(sub, roots, findings, source(eqn))


def precision_lint(
    fn: Callable[..., Any], *args: Any, policy: Union[policy_lib.Policy, str]
) -> list[LintFinding]:
  """Lists the operations of ``fn(*args)`` that are risky under ``policy``.

  The policy is applied as ``make_train_step`` applies it: ``args[0]`` (the
  params) is cast with ``policy.cast_to_compute``, keep rules included, and the
  floating leaves of every other argument (the batch) are cast to
  ``policy.compute_dtype``. The jaxpr of ``fn`` on those arguments
  (``jax.make_jaxpr``) is then read, sub-jaxprs (``jit``, ``custom_jvp``,
  ``scan``, ``cond``, ...) included. The rules:

  ======================================  =========================  ===========
  finding                                 when                       dtypes
  ======================================  =========================  ===========
  ``softmax/logsumexp``                   exp whose output is summed  f16
  ``exp`` ``exp2`` ``expm1`` ``log``      operand dtype               f16
  ``log1p``
  ``reduce_sum`` ``reduce_prod``          operand is f16, or the      f16
  ``cumsum`` ``cumprod`` ``cumlogsumexp``  result is cast back to f16
  ``dot_general``                         contracting size or output  f16, bf16
                                          features not a multiple
                                          of 8
  ``conv_general_dilated``                input or output channels    f16, bf16
                                          not a multiple of 8
  ``loss``                                the first output is an f16  f16
                                          scalar
  ======================================  =========================  ===========

  bfloat16 has float32's exponent range, so only the tensor-core alignment
  rule applies to it. ``jnp.sum``/``jnp.mean`` of an f16 array accumulate in
  float32 but return f16, which is what the "cast back" rule catches; a
  reduction that stays in float32 (Flax's normalisation statistics) is not
  flagged. Max/min reductions are exact and never flagged. Dimensions of size
  1 (matrix-vector products) are not flagged, nor is the row count of a
  matmul (the batch size). Each finding's source is the first stack frame
  outside jax, flax, optax, chex, equinox, haiku and jmp_lite.

  Args:
    fn: the function, typically ``loss_fn(params, batch)``.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    policy: a :class:`Policy` or a policy string for :func:`get_policy`.

  Returns:
    The findings, in program order.

  Raises:
    TypeError: if ``policy`` is neither a Policy nor a string.

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
  """
  if isinstance(policy, str):
    policy = policy_lib.get_policy(policy)
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy or a policy string, got {policy!r}")
  cast = [policy.cast_to_compute(args[0])] if args else []
  cast += [tree_utils.cast_floating(a, policy.compute_dtype) for a in args[1:]]
  closed = jax.make_jaxpr(fn)(*cast)
  jaxpr, roots, findings = closed.jaxpr, _library_roots(), []
  _lint_jaxpr(jaxpr, roots, findings, None)
  out = jaxpr.outvars[0] if jaxpr.outvars else None
  if out is not None and _dtype(out) == _F16 and out.aval.shape == ():
    producer = next((e for e in jaxpr.eqns if out in e.outvars), None)
    findings.append(LintFinding(
        "loss", "the loss is float16: cast it to float32 before reducing or scaling it",
        _source(producer, roots) if producer is not None else None))
  return findings

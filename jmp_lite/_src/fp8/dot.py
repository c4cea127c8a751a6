"""One matmul in FP8: quantise each operand with its own scale, multiply the float8 values.

:func:`fp8_dot_general` is ``lax.dot_general`` on float8 operands, with the
product in the half dtype and the two scales applied to it, and a custom VJP
whose two backward GEMMs are float8 GEMMs too. The float8 ``dot_general`` says
what it is, so XLA's GPU compiler emits an FP8 GEMM for it on every path
(cuBLASLt's ``__cublas$lt$matmul$f8``, or a Triton GEMM on float8 operands);
the earlier quantise-dequantise form depended on a pattern match that the
Triton GEMM fusion took first, and ran in bf16 (issue 28). Other backends
(XLA:CPU) run the float8 dot as an emulation: the same values, up to the
accumulation order.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jmp_lite._src.fp8 import groups as fp8_groups
from jmp_lite._src.fp8.recipe import Float8Recipe
from jmp_lite._src.fp8.recipe import float8_format

DotDimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]],
                            tuple[Sequence[int], Sequence[int]]]
Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]

_FORWARD_MODE_MSG = (
    "forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) of an FP8 matmul is "
    "not supported: its backward GEMMs quantise the cotangent, which has no linear "
    "forward-mode rule. Use reverse mode (jax.grad, jax.vjp, jax.jacrev), or autocast "
    "without fp8= for this function")
_SECOND_ORDER_MSG = (
    "second derivatives through an FP8 matmul (jax.grad of jax.grad, jax.hessian) are not "
    "supported: the backward pass reads the float8 operands, whose own derivatives "
    "are not defined. Differentiate once, or autocast without fp8= for this function")


def _wide(dtype: Any) -> np.dtype[Any]:
  """float32, or float64 for float64: the dtype scales and amaxes are computed in."""
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4), static_argnames=("groups",))  # One dispatch, not twenty, when eager.
def _scale(x: jax.Array, fmt: np.dtype[Any], margin: int, power_of_two: bool,
           axes: tuple[int, ...], amax: Any = None, groups: int = 1) -> jax.Array:
  """The scale of ``x`` over ``axes``, each group of rows apart (shape ``(groups, ...)``) if ``groups > 1``.

  ``amax``, when given, is ``x``'s, known before (issue 44). With groups the
  first axis is one of ``axes``: its ``groups`` blocks of rows are reduced
  apart (each device's own shard, :func:`fp8_groups.groups_of`).
  """
  wide = _wide(x.dtype)
  info = jnp.finfo(wide)
  shape = [1 if d in axes else n for d, n in enumerate(x.shape)]
  if groups > 1:
    blocks = jnp.abs(x.reshape((groups, x.shape[0] // groups) + x.shape[1:]))
    amax = jnp.max(blocks, axis=(1, *(d + 1 for d in axes if d)), keepdims=True, initial=0)
    amax = amax.reshape((groups,) + amax.shape[2:])
    shape = [groups] + shape[1:]
  elif amax is None:
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0)
  amax = jnp.broadcast_to(amax, shape)
  amax = amax.astype(x.dtype).astype(wide)  # exact
  s = amax * np.asarray(2.0 ** margin / float(jnp.finfo(fmt).max), wide)
  if power_of_two:  # The smallest power of two >= s.
    mantissa, exponent = jnp.frexp(s)
    s = jnp.where(jnp.isfinite(s), jnp.ldexp(
        np.asarray(1, wide), jnp.where(mantissa == 0.5, exponent - 1, exponent)), s)
  s = jnp.where(amax == 0, np.asarray(1, wide), s)
  # A normal value, so that 1 / s is finite; a non-finite s stays non-finite.
  return jnp.where(jnp.isfinite(s), jnp.clip(s, float(info.tiny), float(info.max)), s)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4), static_argnames=("groups",))
def _quantize(x: jax.Array, fmt: np.dtype[Any], margin: int, power_of_two: bool,
              axes: tuple[int, ...], amax: Any = None, groups: int = 1) -> tuple[jax.Array, jax.Array]:
  s = _scale(x, fmt, margin, power_of_two, axes, amax, groups=groups)
  fmax = np.asarray(jnp.finfo(fmt).max, s.dtype)
  inv = 1 / (fp8_groups.rows(s, 0, x.shape[0]) if x.ndim else s)
  q = lax.clamp(-fmax, x.astype(s.dtype) * inv, fmax)
  return q.astype(fmt), s


def _checked(x: ArrayLike, fmt: DTypeLike, margin: Any,
             power_of_two: Any) -> tuple[jax.Array, np.dtype[Any], int, bool, tuple[int, ...]]:
  """The arguments of :func:`scale_inv` and :func:`quantize`, checked and normalised."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be floating, got {x.dtype.name}")
  recipe = Float8Recipe(margin=margin, power_of_two=power_of_two)  # Validates both.
  return x, float8_format(fmt), recipe.margin, recipe.power_of_two, tuple(range(x.ndim))


def scale_inv(x: ArrayLike, fmt: DTypeLike, *, margin: int = 0,
              power_of_two: bool = False) -> jax.Array:
  """The dequantisation multiplier ``s`` of ``x`` for format ``fmt`` (per tensor).

  ``amax * 2**margin / fmax`` in float32 (float64 for float64 ``x``), 1 when
  ``amax == 0``, rounded up to a power of two if ``power_of_two``, and kept
  within float32's normal range so that ``1 / s`` is finite. A non-finite
  ``amax`` gives a non-finite result.

  Args:
    x: a floating array.
    fmt: a float8 format (see :data:`fp8.FLOAT8_DTYPES`).
    margin: headroom in powers of two (an int >= 0).
    power_of_two: round to a power of two.

  Returns:
    A float32 (or float64) scalar.

  Raises:
    TypeError: ``x`` is not floating, ``fmt`` is not a dtype, ``margin`` not
      an int or ``power_of_two`` not a bool.
    ValueError: ``fmt`` is not a float8 format, or ``margin`` is negative.

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([0.5, -896.0], jnp.bfloat16)
    >>> float(scale_inv(x, jnp.float8_e4m3fn)), float(scale_inv(x, "float8_e4m3fn", margin=2))
    (2.0, 8.0)
    >>> float(scale_inv(jnp.zeros(3), jnp.float8_e5m2)), scale_inv(x, jnp.float8_e5m2).dtype
    (1.0, dtype('float32'))
  """
  return _scale(*_checked(x, fmt, margin, power_of_two)).reshape(())


def quantize(x: ArrayLike, fmt: DTypeLike, *, margin: int = 0,
             power_of_two: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x`` in float8 format ``fmt``, scaled by its own ``amax``, and its scale.

  ``q = clip(x / s, -fmax, fmax).astype(fmt)`` with ``s = scale_inv(x, fmt,
  ...)``, computed in float32 (float64 for float64). The clip saturates finite
  values; a non-finite element makes ``s`` non-finite and ``q * s`` NaN.

  Args:
    x: a floating array.
    fmt: a float8 format.
    margin: headroom in powers of two (an int >= 0).
    power_of_two: use power-of-two scales.

  Returns:
    ``(q, s)``: ``q`` of dtype ``fmt`` and shape ``x.shape``, and the float32
    scalar that :func:`dequantize` multiplies by.

  Raises:
    TypeError, ValueError: as :func:`scale_inv`.

  Examples:
    >>> import jax.numpy as jnp
    >>> q, s = quantize(jnp.array([1e-6, -3e-6], jnp.float32), jnp.float8_e4m3fn)
    >>> q.dtype.name, q.tolist(), [round(v * 1e6, 3) for v in dequantize(q, s).tolist()]
    ('float8_e4m3fn', [144.0, -448.0], [0.964, -3.0])
    >>> jnp.array([1e-6, -3e-6]).astype(jnp.float8_e4m3fn).tolist()  # A plain cast.
    [0.0, -0.0]
  """
  q, s = _quantize(*_checked(x, fmt, margin, power_of_two))
  return q, s.reshape(())


def dequantize(q: jax.Array, s: jax.Array, dtype: DTypeLike | None = None) -> jax.Array:
  """``q * s`` in ``s``'s dtype, cast to ``dtype`` (default: ``s``'s).

  Examples:
    >>> import jax.numpy as jnp
    >>> dequantize(jnp.array([3.0, -0.5], jnp.float8_e5m2), jnp.float32(0.25)).tolist()
    [0.75, -0.125]
  """
  out = q.astype(s.dtype) * s
  return out if dtype is None else out.astype(dtype)


def _dimension_numbers(dimension_numbers: DotDimensionNumbers) -> Dims:
  """``dimension_numbers`` as nested tuples of ints, hashable for ``custom_vjp``."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))
  except (TypeError, ValueError) as e:
    raise TypeError("dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                    f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from e


def _free(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
  return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


def _to_output(s: jax.Array, contracting: Sequence[int], batch: Sequence[int],
               first: bool, n_other_free: int) -> jax.Array:
  """An operand's scale (its shape, 1 on contracting dims) laid out as the product's dims.

  The product's dims are the batch dims, the lhs free dims, the rhs free dims;
  ``first`` says whether this is the lhs. A per-tensor scale comes out as a
  scalar-like array of ones in every dim.
  """
  kept = [d for d in range(s.ndim) if d not in contracting]
  free = [d for d in kept if d not in batch]
  s = lax.squeeze(s, tuple(contracting))
  s = lax.transpose(s, tuple(kept.index(d) for d in (*batch, *free)))
  nb = len(batch)
  ones = (1,) * n_other_free
  shape = (s.shape[:nb] + s.shape[nb:] + ones) if first else (s.shape[:nb] + ones + s.shape[nb:])
  return s.reshape(shape)


def _scaled_dot(lhs: tuple[jax.Array, jax.Array], rhs: tuple[jax.Array, jax.Array], dims: Dims,
                precision: Any, out: np.dtype[Any]) -> jax.Array:
  """``dot(q_l, q_r) * s_l * s_r`` in dtype ``out``: the GEMM on float8 operands.

  The GEMM returns ``out`` directly for bfloat16 and wider dtypes; float16 gets a
  float32 product (a sum of float8 products can pass 65504 before it is
  scaled down), then scaled and rounded once. Where a scale varies along a
  contracted axis (rows scaled per group, contracted by a weight's gradient),
  the GEMM runs per group, each group's product scaled, and the groups
  summed in ``out``: under FSDP each device's group is its own shard, and the sum
  is the reduction the gradient's reduce-scatter does anyway.
  """
  (q_l, s_l), (q_r, s_r) = lhs, rhs
  (lc, rc), (lb, rb) = dims
  if q_l.ndim and 0 not in lc:
    s_l = fp8_groups.rows(s_l, 0, q_l.shape[0])
  if q_r.ndim and 0 not in rc:
    s_r = fp8_groups.rows(s_r, 0, q_r.shape[0])
  pair = fp8_groups.grouped_pair(s_l, s_r, dims)
  if pair is not None:
    a, b, g = pair
    (q_l, s_l), (q_r, s_r) = fp8_groups.split(q_l, s_l, a, g), fp8_groups.split(q_r, s_r, b, g)
    dims = ((tuple(d + 1 for d in lc), tuple(d + 1 for d in rc)),
            ((0, *(d + 1 for d in lb)), (0, *(d + 1 for d in rb))))
    (lc, rc), (lb, rb) = dims
  raw_dtype = np.dtype(jnp.float32) if out == np.dtype(jnp.float16) else out
  raw = lax.dot_general(q_l, q_r, dims, precision=precision, preferred_element_type=raw_dtype)
  n_l, n_r = len(_free(q_l.ndim, lc, lb)), len(_free(q_r.ndim, rc, rb))
  scale = _to_output(s_l, lc, lb, True, n_r) * _to_output(s_r, rc, rb, False, n_l)
  product = (raw.astype(scale.dtype) * scale).astype(out)
  # Each group's product in ``out``, summed in it: the partial products and the
  # reduce-scatter of FSDP's weight gradient, as without groups.
  return product.sum(axis=0, dtype=out) if pair else product


def _contracting_axes(ndim: int, contracting: Sequence[int], recipe: Float8Recipe) -> tuple[int, ...]:
  """The axes an operand's amax is taken over: all (tensorwise) or the contracting ones (rowwise)."""
  return tuple(contracting) if recipe.rowwise else tuple(range(ndim))


def _q(x: jax.Array, fmt: Any, recipe: Float8Recipe, contracting: Sequence[int],
       amax: Any = None, contracted_rows: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x`` quantised; per group of rows (:func:`fp8_groups.groups_of`) where its amax is not known.

  Tensorwise, an operand whose first axis the matmul contracts keeps one
  scale, unless ``contracted_rows`` (a backward operand, whose rows are the
  batch's): a weight-like operand split along its contraction would trade
  the weight's gather for a reduction of the product. Rowwise, the scales
  are per row already; only a backward operand whose rows the GEMM contracts
  (a weight gradient's) is reduced per group of them.
  """
  if recipe.rowwise:
    grouped = contracted_rows and 0 in contracting
  else:
    grouped = contracted_rows or 0 not in contracting
  n_groups = fp8_groups.groups_of(x) if amax is None and grouped else 1
  return _quantize(x, np.dtype(fmt), recipe.margin, recipe.power_of_two,
                   _contracting_axes(x.ndim, contracting, recipe), amax, groups=n_groups)


def _transposed(dims: Dims, lhs_ndim: int, rhs_ndim: int,
                wrt_lhs: bool) -> tuple[Dims, tuple[int, ...]]:
  """The GEMM ``dot(g, other)`` giving the gradient of one operand, and its permutation.

  For ``out = dot_general(x, y, dims)`` (dims: batch, x free, y free), the
  gradient of ``x`` (``wrt_lhs``) contracts ``g``'s y-free dims with ``y``'s free
  dims over the shared batch dims; its result's dims are the batch dims, the
  x free dims and x's contracting dims (in the order of ``y``'s), which the
  permutation puts back in ``x``'s order. The same with the roles swapped for ``y``.
  """
  (lc, rc), (lb, rb) = dims
  if not wrt_lhs:
    lc, rc, lb, rb, lhs_ndim, rhs_ndim = rc, lc, rb, lb, rhs_ndim, lhs_ndim
  nb = len(lb)
  x_free, y_free = _free(lhs_ndim, lc, lb), _free(rhs_ndim, rc, rb)
  if wrt_lhs:
    g_x, g_y = tuple(range(nb, nb + len(x_free))), tuple(range(nb + len(x_free), nb + len(x_free) + len(y_free)))
  else:
    g_y, g_x = tuple(range(nb, nb + len(y_free))), tuple(range(nb + len(y_free), nb + len(y_free) + len(x_free)))
  gemm: Dims = ((g_y, y_free), (tuple(range(nb)), tuple(rb)))
  result = (*lb, *x_free, *(lc[list(rc).index(d)] for d in sorted(rc)))
  return gemm, tuple(result.index(d) for d in range(lhs_ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_dot(lhs: jax.Array, rhs: jax.Array, amaxes: Any, dims: Dims, recipe: Float8Recipe,
             precision: Any, out: np.dtype[Any]) -> jax.Array:
  return _fp8_dot_fwd(lhs, rhs, amaxes, dims, recipe, precision, out)[0]


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))  # One dispatch when eager.
def _fp8_dot_fwd(lhs: jax.Array, rhs: jax.Array, amaxes: Any, dims: Dims, recipe: Float8Recipe,
                 precision: Any, out: np.dtype[Any]) -> tuple[jax.Array, Any]:
  (lc, rc), _ = dims
  q_l = _q(lhs, recipe.forward, recipe, lc, amaxes[0])
  q_r = _q(rhs, recipe.forward, recipe, rc, amaxes[1])
  product = _scaled_dot(q_l, q_r, dims, precision, out)
  # Tensorwise, the backward GEMMs reuse the float8 operands (half the bytes of
  # the half-dtype ones); rowwise, they rescale along other dims and requantise.
  # The operands' dtype travels as a zero-size array (residuals are arrays).
  residuals = (lhs, rhs) if recipe.rowwise else (q_l, q_r, jnp.zeros((0,), lhs.dtype))
  return product, (residuals, amaxes)


def _fp8_dot_bwd(dims: Dims, recipe: Float8Recipe, precision: Any, out: np.dtype[Any],
                 saved: Any, g: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
  del out
  residuals, amaxes = saved
  d_lhs, d_rhs = _first_order(_backward_gemms, dims, recipe, precision)(residuals, g)
  return d_lhs, d_rhs, jax.tree.map(jnp.zeros_like, amaxes)  # Amaxes carry no gradient.


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # One dispatch when eager.
def _backward_gemms(dims: Dims, recipe: Float8Recipe, precision: Any, residuals: Any,
                    g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two gradient GEMMs, each on float8 operands."""
  if recipe.rowwise:
    lhs, rhs = residuals
    dtype, l_ndim, r_ndim = lhs.dtype, lhs.ndim, rhs.ndim
  else:
    lhs, rhs, like = residuals
    dtype, l_ndim, r_ndim = like.dtype, lhs[0].ndim, rhs[0].ndim
  grads = []
  for wrt_lhs, other in ((True, rhs), (False, lhs)):
    gemm, perm = _transposed(dims, l_ndim, r_ndim, wrt_lhs)
    (g_contract, o_contract), _ = gemm
    q_g = _q(g, recipe.backward, recipe, g_contract, contracted_rows=True)
    q_o = _q(other, recipe.forward, recipe, o_contract, contracted_rows=True) if recipe.rowwise else other
    grads.append(lax.transpose(_scaled_dot(q_g, q_o, gemm, precision, np.dtype(dtype)), perm))
  return grads[0], grads[1]


def _first_order(fn: Any, *static: Any) -> Any:
  """``fn(*static, ...)`` that refuses to be differentiated (a second derivative)."""
  wrapped = jax.custom_jvp(functools.partial(fn, *static))

  def refuse(primals: Any, tangents: Any) -> Any:
    raise TypeError(_SECOND_ORDER_MSG)

  wrapped.defjvp(refuse)
  return wrapped


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: DotDimensionNumbers, *,
                    recipe: Float8Recipe, precision: Any = None,
                    preferred_element_type: DTypeLike | None = None,
                    amaxes: tuple[ArrayLike | None, ArrayLike | None] = (None, None)) -> jax.Array:
  """``lax.dot_general`` as an FP8 GEMM: float8 operands, scales applied to the product.

  Forward: each operand is quantised to ``recipe.forward`` with its own scale
  (per tensor, or per row of its free dimensions with
  ``scaling="rowwise"``), the GEMM multiplies the float8 values (``dot_general``
  with ``preferred_element_type`` = the half dtype) and the product is
  multiplied by the scales. Backward, two more FP8 GEMMs::

    g8 = quantize(g, recipe.backward)            # its own amax
    d_lhs = dot_general's VJP for lhs on (g8, rhs8), times the scales
    d_rhs = dot_general's VJP for rhs on (lhs8, g8), times the scales

  Tensorwise, the residuals are the float8 operands and their scales (half
  the bytes of half-dtype operands); rowwise, the half operands, requantised
  along each backward GEMM's own contracting dimensions. An all-zero operand
  gives exact zeros. A non-finite element in an operand makes every product
  it scales NaN, and the gradient that reads it too; one in the cotangent
  makes both gradients NaN. So a loss-scale skip still sees the overflow.
  Under ``vmap`` each example gets its own scale. Reverse-mode only: forward
  mode and second derivatives raise a ``TypeError`` that says so.

  Args:
    lhs: a floating array, usually of the half dtype (bfloat16 or float16).
    rhs: a floating array of the same dtype.
    dimension_numbers: as for ``lax.dot_general``: ``((lhs_contracting,
      rhs_contracting), (lhs_batch, rhs_batch))``.
    recipe: the formats and scale rule.
    precision: as for ``lax.dot_general``.
    preferred_element_type: the result dtype (default the operands' dtype);
      the gradients have the operands' dtype whatever it is.
    amaxes: ``(lhs amax, rhs amax)``, each ``None`` (reduce the operand, the
      default) or known before the matmul: ``max|operand|``, a scalar (per
      tensor), or with rowwise scaling the max over the operand's contracting
      dimensions (its shape, with 1 on those). The quantisation reads it
      instead of reducing the operand, so that under sharding the float8 cast
      runs on each shard, before the gather (issue 44). It is rounded to the
      operand's dtype and carries no gradient; the backward GEMMs reduce
      their own operands.

  Returns:
    The product, of dtype ``preferred_element_type`` or the operands' dtype.

  Raises:
    TypeError: ``recipe`` is not a :class:`Float8Recipe`, the operands are
      not floating or differ in dtype, ``dimension_numbers`` is malformed,
      or the call is differentiated in forward mode.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.array([[1.0, 2.0], [3.0, 1000.0]], jnp.bfloat16)
    >>> dn = (((1,), (0,)), ((), ()))
    >>> (x @ x).tolist()  # In bfloat16.
    [[7.0, 2000.0], [3008.0, 999424.0]]
    >>> fp8_dot_general(x, x, dn, recipe=Float8Recipe()).tolist()
    [[6.9375, 1952.0], [3072.0, 999424.0]]
    >>> [g.dtype.name for g in jax.grad(
    ...     lambda a, b: fp8_dot_general(a, b, dn, recipe=Float8Recipe()).sum(), (0, 1))(x, x)]
    ['bfloat16', 'bfloat16']
  """
  if not isinstance(recipe, Float8Recipe):
    raise TypeError(f"recipe must be a Float8Recipe, got {recipe!r}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if not (jnp.issubdtype(lhs.dtype, jnp.floating) and lhs.dtype == rhs.dtype):
    raise TypeError("fp8_dot_general takes two floating operands of one dtype, got "
                    f"{lhs.dtype.name} and {rhs.dtype.name}")
  out = np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)
  dims = _dimension_numbers(dimension_numbers)
  known = tuple(None if a is None else lax.stop_gradient(jnp.asarray(a)) for a in amaxes)
  try:
    return _fp8_dot(lhs, rhs, known, dims, recipe, precision, out)
  except TypeError as e:
    if "forward-mode" in str(e):
      raise TypeError(_FORWARD_MODE_MSG) from e
    raise

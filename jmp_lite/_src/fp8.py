"""FP8 matmuls with per-tensor current scaling (issue 23).

A :class:`Float8Recipe` says which float8 formats a matmul's operands and its
cotangent are quantised to; :func:`fp8_dot_general` is ``lax.dot_general`` on
operands quantised that way, with a custom VJP whose two backward GEMMs run on
quantised operands too. The scaling is *current* (each tensor's scale comes from
its own ``max|x|`` at the moment it is quantised) and *per tensor* (one scale
for the whole operand), so it is stateless: nothing to carry between steps.

Each dot is written as the pattern that XLA's GPU compiler rewrites into a
cuBLASLt FP8 GEMM (on Hopper and Ada GPUs): per operand
``convert(f8 -> half) * broadcast(scale_inv)`` feeding ``dot_general``. Other
backends run the same graph as an emulation: the values are rounded to float8
and the dot runs in the half dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

# Signed float8 formats by their jnp names (those this JAX lacks are skipped).
# float8_e8m0fnu is not one: it has no sign bit and no mantissa (a scale format).
_FLOAT8_NAMES = (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e3m4",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
)
FLOAT8_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(getattr(jnp, name)) for name in _FLOAT8_NAMES if hasattr(jnp, name))
_ALLOWED_FORMATS_MSG = "allowed formats: " + ", ".join(d.name for d in FLOAT8_DTYPES)
_AS_RECIPE_MSG = "fp8 must be None, False, True or a Float8Recipe"

DotDimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]],
                            tuple[Sequence[int], Sequence[int]]]


def float8_format(value: Any, name: str = "format") -> np.dtype[Any]:
  """``value`` as one of :data:`FLOAT8_DTYPES`, or a clear error.

  Args:
    value: a dtype-like naming a float8 format (``jnp.float8_e4m3fn``,
      ``"float8_e5m2"``, ...).
    name: what the value is, for the error message.

  Returns:
    The format as a ``np.dtype``.

  Raises:
    TypeError: ``value`` is not a dtype.
    ValueError: ``value`` is a dtype but not a signed float8 one.

  Examples:
    >>> float8_format("float8_e5m2")
    dtype(float8_e5m2)
  """
  try:
    dtype = np.dtype(value)
  except TypeError as e:
    raise TypeError(f"{name} must be a float8 dtype, got {value!r}; {_ALLOWED_FORMATS_MSG}") from e
  if dtype not in FLOAT8_DTYPES:
    raise ValueError(f"{name} must be a float8 dtype, got {dtype.name}; {_ALLOWED_FORMATS_MSG}")
  return dtype


def _scaling(margin: Any, power_of_two: Any) -> tuple[int, bool]:
  """``(margin, power_of_two)`` as an ``int >= 0`` and a ``bool``, or a clear error."""
  if isinstance(margin, (bool, np.bool_)) or not isinstance(margin, (int, np.integer)):
    raise TypeError(f"margin must be an int >= 0, got {margin!r}")
  if margin < 0:
    raise ValueError(f"margin must be an int >= 0, got {margin!r}")
  if not isinstance(power_of_two, (bool, np.bool_)):
    raise TypeError(f"power_of_two must be a bool, got {power_of_two!r}")
  return int(margin), bool(power_of_two)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
  """How :func:`fp8_dot_general` quantises: formats, margin, power-of-two scales.

  Per-tensor current scaling: each operand ``x`` (and the cotangent, in the
  backward pass) gets its own scale from its own ``amax``::

    amax = max|x|                                   (exact, then float32)
    scale = fmax(format) / amax / 2**margin         (1 when amax == 0)
    scale = 2**floor(log2(scale)) if power_of_two
    scale_inv = (1 / scale).astype(half)            # what the FP8 GEMM unscales by
    scale = 1 / scale_inv                           # so that the two agree
    q = clip(x * scale, -fmax, fmax).astype(format)   # quantise (saturating)
    x ~ q.astype(half) * scale_inv                    # dequantise

  The default is the "hybrid" recipe: e4m3 (more precision) for both forward
  operands, e5m2 (more range) for the cotangent.

  Attributes:
    forward: the format of both forward operands (default ``float8_e4m3fn``).
    backward: the format of the cotangent (default ``float8_e5m2``).
    margin: headroom in powers of two; a larger margin leaves room for
      outliers at the cost of precision near zero (an int >= 0).
    power_of_two: round each scale down to a power of two, so that scaling
      and unscaling are exact.

  The formats are stored as ``np.dtype``, so that a recipe hashes and can be
  static configuration (a ``jit`` static argument or a ``custom_vjp``
  non-differentiable argument).

  Raises:
    TypeError: a format is not a dtype, ``margin`` is not an int or
      ``power_of_two`` not a bool.
    ValueError: a format is not a float8 dtype, or ``margin`` is negative.

  Examples:
    >>> import jax.numpy as jnp
    >>> r = Float8Recipe(backward=jnp.float8_e4m3fn, margin=1)
    >>> r.forward.name, r.backward.name, r.margin, r.power_of_two
    ('float8_e4m3fn', 'float8_e4m3fn', 1, False)
    >>> r == Float8Recipe(backward="float8_e4m3fn", margin=1), hash(r) == hash(Float8Recipe())
    (True, False)
  """

  forward: DTypeLike = jnp.float8_e4m3fn
  backward: DTypeLike = jnp.float8_e5m2
  margin: int = 0
  power_of_two: bool = False

  def __post_init__(self) -> None:
    object.__setattr__(self, "forward", float8_format(self.forward, "forward"))
    object.__setattr__(self, "backward", float8_format(self.backward, "backward"))
    margin, power_of_two = _scaling(self.margin, self.power_of_two)
    object.__setattr__(self, "margin", margin)
    object.__setattr__(self, "power_of_two", power_of_two)


def as_recipe(fp8: Union[bool, Float8Recipe, None]) -> Union[Float8Recipe, None]:
  """The recipe that an ``fp8=`` argument means: ``None`` for off.

  Args:
    fp8: ``None`` or ``False`` (off), ``True`` (the default
      :class:`Float8Recipe`) or a recipe (itself).

  Returns:
    A :class:`Float8Recipe`, or ``None``.

  Raises:
    TypeError: ``fp8`` is anything else (a string, a dtype, ``1``, ...).

  Examples:
    >>> as_recipe(False) is None, as_recipe(True) == Float8Recipe()
    (True, True)
  """
  if fp8 is None or fp8 is False:
    return None
  if fp8 is True:
    return Float8Recipe()
  if isinstance(fp8, Float8Recipe):
    return fp8
  raise TypeError(f"{_AS_RECIPE_MSG}, got {fp8!r}")


def _wide(dtype: np.dtype[Any]) -> np.dtype[Any]:
  """float32, or float64 for float64: the dtype scales are computed in."""
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def _to_dtype(v: jax.Array, dtype: np.dtype[Any]) -> jax.Array:
  """Positive ``v`` rounded to the nearest normal value of ``dtype``; non-finite stays so.

  Normal values round with a relative error of at most half an ulp, so that a
  scale derived from the result overshoots ``fmax`` by that much at most
  (which the quantisation clip absorbs).
  """
  info = jnp.finfo(dtype)
  clipped = jnp.clip(v, float(info.tiny), float(info.max))
  return jnp.where(jnp.isfinite(v), clipped, v).astype(dtype)


_STATIC = (1, 2, 3, 4)  # fmt, margin, power_of_two, dtype


@functools.partial(jax.jit, static_argnums=_STATIC)  # One dispatch, not twenty, when eager.
def _scale_inv(x: jax.Array, fmt: np.dtype[Any], margin: int, power_of_two: bool,
               out: np.dtype[Any]) -> jax.Array:
  wide = _wide(out)
  fmax = float(jnp.finfo(fmt).max)
  amax = jnp.max(jnp.abs(x), initial=0).astype(wide)  # The max is exact in any dtype.
  inv = amax * np.asarray(2.0 ** margin / fmax, wide)
  if power_of_two:  # The smallest power of two >= inv.
    mantissa, exponent = jnp.frexp(inv)
    inv = jnp.where(jnp.isfinite(inv), jnp.ldexp(
        np.asarray(1, wide), jnp.where(mantissa == 0.5, exponent - 1, exponent)), inv)
  inv = jnp.where(amax == 0, np.asarray(1, wide), inv)
  return _to_dtype(inv, out)


@functools.partial(jax.jit, static_argnums=_STATIC)
def _quantize(x: jax.Array, fmt: np.dtype[Any], margin: int, power_of_two: bool,
              out: np.dtype[Any]) -> tuple[jax.Array, jax.Array]:
  inv = _scale_inv(x, fmt, margin, power_of_two, out)
  wide = _wide(out)
  fmax = np.asarray(jnp.finfo(fmt).max, wide)
  scaled = lax.clamp(-fmax, x.astype(wide) * (1 / inv.astype(wide)), fmax)
  return scaled.astype(fmt), inv


def _checked(x: ArrayLike, fmt: DTypeLike, margin: Any, power_of_two: Any,
             dtype: DTypeLike | None) -> tuple[jax.Array, np.dtype[Any], int, bool, np.dtype[Any]]:
  """The arguments of :func:`scale_inv` and :func:`quantize`, checked and normalised."""
  x = jnp.asarray(x)
  out = np.dtype(x.dtype if dtype is None else dtype)
  if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(out, jnp.floating)):
    raise TypeError(f"x and dtype must be floating, got {x.dtype.name} and {out.name}")
  return (x, float8_format(fmt), *_scaling(margin, power_of_two), out)


def scale_inv(x: ArrayLike, fmt: DTypeLike, *, margin: int = 0, power_of_two: bool = False,
              dtype: DTypeLike | None = None) -> jax.Array:
  """The dequantisation multiplier ``1 / scale`` of ``x`` for format ``fmt``.

  ``amax * 2**margin / fmax`` (1 when ``amax == 0``), rounded up to a power of
  two if ``power_of_two``, then rounded to the nearest normal value of
  ``dtype`` (the dequantisation dtype), so that quantising with its reciprocal
  and dequantising with it agree. A non-finite ``amax`` gives a non-finite
  result. For float16, whose smallest normal is ``2**-14``, an ``amax`` below
  ``fmax * 2**-14`` no longer fills the float8 range; the float8 values keep
  all their mantissa bits down to float16's own subnormals, so the precision
  that float16 has is kept.

  Args:
    x: a floating array.
    fmt: a float8 format (see :data:`FLOAT8_DTYPES`).
    margin: headroom in powers of two (an int >= 0).
    power_of_two: round to a power of two.
    dtype: the dtype of the result (default ``x.dtype``).

  Returns:
    A scalar of ``dtype``.

  Raises:
    TypeError: ``x`` or ``dtype`` is not floating, ``fmt`` is not a dtype,
      ``margin`` not an int or ``power_of_two`` not a bool.
    ValueError: ``fmt`` is not a float8 format, or ``margin`` is negative.

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([0.5, -896.0], jnp.bfloat16)
    >>> float(scale_inv(x, jnp.float8_e4m3fn)), float(scale_inv(x, "float8_e4m3fn", margin=2))
    (2.0, 8.0)
    >>> float(scale_inv(jnp.zeros(3), jnp.float8_e5m2))
    1.0
  """
  return _scale_inv(*_checked(x, fmt, margin, power_of_two, dtype))


def quantize(x: ArrayLike, fmt: DTypeLike, *, margin: int = 0, power_of_two: bool = False,
             dtype: DTypeLike | None = None) -> tuple[jax.Array, jax.Array]:
  """``x`` in float8 format ``fmt``, scaled by its own ``amax``, and ``1 / scale``.

  ``q = clip(x * scale, -fmax, fmax).astype(fmt)`` with ``scale = 1 /
  scale_inv(x, fmt, ...)``, computed in float32 (float64 for float64). The
  clip saturates finite values; a non-finite element makes ``amax`` and so the
  scale non-finite, and every element of ``q`` NaN.

  Args:
    x: a floating array.
    fmt: a float8 format (see :data:`FLOAT8_DTYPES`).
    margin: headroom in powers of two (an int >= 0).
    power_of_two: use power-of-two scales.
    dtype: the dtype to dequantise to (default ``x.dtype``).

  Returns:
    ``(q, scale_inv)``: ``q`` of dtype ``fmt`` and shape ``x.shape``, and the
    scalar multiplier of dtype ``dtype`` that :func:`dequantize` applies.

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
  return _quantize(*_checked(x, fmt, margin, power_of_two, dtype))


def dequantize(q: jax.Array, scale_inv: jax.Array) -> jax.Array:
  """``q.astype(scale_inv.dtype) * scale_inv``: the f8 pattern of an FP8 GEMM operand.

  Args:
    q: a float8 array.
    scale_inv: a scalar multiplier (from :func:`quantize`), in the dtype to
      dequantise to.

  Returns:
    An array of ``scale_inv.dtype`` and ``q.shape``.

  Examples:
    >>> import jax.numpy as jnp
    >>> dequantize(jnp.array([3.0, -0.5], jnp.float8_e5m2), jnp.float16(0.25)).tolist()
    [0.75, -0.125]
  """
  wide = lax.convert_element_type(q, scale_inv.dtype)
  return lax.mul(wide, lax.broadcast(scale_inv, q.shape))


def _dimension_numbers(dimension_numbers: DotDimensionNumbers) -> DotDimensionNumbers:
  """``dimension_numbers`` as nested tuples of ints, hashable for ``custom_vjp``."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))
  except (TypeError, ValueError) as e:
    raise TypeError("dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                    f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from e


def _quantized(x: jax.Array, fmt: np.dtype[Any], recipe: Float8Recipe,
               dtype: np.dtype[Any]) -> tuple[jax.Array, jax.Array]:
  return _quantize(x, fmt, recipe.margin, recipe.power_of_two, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DotDimensionNumbers,
             recipe: Float8Recipe, precision: Any, preferred_element_type: Any) -> jax.Array:
  out, _ = _fp8_dot_fwd(lhs, rhs, dimension_numbers, recipe, precision, preferred_element_type)
  return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))  # One dispatch when eager.
def _fp8_dot_fwd(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DotDimensionNumbers,
                 recipe: Float8Recipe, precision: Any,
                 preferred_element_type: Any) -> tuple[jax.Array, Any]:
  fmt = np.dtype(recipe.forward)
  lhs_q, lhs_s = _quantized(lhs, fmt, recipe, lhs.dtype)
  rhs_q, rhs_s = _quantized(rhs, fmt, recipe, rhs.dtype)
  out = lax.dot_general(dequantize(lhs_q, lhs_s), dequantize(rhs_q, rhs_s), dimension_numbers,
                        precision=precision, preferred_element_type=preferred_element_type)
  return out, (lhs_q, lhs_s, rhs_q, rhs_s)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _fp8_dot_bwd(dimension_numbers: DotDimensionNumbers, recipe: Float8Recipe, precision: Any,
                 preferred_element_type: Any, residuals: Any,
                 g: jax.Array) -> tuple[jax.Array, jax.Array]:
  del preferred_element_type  # The backward GEMMs return the operands' dtype.
  lhs_q, lhs_s, rhs_q, rhs_s = residuals
  lhs, rhs = dequantize(lhs_q, lhs_s), dequantize(rhs_q, rhs_s)  # The f8 pattern again.
  g_q, g_s = _quantized(g, np.dtype(recipe.backward), recipe, lhs.dtype)
  g = dequantize(g_q, g_s)
  dot = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers,
                          precision=precision)
  (d_lhs,) = jax.linear_transpose(lambda x: dot(x, rhs), lhs)(g)  # Two GEMMs, no forward one.
  (d_rhs,) = jax.linear_transpose(lambda y: dot(lhs, y), rhs)(g)
  return d_lhs, d_rhs


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: DotDimensionNumbers, *,
                    recipe: Float8Recipe, precision: Any = None,
                    preferred_element_type: DTypeLike | None = None) -> jax.Array:
  """``lax.dot_general`` on operands quantised to float8 by ``recipe``.

  Forward: each operand is quantised to ``recipe.forward`` with its own scale
  and dequantised (``convert(f8 -> dtype) * broadcast(scale_inv)``, the
  pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM), then
  multiplied. The residuals are the float8 operands and their scales (half
  the bytes of half-dtype operands). Backward, two more FP8 GEMMs::

    g8 = quantize(g, recipe.backward)                 # its own amax
    d_lhs = dot_general's VJP for lhs (dequantize(g8), dequantize(rhs8))
    d_rhs = dot_general's VJP for rhs (dequantize(lhs8), dequantize(g8))

  Scaling is per tensor and current (see :class:`Float8Recipe`). An all-zero
  operand gives exact zeros. A non-finite element in an operand makes the
  whole product NaN (its amax, and so its scale, is not finite), and the
  gradient that reads that operand too; one in the cotangent makes both
  gradients NaN. So a loss-scale skip still sees the overflow. Under ``vmap``
  each example gets its own scale.

  Args:
    lhs: a floating array, usually of the half dtype (bfloat16 or float16).
    rhs: a floating array of the same dtype.
    dimension_numbers: as for ``lax.dot_general``: ``((lhs_contracting,
      rhs_contracting), (lhs_batch, rhs_batch))``.
    recipe: the formats and scale rule.
    precision: as for ``lax.dot_general``.
    preferred_element_type: the result dtype (default the operands' dtype);
      the gradients have the operands' dtype whatever it is.

  Returns:
    The product, of dtype ``preferred_element_type`` or the operands' dtype.

  Raises:
    TypeError: ``recipe`` is not a :class:`Float8Recipe`, the operands are
      not floating or differ in dtype, or ``dimension_numbers`` is malformed.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.array([[1.0, 2.0], [3.0, 1000.0]], jnp.bfloat16)
    >>> dn = (((1,), (0,)), ((), ()))
    >>> (x @ x).tolist()  # In bfloat16.
    [[7.0, 2000.0], [3008.0, 999424.0]]
    >>> fp8_dot_general(x, x, dn, recipe=Float8Recipe()).tolist()
    [[6.96875, 1952.0], [3088.0, 999424.0]]
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
  pet = None if preferred_element_type is None else np.dtype(preferred_element_type)
  return _fp8_dot(lhs, rhs, _dimension_numbers(dimension_numbers), recipe, precision, pet)

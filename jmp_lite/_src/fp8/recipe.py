"""FP8 recipes: which float8 formats, which scaling, and which matmuls (issues 23, 28, 30).

A :class:`Float8Recipe` is static configuration: the formats of a matmul's
operands and of its cotangent, the scale rule (per tensor or per row, with a
margin and power-of-two rounding) and the steering of autocast's FP8 rule (keep
rules by parameter path, a minimum GEMM size). :mod:`fp8_dot` runs one matmul
with a recipe; :mod:`autocast_fp8` decides which matmuls of a function do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Union

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_lite._src import policy as policy_lib

# Signed float8 formats by their jnp names (those this JAX lacks are skipped).
# float8_e8m0fnu is not one: it has no sign bit and no mantissa (a scale format).
_FLOAT8_NAMES = (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e3m4",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
)
FLOAT8_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(getattr(jnp, name)) for name in _FLOAT8_NAMES if hasattr(jnp, name))
SCALINGS = ("tensorwise", "rowwise")
# The default minimum GEMM size: on an H100, one linear layer's three GEMMs are
# estimated to run faster in FP8 than in bf16 from M = K = N = 4096, and slower
# below (python -m benchmarks.fp8_sizes; see Float8Recipe.min_size, docs/fp8.md).
MIN_SIZE = 4096
_ALLOWED_FORMATS_MSG = "allowed formats: " + ", ".join(d.name for d in FLOAT8_DTYPES)
_AS_RECIPE_MSG = "fp8 must be None, False, True or a Float8Recipe"


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


def _int(value: Any, name: str) -> int:
  """``value`` as an ``int >= 0`` (NumPy ints included, bools not), or a clear error."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int >= 0, got {value!r}")
  if value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")
  return int(value)


def _bool(value: Any, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
  return bool(value)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
  """How autocast's matmuls run in FP8: formats, scaling, and which matmuls.

  Current scaling: each operand ``x`` (and the cotangent, in the backward
  pass) gets its scale from its own ``amax`` at the moment it is quantised,
  so nothing is carried between steps::

    amax = max|x|             over the whole tensor ("tensorwise"), or over the
                              contracting dimensions, one per row ("rowwise")
    s = amax * 2**margin / fmax(format)       (float32; 1 where amax == 0)
    s = 2**ceil(log2(s)) if power_of_two
    q = clip(x / s, -fmax, fmax).astype(format)            # saturating
    x @ y ~ dot(q_x, q_y, preferred_element_type=half) * s_x * s_y

  The dot runs on the float8 operands themselves (an FP8 GEMM on Hopper and
  Ada GPUs); the scales multiply its product. Backward, the cotangent ``g``
  is quantised to ``backward`` and both gradients are FP8 GEMMs too (each
  rescaled along its own contracting dimensions when rowwise).

  The default is the "hybrid" recipe: e4m3 (more precision) for both forward
  operands, e5m2 (more range) for the cotangent, one scale per tensor.

  Attributes:
    forward: the format of both forward operands (default ``float8_e4m3fn``).
    backward: the format of the cotangent (default ``float8_e5m2``).
    margin: headroom in powers of two; a larger margin leaves room for
      outliers at the cost of precision near zero (an int >= 0).
    power_of_two: round each scale up to a power of two, so that scaling
      and unscaling are exact.
    scaling: ``"tensorwise"`` (one scale per operand) or ``"rowwise"`` (one
      per row of the lhs and per column of the rhs: an outlier row costs only
      its own row's precision).
    min_size: a matmul runs in FP8 only when its lhs free size, rhs free size
      and contracting size (batch dimensions excluded) are each >= this; the
      others run in the half dtype (an int >= 0; 0 runs every matmul in FP8).
      The default, 4096 (:data:`MIN_SIZE`), is where FP8 starts to pay on an
      H100: for one linear layer's forward and two backward GEMMs, the
      program XLA compiles for an H100 is estimated (a roofline of its
      kernels, not a timing) at 0.87-0.93x the bf16 time at M = K = N = 4096
      and 1.03-1.12x at 3072, 1.5-1.6x at 2048: the amax reductions,
      quantisations and rescales that FP8 adds move bytes that only large
      GEMMs earn back (``python -m benchmarks.fp8_sizes``, ``docs/fp8.md``).
      The rule is conservative for a GEMM with one small size and two large
      ones (16384 x 16384 x 2048 is estimated to pay). Sizes that are not
      multiples of 16 need no rule: XLA pads them to multiples of 16 for
      cuBLASLt's FP8 GEMM, and Triton's FP8 GEMMs take them as they are.
    keep: rules for matmuls kept in the half dtype: a regex (``re.search``
      on a leaf's ``/``-joined path, as :class:`Policy`'s ``keep_full``) or a
      callable ``(path, leaf) -> bool``. A matmul is kept when an operand
      comes (through casts, reshapes, transposes, broadcasts) from an argument
      leaf a rule selects.

  A recipe is hashable, so it can be static configuration (a ``jit`` static
  argument or a ``custom_vjp`` non-differentiable argument).

  Raises:
    TypeError: a format is not a dtype, ``margin``/``min_size`` is not an int,
      ``power_of_two`` not a bool, ``scaling`` not a string, or a keep rule
      is neither a string nor a callable.
    ValueError: a format is not a float8 dtype, ``margin``/``min_size`` is
      negative, ``scaling`` is unknown, or a keep regex does not compile.

  Examples:
    >>> import jax.numpy as jnp
    >>> r = Float8Recipe(backward=jnp.float8_e4m3fn, margin=1)
    >>> r.forward.name, r.backward.name, r.margin, r.power_of_two, r.scaling
    ('float8_e4m3fn', 'float8_e4m3fn', 1, False, 'tensorwise')
    >>> r == Float8Recipe(backward="float8_e4m3fn", margin=1), hash(r) == hash(Float8Recipe())
    (True, False)
    >>> Float8Recipe(keep="Dense_0", scaling="rowwise", min_size=64).keep
    ('Dense_0',)
    >>> Float8Recipe().min_size  # FP8 from 4096 on; min_size=0 for every matmul
    4096
  """

  forward: DTypeLike = jnp.float8_e4m3fn
  backward: DTypeLike = jnp.float8_e5m2
  margin: int = 0
  power_of_two: bool = False
  scaling: str = "tensorwise"
  min_size: int = MIN_SIZE
  keep: Union[policy_lib.KeepRule, Iterable[policy_lib.KeepRule]] = ()

  def __post_init__(self) -> None:
    object.__setattr__(self, "forward", float8_format(self.forward, "forward"))
    object.__setattr__(self, "backward", float8_format(self.backward, "backward"))
    object.__setattr__(self, "margin", _int(self.margin, "margin"))
    object.__setattr__(self, "power_of_two", _bool(self.power_of_two, "power_of_two"))
    object.__setattr__(self, "min_size", _int(self.min_size, "min_size"))
    if not isinstance(self.scaling, str):
      raise TypeError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
    if self.scaling not in SCALINGS:
      raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
    object.__setattr__(self, "keep", policy_lib.keep_rules(self.keep))

  @property
  def rowwise(self) -> bool:
    """Whether the scales are per row (``scaling="rowwise"``)."""
    return self.scaling == "rowwise"


def as_recipe(fp8: Union[bool, Float8Recipe, None]) -> Union[Float8Recipe, None]:
  """The recipe that an ``fp8=`` argument means: ``None`` for off.

  Args:
    fp8: ``None`` or ``False`` (off), ``True`` (the default
      :class:`Float8Recipe`; NumPy bools too) or a recipe (itself).

  Returns:
    A :class:`Float8Recipe`, or ``None``.

  Raises:
    TypeError: ``fp8`` is anything else (a string, a dtype, ``1``, ...); the
      message names its type.

  Examples:
    >>> import numpy as np
    >>> as_recipe(False) is None, as_recipe(True) == Float8Recipe(), as_recipe(np.True_).margin
    (True, True, 0)
  """
  if fp8 is None or (isinstance(fp8, (bool, np.bool_)) and not fp8):
    return None
  if isinstance(fp8, (bool, np.bool_)):
    return Float8Recipe()
  if isinstance(fp8, Float8Recipe):
    return fp8
  raise TypeError(f"{_AS_RECIPE_MSG}, got {fp8!r} of type {type(fp8).__name__}")

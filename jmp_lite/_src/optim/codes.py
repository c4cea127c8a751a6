"""Block-wise 8-bit codes: arithmetic encoders and decoders, one float32 scale per block.

Every code here is a few element-wise operations and two reductions (the
block's largest magnitude and its smallest value), so XLA fuses the decode
into the optimizer update and the encode after it: no table, no
``searchsorted``, no gather. A block is ``block_size`` consecutive elements
(see :mod:`jmp_lite._src.optim.quantize`). Codes are stored as uint8.

**The sign comes from the values, per block, at every encode.** A block
with a negative value is coded with the format's signed code; a block of
non-negative values (a second moment, a sum of squares, or a momentum that
happens to be positive there) with the finer non-negative code. The mode
costs no byte: it is the sign of the block's float32 scale ``a`` (its
largest ``|x|``)::

  int8,   signed    x = a * t |t|,  t = int8(q) / 127            (scale -a)
  float8, signed    x = a * e3m4(q) / 15.5                       (scale -a)
  non-negative      x = a * r(q)**2                              (scale +a)
                    r(q) = min(L(q), B(q), A(q)),  L(q) = (q + 1.25) / 256.25
                    B(q) = f32_bits(q * 2**18 + kB),  A(q) = f32_bits(q * 2**19 + kA)

``r`` is ``sqrt(x / a)``: linear from code 120 (0.47) to 255, with steps of
0.39-0.82%; below, ``B`` reads ``q`` as float32 bits with 5 mantissa bits
(32 codes an octave, steps of 1.6-3.1%) down to 0.17 at code 70, and ``A``
with 4 (16 codes an octave, steps of 3.3-6.1%) down to 0.008 at code 1:
``v`` from the block's largest down to 6.3e-5 of it. Code 0 is 0. ``kB``
and ``kA`` make the pieces meet at codes 120 and 70; each piece lies under
the others in its range, so the minimum picks it (the 1.25 lifts the line
above ``A`` at the lowest codes).

**Rounding is stochastic and unbiased**: each value is coded as one of its
two neighbouring codes, the upper one with the probability that makes
``E[decode(encode(x))] = x`` (for the non-negative code, in ``x``, not in
its square root). Round to the nearest code has fixed points: an
exponential moving average whose change in a step is under half a code
keeps its code for ever, so a momentum whose gradient became 0 kept moving
(int8 codes 1-9 are fixed points of a 0.9 decay) and a coded ``v`` never
forgot a large gradient (steps 79x float32 Adam's smaller after a 100x
drop). Unbiased, a moving average follows its input on average, and 0 is
the only fixed point of a decay. The draws (24 bits) are a Weyl sequence per element
(:func:`jmp_lite._src.optim.coded.dither`): a random phase from
:func:`jmp_lite._src.masters.hashed_bits`, the counter-based hash of each
element's index that stochastic bfloat16 rounding uses (seeded by the
leaf's number), advanced by 2**32 over the golden ratio at each update.
Each draw is uniform, so the rounding is unbiased; along the updates an
element's draws are spread evenly, so its rounding errors do not add up as
a random walk in a moving average (on a block of gradients of 1 and 6.7e-8,
Adam's largest step fell from 2.2x float32's with independent draws to 1.9x).
Outside a code's range: 0 codes as 0; a signed value under the smallest
non-zero code (``a / 127**2`` for int8) codes 0, so a decaying momentum
reaches 0 (float8's e3m4 subnormals are linear from 0 and round without
bias down to it); a non-negative value
under code 1 rounds to 0 or to code 1 without bias, except in a leaf the
update divides by (``never_zero``: Adam's ``v``), where it rounds up to
code 1, so that the update never divides by ``eps`` alone.

**Why the non-negative code has this shape.** Adam steps by ``m /
sqrt(v)``, and ``v``'s moving average (``b2 = 0.999``) is coded anew at every
update, so each element's coded ``v`` wanders around its float32 value by a
few of its code's steps: the steps at an element's level, not the range,
set how far its updates stray. Measured on the oracle benchmark
(``benchmarks.optim_oracle``), coding ``v`` made nearly all of int8's drift
(coding ``m`` alone drifted 0.44-0.55x torchao's ``AdamW8bit``, ``v`` alone
1.2-2.5x). The previous code spent 87 of its codes on the range below 0.029
(``r`` down to 8.4e-9, steps of 12-25%), and elements there stepped up to
2.47x float32 Adam's in the mixed-magnitude sweep; this one spends them on
finer steps down to 0.008, and a ``v`` under that rounds up (a smaller step,
never a larger one). The top stays linear because parameter drift follows
the step there.

The decode is integer multiplies and adds, two bitcasts, a multiplication
and minima, with one ``where`` on the block's mode: the update decodes the
state in each of its passes (:mod:`jmp_lite._src.optim.passes`: the block
scales, then the codes), so a cheap decode keeps the passes cheap.
``"float8"`` differs from ``"int8"`` only in its signed code, float8_e3m4
(a sign bit, 3 exponent and 4 mantissa bits: steps of 3.1-6.25% from 1/62
of the block's largest up, linear below, down to 1e-3 of it; its 16 inf and
NaN codes go unused). It decodes with one conversion: a decode of a few
more integer operations, or a select on the sign bit, made XLA:GPU keep the
padded leaves' new state in float32 (an H100 update temp of 9.6 MiB on a
padded 1000x1000 matrix, against 1.9).
e4m3 (3 mantissa bits, steps of 6.25-12.5%, down to 4e-6) was its code
until stop 53 and drifted as far as torchao's ``AdamWFp8`` on three problems
of the oracle matrix: float8's drift is mostly ``m``'s. Its non-negative
blocks use the code above (e4m3 of ``sqrt(v)`` reaches only ``2**-17.8`` of
the block's largest, and MS-AMP's ablation saw an FP8 ``v`` diverge).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.optim import codes4

FORMATS = ("int8", "float8", "int4")
# Elements per block a format codes by default, with float32 scales. For int4 this is the
# block of a leaf the update divides by (Adam's v); its other leaves (Adam's m) are coded
# in blocks of INT4_MOMENT_BLOCK with bfloat16 scales: 2 + 0.5 + 2/32 + 0.5 + 4/256 = 3.08
# bytes per parameter with bf16 masters. Screened on benchmarks.optim_oracle's 13
# problems (4 seeds; the worst mean drift over torchao AdamW4bit's, then the median): both
# in 128 (AdamW4bit's layout), 1.04x; m in 64 and v in 128 (stop 54), 1.005x, 0.71x; m in
# 32 and v in 256, 0.991x (0.974-0.991x over five draw sequences), 0.71x; m in 32 and v in
# 128, 0.974x, but 3.094 bytes (3.10-3.12 on the benchmark models); v's scales in bfloat16
# (3.078 bytes) broke the tests of a forgetting v and of the largest step (a block's
# largest v no longer codes exactly); power-of-two scales for m cost 0.03-0.07x everywhere.
# Blocks of 32 fuse on XLA:GPU since codes4 packs neighbouring codes (before, a 1024 x 1024
# update's temp was 5.3 MiB at 32 against 1.2 at 64); benchmarks.studies.int4_layouts.
DEFAULT_BLOCK_SIZE = {"int8": 256, "float8": 256, "int4": 256}
INT4_MOMENT_BLOCK = 32


def codes_per_byte(fmt: str) -> int:
  """How many codes of format ``fmt`` one stored byte holds (2 for ``"int4"``)."""
  return 2 if fmt == "int4" else 1

_U24 = 2.0**-24  # Uniform draws in [0, 1) from the hash's top 24 bits.

# The non-negative code (see the module docstring): the decoded sqrt(v / a) of
# code q is min(L(q), B(q), A(q)). L is the line (q + _LINE_C) / (255 +
# _LINE_C), 1 at code 255; B and A read an integer affine in q as float32 bits:
# B steps 2**18 (5 mantissa bits, 32 codes an octave) and meets the line at
# code _TOP_FROM; A steps 2**19 (4 bits, 16 codes an octave) and meets B at
# code _MID_FROM. _LINE_C lifts the line above A at the lowest codes, where
# q / 255 would have been the smallest piece (steps of 2x and 1.5x).
_TOP_FROM = 120
_MID_FROM = 70
_LINE_C = 1.25
_B_SHIFT = 18  # 23 - B's mantissa bits
_A_SHIFT = 19  # 23 - A's mantissa bits


def _f32_bits(x: float) -> int:
  return int(np.array(x, np.float32).view(np.int32))


_B_OFFSET = _f32_bits((_TOP_FROM + _LINE_C) / (255.0 + _LINE_C)) - (_TOP_FROM << _B_SHIFT)
_A_OFFSET = _B_OFFSET + (_MID_FROM << _B_SHIFT) - (_MID_FROM << _A_SHIFT)


def _as_f32(i: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(i, jnp.float32)


def _root_of_code(q: jax.Array) -> jax.Array:
  """``sqrt(v / a)`` of the non-negative codes ``q`` (int32): integer ops, two bitcasts, minima.

  No ``where``, ``exp`` or ``floor``: the update decodes in each of its
  passes (:mod:`jmp_lite._src.optim.passes`).
  """
  line = (q + _LINE_C * jnp.minimum(q, 1)).astype(jnp.float32) * (1.0 / (255.0 + _LINE_C))
  mid = _as_f32(q * (1 << _B_SHIFT) + _B_OFFSET)
  low = _as_f32(q * (1 << _A_SHIFT) + _A_OFFSET)
  return jnp.minimum(line, jnp.minimum(mid, low))


def _pick(lo: jax.Array, below: jax.Array, above: jax.Array, x: jax.Array,
          u: jax.Array) -> jax.Array:
  """``lo`` or ``lo + 1``, the second with the probability that makes the decoded value ``x`` on average."""
  width = above - below
  p = (x - below) / jnp.where(width > 0, width, 1.0)
  return lo + (u < p).astype(lo.dtype)


def _encode_non_negative(y: jax.Array, u: jax.Array, never_zero: bool) -> jax.Array:
  """Codes (int32 in ``[0, 255]``) of ``y = v / a`` in ``[0, 1]``, unbiased in ``y``.

  With ``never_zero``, ``y > 0`` under code 1 rounds up to it instead.
  """
  s = jnp.sqrt(y)
  s_bits = jax.lax.bitcast_convert_type(s, jnp.int32)
  lo = jnp.maximum(jnp.floor(s * (255.0 + _LINE_C) - _LINE_C).astype(jnp.int32),
                   jnp.maximum((s_bits - _B_OFFSET) >> _B_SHIFT, (s_bits - _A_OFFSET) >> _A_SHIFT))
  lo = jnp.clip(lo, 0, 254)
  below, above = _root_of_code(lo) ** 2, _root_of_code(lo + 1) ** 2
  q = _pick(lo, below, above, y, u)
  return jnp.where(y > 0, jnp.maximum(q, 1), 0) if never_zero else q


def _encode_companded(y: jax.Array, u: jax.Array) -> jax.Array:
  """int8 codes ``q`` of ``y`` in ``[-1, 1]`` decoding to ``(q/127) |q/127|``, unbiased."""
  m = jnp.abs(y)
  lo = jnp.minimum(jnp.floor(127.0 * jnp.sqrt(m)), 126.0)
  below, above = (lo * (1.0 / 127.0)) ** 2, ((lo + 1.0) * (1.0 / 127.0)) ** 2
  q = jnp.where(lo > 0, _pick(lo, below, above, m, u), 0.0)  # Under code 1: towards 0.
  return (jnp.sign(y) * q).astype(jnp.int8)


_E3M4_MAX = 15.5  # float8_e3m4's largest; its smallest normal is 0.25, its smallest subnormal 2**-6


def _encode_e3m4(y: jax.Array, u: jax.Array) -> jax.Array:
  """float8_e3m4 codes (as uint8) of ``15.5 y``, ``y`` in ``[-1, 1]``, rounded without bias.

  The spacing of e3m4 around ``z`` is ``2**(exponent(z) - 4)`` (4 mantissa
  bits), or ``2**-6`` under its smallest normal 0.25; ``floor(z / spacing +
  u) * spacing`` is then exact in e3m4 (the cast rounds nothing), the upper
  neighbour with the probability that keeps the mean, down to 0.
  """
  z = jnp.abs(y) * _E3M4_MAX
  exponent = jax.lax.bitcast_convert_type(z, jnp.int32) & 0x7F800000
  spacing = _as_f32(jnp.maximum(exponent, _f32_bits(0.25)) - (4 << 23))
  r = jnp.minimum(jnp.floor(z / spacing + u) * spacing, _E3M4_MAX)
  return jax.lax.bitcast_convert_type((jnp.sign(y) * r).astype(jnp.float8_e3m4), jnp.uint8)


def _signed_to_bits(codes: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(codes, jnp.uint8)


def block_scales(x: jax.Array) -> jax.Array:
  """The scales :func:`encode` gives float32 blocks ``x``: each block's largest ``|x|``, negated
  for a block with a negative value (coded with the signed code)."""
  x = x.astype(jnp.float32)
  a = jnp.max(jnp.abs(x), axis=-1)
  return jnp.where(jnp.min(x, axis=-1) < 0, -a, a)


_BF16_MAX_BITS = 0x7F7F0000  # bfloat16's largest finite value, as float32 bits
_F32_INF_BITS = 0x7F800000


def stored_scales(scales: jax.Array, dtype: Any) -> jax.Array:
  """Float32 ``scales`` (from :func:`block_scales`) as ``dtype`` holds them, still float32.

  ``bfloat16`` scales are rounded up in magnitude, so that no value of a block
  lies beyond its scale and the codes, made against the rounded scale, are
  unbiased; ``float32`` ones are returned as they are. An infinite or NaN
  scale stays so, and one beyond bfloat16's largest becomes it.

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> np.asarray(stored_scales(jnp.array([1.0, -1.001, 3.4e38]), jnp.bfloat16)).tolist()
    [1.0, -1.0078125, 3.3895313892515355e+38]
  """
  if np.dtype(dtype) == np.dtype(np.float32):
    return scales
  if np.dtype(dtype) != np.dtype(jnp.bfloat16):
    raise ValueError(f"block scales are float32 or bfloat16, got {np.dtype(dtype)}")
  bits = jax.lax.bitcast_convert_type(jnp.abs(scales), jnp.int32)
  up = jnp.minimum((bits + 0xFFFF) & jnp.int32(-0x10000), _BF16_MAX_BITS)
  up = jax.lax.bitcast_convert_type(jnp.where(bits >= _F32_INF_BITS, bits, up), jnp.float32)
  return jnp.where(scales < 0, -up, up)


def encode(x: jax.Array, fmt: str, bits: jax.Array, never_zero: bool = True,
           scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Codes of float32 blocks ``x`` (shape ``(..., blocks, block_size)``) and their scales.

  Args:
    x: the blocks.
    fmt: ``"int8"`` or ``"float8"``: the code of blocks with a negative value;
      ``"int4"``: the 4-bit codes of :mod:`jmp_lite._src.optim.codes4`.
    bits: uniform ``uint32`` draws of ``x``'s shape (``masters.hashed_bits``),
      fresh at each encode.
    never_zero: a non-zero value of a non-negative block never codes 0 (for a
      leaf the update divides by); otherwise one under the smallest code rounds
      to it or to 0 without bias.
    scales: the blocks' :func:`block_scales`, when the caller has them (from
      another computation of the same ``x``).

  Returns:
    ``(codes, scales)``: uint8 codes of ``x``'s shape (for ``"int4"``, two a
      byte: the last axis halved), and float32 scales of
    shape ``x.shape[:-1]``: the block's largest ``|x|``, negated for a block
    coded with the signed code.
  """
  scales = block_scales(x) if scales is None else scales
  codes = encode_elements(x, scales[..., None], fmt, bits, never_zero)
  return (codes4.pack(codes) if fmt == "int4" else codes), scales


def encode_elements(x: jax.Array, scales: jax.Array, fmt: str, bits: jax.Array,
                    never_zero: bool = True) -> jax.Array:
  """The codes of float32 values ``x``, each given its block's scale: element-wise.

  :func:`encode` without the reduction: ``scales`` (from
  :func:`block_scales`) broadcasts against ``x``, so the caller can code in
  any layout of the elements, such as the leaf's own shape. A value beyond
  its block's scale codes as the scale's.

  Returns:
    the codes, of ``x``'s shape: uint8 for the 8-bit formats, int32 codes in
    ``[0, 15]`` for ``"int4"`` (unpacked; :func:`codes4.pack` packs them).
  """
  x = x.astype(jnp.float32)
  a, signed = jnp.abs(scales), scales < 0
  y = x * jnp.where(a > 0, 1.0 / jnp.where(a > 0, a, 1.0), 0.0)
  u = (bits >> 8).astype(jnp.float32) * _U24
  if fmt == "int4":
    return codes4.encode(y, signed, u, never_zero)
  signed_code = _encode_e3m4(y, u) if fmt == "float8" else _signed_to_bits(_encode_companded(y, u))
  non_negative = _encode_non_negative(jnp.maximum(y, 0.0), u, never_zero).astype(jnp.uint8)
  return jnp.where(signed, signed_code, non_negative)


def decode(codes: jax.Array, scales: jax.Array, fmt: str) -> jax.Array:
  """Float32 blocks from :func:`encode`'s ``codes`` and ``scales``."""
  s = scales[..., None].astype(jnp.float32)
  if fmt == "int4":
    return jnp.abs(s) * codes4.decode(codes, s < 0)
  if fmt == "float8":
    signed = jax.lax.bitcast_convert_type(codes, jnp.float8_e3m4).astype(jnp.float32) * (
        1.0 / _E3M4_MAX)
  else:
    t = jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32) * (1.0 / 127.0)
    signed = t * jnp.abs(t)
  root = _root_of_code(codes.astype(jnp.int32))
  return jnp.abs(s) * jnp.where(s < 0, signed, root * root)

"""Block-wise 4-bit codes, two to a byte: arithmetic encoders and decoders, one scale per block.

The ``"int4"`` format of :mod:`jmp_lite._src.optim.quantize`. As in the
8-bit codes (:mod:`jmp_lite._src.optim.codes`), the mode of a block is the
sign of its scale ``a`` (its largest ``|x|``; float32, or bfloat16 rounded up for a
momentum), chosen from its values
at every encode, and the rounding is stochastic and unbiased, with draws from
:func:`jmp_lite._src.optim.coded.dither`. Both codes are "bit lines":
a code ``q`` read as the bits of a float32, two codes an octave (one mantissa
bit) down to ``1/4`` (signed) or ``2**-6`` (non-negative) of the block's
largest and one an octave below, so the decode is an
integer shift, an add, two bitcasts and a minimum (no table, no ``exp``)::

  signed (m)        x = a * sign * s(k),   nibble = sign << 3 | k,  k in 0..7   (scale -a)
                    s(k) = 0, 1/16, 1/8, 1/4, 3/8, 1/2, 3/4, 1
  non-negative (v)  x = a * n(q),          q in 0..15                            (scale +a)
                    n(q) = 0, 2**-8, 2**-7, 2**-6, 3/128, 1/32, ..., 3/16, 1/4, 3/8, 1/2, 3/4, 1

**Why these levels.** Adam steps by ``m / sqrt(v)``. An element whose
``v`` sits under the non-negative code's smallest level ``2**-8`` of its
block's largest is rounded up to it (never to 0: no division by eps), so its
``sqrt(v)`` is read as at least ``2**-4`` of the block's largest; the
signed code's smallest level is the same ``2**-4`` of the block's largest
``|m|``, so a momentum rounded up to its smallest level never meets a
``sqrt(v)`` rounded further down than it. Above the floors, neighbouring
levels are 1.33-1.5x apart in ``m`` from 1/4 up (2x below) and 1.15-1.22x in
``sqrt(v)`` from ``2**-6`` of ``v`` up (1.41x below). Measured on four
problems of ``benchmarks.optim_oracle`` (one seed each; MLPs, a CNN, a
Transformer), this pair drifted 0.58-0.83x as far as torchao's ``AdamW4bit``
from float32 AdamW, against 0.54-1.01x for octave steps below ``1/2``
(floors 1/32 and ``2**-10``) and 0.72-0.92x for half-octave steps throughout
(floors 1/8 and ``2**-7``).

**Rounding.** Each value is coded as one of its two neighbouring levels, the
upper with the probability that makes the decoded value right on average.
"Upper" is on the signed line: a value rounds towards ``+1`` when its draw
``u`` is under that probability, whatever its sign. An element's draws run
along a Weyl sequence over the updates (:func:`jmp_lite._src.optim.coded.dither`),
so its rounding errors alternate evenly instead of adding up; rounding the
magnitude instead (away from 0 when ``u`` is under the probability) reversed
the direction of a momentum's errors each time it changed sign and broke that
evenness. Measured on the 13 problems of ``benchmarks.optim_oracle`` (4
seeds), the signed line lowered int4's drift from float32 AdamW on 12 of them
(by 2-4%; the worst ratio over torchao's ``AdamW4bit`` 1.07x -> 1.04x).
0 is a level of both codes, and a value under the smallest non-zero level
is rounded to 0 or to it without bias, so a decaying momentum decays to 0
(its only fixed point) without a bias towards it on the way, whatever the
sign of its block; except that a non-zero value of a non-negative block of a
leaf the update divides by (``never_zero``, from the update's jaxpr:
Adam's ``v``) rounds up to the smallest level (biased up, the safe side for
``v``: no division by eps).

**Why not finer steps for ``v``.** As for the 8-bit codes, ``v`` is coded
anew at every update and wanders by a few of its code's steps, so finer
steps lower the drift; at 4 bits they cost range. Screened on the 13
problems of ``benchmarks.optim_oracle`` (two seeds each), geometric codes
of 1.22-1.30x steps (floors 0.03-0.06 of the block's largest ``v``) lowered
the worst drift over torchao's ``AdamW4bit`` from 1.06x to 0.96-1.00x, and
raised the final held-out losses: 2**(1/3) steps (floor 0.039) ended the
CNN problems 15-19% and the digits MLP 8% above float32 AdamW's (this code:
within 0.4%, 1.1% and 3.3%), since every ``v`` under the floor reads as the
floor and its element steps slower. This code keeps the range.

**Packing.** A block of ``B`` codes is stored in ``B / 2`` bytes: the code
of element ``2j`` in the low nibble of byte ``j`` and that of element
``2j + 1`` in its high nibble. Packing casts the codes to ``uint4`` and
bitcasts each pair to a byte; unpacking bitcasts back (XLA emits the
shifts and masks), inside the fused update. Until stop 55, elements ``j``
and ``j + B / 2`` shared a byte (two slices, a shift and an or; unpacked
with a concatenation): XLA:GPU then could not see that the update reads
and writes each byte at the same place, kept a copy of the old codes, and
with rows of 6 or 18 blocks (a 768-wide leaf) wrote the unpacked int32
codes to buffers; the H100 update temp of the 134M Transformer of
``benchmarks.optim_state`` fell from 86 MiB (stop 54) to 27 (optax AdamW's: 94).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_SIGN = 8  # The signed nibble's sign bit; its magnitude is the low three bits.
_MIRROR = 1.0 - 2.0**-24  # u -> _MIRROR - u maps the draws' grid in [0, 1) onto itself.


def _f32_bits(x: float) -> int:
  return int(np.array(x, np.float32).view(np.int32))


def _as_f32(i: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(i, jnp.float32)


class _BitLine:
  """Levels ``0`` and ``min(B(q), A(q))`` for ``q`` in ``1..top``, with ``B(top) = 1``.

  ``B`` reads ``q * 2**22`` as float32 bits (two codes an octave) and ``A``
  ``q * 2**23`` (one an octave); they meet at code ``fine_from``, above which
  ``B`` lies under ``A`` and below which ``A`` lies under ``B``.
  """

  def __init__(self, top: int, fine_from: int):
    self.top = top
    self.b_offset = _f32_bits(1.0) - (top << 22)
    self.a_offset = self.b_offset + (fine_from << 22) - (fine_from << 23)

  def level(self, q: jax.Array) -> jax.Array:
    """The level of codes ``q`` (int32 in ``[0, top]``), as a fraction of the block's largest."""
    line = jnp.minimum(_as_f32(q * (1 << 22) + self.b_offset),
                       _as_f32(q * (1 << 23) + self.a_offset))
    return jnp.where(q > 0, line, 0.0)

  def encode(self, y: jax.Array, u: jax.Array) -> jax.Array:
    """Codes (int32 in ``[0, top]``) of ``y`` in ``[0, 1]``, rounded without bias in ``y``."""
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    lo = jnp.maximum((bits - self.b_offset) >> 22, (bits - self.a_offset) >> 23)
    lo = jnp.clip(lo, 0, self.top - 1)
    below, above = self.level(lo), self.level(lo + 1)
    p = (y - below) / (above - below)
    return lo + (u < p).astype(jnp.int32)


_SIGNED = _BitLine(7, 3)  # 1/16 .. 1
_NON_NEGATIVE = _BitLine(15, 3)  # 2**-8 .. 1
FLOOR = 2.0**-8  # The non-negative code's smallest non-zero level.


def encode(y: jax.Array, signed: jax.Array, u: jax.Array, never_zero: bool = True) -> jax.Array:
  """4-bit codes of values ``y`` already divided by their block's largest ``|x|``.

  :func:`jmp_lite._src.optim.codes.encode_elements` computes the block's
  scale, its mode and the uniform draws, as for the 8-bit formats, and
  calls this; :func:`pack` puts two codes in a byte.

  Args:
    y: float32 values in ``[-1, 1]``.
    signed: bool, broadcasting against ``y``: the values of blocks coded with
      the signed code.
    u: uniform draws in ``[0, 1)`` of ``y``'s shape, multiples of ``2**-24``.
    never_zero: a non-zero value of a non-negative block never codes 0 (it
      rounds up to the smallest level: a leaf the update divides by);
      otherwise a value under the smallest level rounds to it or to 0
      without bias, as in a signed block.

  Returns:
    int32 codes in ``[0, 15]``, of ``y``'s shape.

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> y = jnp.array([[0.0, 0.5, -1.0, 0.25]])
    >>> packed = pack(encode(y, jnp.array([[True]]), jnp.zeros((1, 4))))
    >>> packed.shape, np.asarray(decode(packed, jnp.array([[True]]))).tolist()
    ((1, 2), [[0.0, 0.5, -1.0, 0.25]])
  """
  # Rounded on the signed line: a negative value rounds towards 0 when u is under the
  # fraction that a positive one rounds away from it (see "Rounding" above).
  k = _SIGNED.encode(jnp.minimum(jnp.abs(y), 1.0), jnp.where(y < 0, _MIRROR - u, u))
  signed_codes = k | jnp.where((y < 0) & (k > 0), _SIGN, 0)
  q = _NON_NEGATIVE.encode(jnp.clip(y, 0.0, 1.0), u)
  non_negative = jnp.where(y > 0, jnp.maximum(q, 1), 0) if never_zero else q
  return jnp.where(signed, signed_codes, non_negative)


def decode(codes: jax.Array, signed: jax.Array) -> jax.Array:
  """Blocks in ``[-1, 1]`` (fractions of the block's largest) from :func:`encode`'s packed codes."""
  return levels(unpack(codes), signed)


def levels(c: jax.Array, signed: jax.Array) -> jax.Array:
  """The values in ``[-1, 1]`` of unpacked codes ``c`` (int32), ``signed`` as :func:`encode`'s."""
  magnitude = _SIGNED.level(c & (_SIGN - 1))
  return jnp.where(signed, jnp.where((c & _SIGN) > 0, -magnitude, magnitude),
                   _NON_NEGATIVE.level(c))


def pack(codes: jax.Array) -> jax.Array:
  """uint8 bytes of int32 codes in ``[0, 15]``, two a byte along the last (even) axis.

  Element ``2j`` goes to the low nibble of byte ``j``, element ``2j + 1`` to
  its high nibble: a cast to ``uint4`` and a bitcast of each pair to a byte,
  which XLA fuses into the encode and, reading the old codes the same way,
  lets the update write the new codes over them (:func:`unpack`).

  Examples:
    >>> import jax.numpy as jnp
    >>> packed = pack(jnp.array([1, 2, 15, 4]))
    >>> packed.tolist(), unpack(packed).tolist()
    ([33, 79], [1, 2, 15, 4])
  """
  pairs = codes.astype(jnp.uint4).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return jax.lax.bitcast_convert_type(pairs, jnp.uint8)


def unpack(packed: jax.Array) -> jax.Array:
  """int32 codes from :func:`pack`'s bytes: the last axis doubled."""
  pairs = jax.lax.bitcast_convert_type(packed, jnp.uint4)
  return pairs.astype(jnp.int32).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))

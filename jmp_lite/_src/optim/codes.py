"""Block-wise 8-bit codes: arithmetic encoders and decoders, one float32 scale per block.

Every code here is a few element-wise operations and one reduction (the
block's maximum), so XLA fuses the decode into the optimizer update and the
encode after it: no table, no ``searchsorted``, no gather. A block is
``block_size`` consecutive elements (see :mod:`jmp_lite._src.optim.quantize`).

Three codes: two for signed state, one for non-negative state::

  int8,   signed        q = round(127 * sign(x) * sqrt(|x| / a))      int8    a = max |x|
                        x = a * (q/127) * |q/127|
  float8, signed        q = e4m3(x * 448 / a)                       e4m3    a = max |x|
                        x = q * a / 448
  non-negative          y = sqrt(x) / b,  b = max sqrt(x)           uint8   (either format)
                        y = q/255                                   q >= 48  (y >= y0 = 0.188)
                        y = y0 (q/48)**8                            q < 48, rounded up
                        x = (b * y)**2

The signed int8 code is companded (square root), so that small momenta keep
a few bits of relative precision down to ``a / 127**2``. Non-negative state
(Adam's second moment ``v``) is coded on ``sqrt(v)``, what the update divides
by, in two pieces that share the code's 256 values:

- **the top of the block** (``y`` from 0.188 to 1, codes 48 to 255), linear,
  with steps of 0.39% at the top and 2.1% at its foot. Adam's parameter drift
  follows this step almost linearly: the block's scale moves every step, so
  each step's rounding error is new, and ``v``'s moving average adds them up,
  about ``1 / sqrt(1 - b2**2) = 22x`` one step's error for ``b2 = 0.999``.
  Codes ``(q/255)**p`` with powers 3, 2, 1.5 and 1.25 drifted 3.8%, 2.1%,
  1.5% and 1.2% from float32 AdamW on the oracle benchmark's MLP (``v``
  coded alone); 3 was this code's first version.
- **the tail** (codes 1 to 47, ``y`` below 0.188, steps of 18% at its top,
  24% at 1e-2, 45% at 1e-4, 100% at 1e-6), rounded **up**. A block that mixes
  gradients of 1 and 1e-6 holds ``sqrt(v)`` from 1 to 1e-6; a code that
  rounds the small ones to zero (torchao's ``AdamW8bit``) or well below
  their value makes the next update divide a fresh momentum by too little, up
  to ``(1 - b1) / sqrt(1 - b2) = 3.2`` learning rates once bias correction has
  faded. Rounded to the nearest code, the tail's errors add up in ``v``'s
  moving average like the top's but in coarse steps, and Adam's steps
  reached 1.6x float32's largest. Rounded up, the largest step stays within
  1.10x float32's at every ratio measured (0.2 to 1e-6). The slack (a value
  within a tenth of a code above one keeps that code) matters: rounded
  strictly up, every small fall of the block's scale moved the tail up a
  code, and its ``sqrt(v)`` settled at 2.9x float32's (steps a third of
  float32's); with the slack, at 1.1-1.4x (``tests/test_quantize_state.py``).

The decode is multiplications only, so that XLA:GPU can recompute it in
both fusions that read the decoded state (the block maximum and the new
codes); see :func:`_decode_non_negative`.
``"float8"`` codes only signed state in e4m3; its non-negative state uses
this code too (e4m3 of ``sqrt(v)`` reaches only ``2**-17.8`` of the block's
largest, and MS-AMP's ablation saw an FP8 ``v`` diverge).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "float8")

_E4M3_MAX = 448.0


def _safe_inverse(a: jax.Array) -> jax.Array:
  """``1 / a``, or 0 where ``a`` is 0 (an all-zero block codes to zeros)."""
  return jnp.where(a > 0, 1.0 / jnp.where(a > 0, a, 1.0), 0.0)


# The non-negative code (see the module docstring): codes _TOP_FROM..255 are
# q/255; codes 0.._TOP_FROM-1 are _TOP_FOOT (q/_TOP_FROM)**8.
_TOP_FROM = 48
_TOP_FOOT = _TOP_FROM / 255.0  # 0.188
# The tail rounds up unless a value lies within this fraction of a code above
# one: see the module docstring for why not 0.
_CEIL_SLACK = 0.1


def _encode_non_negative(y: jax.Array) -> jax.Array:
  """Codes (float32, integral) of ``y = sqrt(v) / max`` in ``[0, 1]``."""
  top = jnp.round(255.0 * y)
  u = jnp.sqrt(jnp.sqrt(jnp.sqrt(y * (1.0 / _TOP_FOOT))))  # (y / _TOP_FOOT) ** (1/8)
  tail = jnp.clip(jnp.ceil(_TOP_FROM * u - _CEIL_SLACK), 1.0, _TOP_FROM)
  return jnp.where(y >= _TOP_FOOT, top, jnp.where(y > 0, tail, 0.0))


def _decode_non_negative(q: jax.Array) -> jax.Array:
  """``y`` in ``[0, 1]`` from :func:`_encode_non_negative`'s codes (float32).

  Five multiplications and a minimum (the tail's power is below the line
  under code 48 and above it over), no ``where``: the decoded state feeds
  both the block maximum and the codes of the update's new state, and XLA:GPU
  recomputes a producer this cheap in each of its fusions, where it keeps a
  costlier one in a float32 buffer of the leaf. With ``exp``, ``sqrt``,
  ``floor`` or a power-of-two bitcast here the benchmark Transformer's update
  needed 2.12-2.66 MB of temp, against optax AdamW's 2.11; a ``where``
  between a quadratic top and this tail fused there but not on the CNN's
  small leaves. (Code 48 rather than 64 for the foot of the line: the
  benchmark MLP drifted 1.66% rather than 1.94%; at 32 the largest step
  on a 1 / 1e-2 block grew to 1.24x float32's.)
  """
  q2 = q * q
  q4 = q2 * q2
  return jnp.minimum(q * (1.0 / 255.0), (_TOP_FOOT * float(_TOP_FROM) ** -8) * (q4 * q4))


def encode(x: jax.Array, fmt: str, non_negative: bool) -> tuple[jax.Array, jax.Array]:
  """Codes of float32 blocks ``x`` (shape ``(..., blocks, block_size)``) and their scales.

  Returns:
    ``(codes, scales)``: codes of ``x``'s shape (int8, uint8 or float8_e4m3fn), and
    float32 scales of shape ``x.shape[:-1]``.
  """
  x = x.astype(jnp.float32)
  if non_negative:
    x = jnp.maximum(x, 0.0)  # A rounding error of the inner update must not reach sqrt.
    # The block's largest sqrt(v) as sqrt of its largest v: a cheaper reduction,
    # which XLA:GPU fuses with the inner update.
    a = jnp.sqrt(jnp.max(x, axis=-1, keepdims=True))
    x = jnp.sqrt(x)
  else:
    a = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  y = x * _safe_inverse(a)
  if fmt == "float8" and not non_negative:
    codes = (y * _E4M3_MAX).astype(jnp.float8_e4m3fn)
  elif non_negative:
    codes = _encode_non_negative(y).astype(jnp.uint8)
  else:
    codes = jnp.round(127.0 * jnp.sign(y) * jnp.sqrt(jnp.abs(y))).astype(jnp.int8)
  return codes, a[..., 0]


def decode(codes: jax.Array, scales: jax.Array, fmt: str, non_negative: bool) -> jax.Array:
  """Float32 blocks from :func:`encode`'s ``codes`` and ``scales``."""
  a = scales[..., None]
  if fmt == "float8" and not non_negative:
    y = codes.astype(jnp.float32) * (1.0 / _E4M3_MAX)
  elif non_negative:
    y = _decode_non_negative(codes.astype(jnp.float32))
  else:
    t = codes.astype(jnp.float32) * (1.0 / 127.0)
    y = t * jnp.abs(t)
  x = y * a
  if not non_negative:
    return x
  return x * x

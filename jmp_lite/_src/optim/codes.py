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
  non-negative          s = sqrt(x); b = max s                      uint8   (either format)
                        q = round(255 * (s / b)**(1/3))
                        x = (b * (q/255)**3)**2

The signed int8 code is companded (square root), so that small momenta keep
a few bits of relative precision down to ``a / 127**2``. Non-negative state
(Adam's second moment ``v``) is coded on ``sqrt(v)``, what the update divides
by, through a cube root: a block that mixes gradients of 1 and 1e-6 holds
``v`` from 1 to 1e-12, and a code that rounds the small ``v`` to zero makes
the next update divide a fresh momentum by ``sqrt((1 - b2) g**2)``, about 3x
the step once bias correction has faded. ``(q/255)**3`` reaches ``6e-8`` of
the block's largest ``sqrt(v)`` (``v`` down to ``4e-15`` of its largest) and
keeps 1.2% steps at the top, where most of a block's values sit.

Why not coarser steps at the top (a log code, or e4m3 of ``v**(1/4)``, both
measured): the scale moves every step, so each step's rounding error is new,
and ``v``'s moving average adds them up, about ``1 / sqrt(1 - b2**2) = 22x``
one step's error for ``b2 = 0.999``. With 9% steps in ``sqrt(v)`` (a log
code of 8 steps per binade) single elements' ``v`` wandered from 0.5x to 1.7x
their float32 values and Adam's steps reached 1.4x float32's largest; with
this code, 1.12x (``tests/test_quantize_state.py``). ``"float8"`` therefore
codes only signed state in e4m3; its non-negative state uses this code too.
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


def _cube_root(y: jax.Array) -> jax.Array:
  """``y ** (1/3)`` for ``y`` in ``[0, 1]``: a bit-pattern guess and two Newton steps.

  Relative error below 2e-6, far under the code's 1/255 steps. For the CPU
  only: XLA:CPU's ``cbrt`` costs about 50 ns per element (50x a
  multiply-add), which made the CPU update 7x optax's. On a GPU ``cbrt`` is
  one fast instruction, and this form (an integer division and a loop)
  stopped XLA:GPU from fusing the encode: compiled for an H100, the
  Transformer benchmark's update then needed a float32 buffer of its largest
  leaf (2.03 MiB of temp, against 0.05 MiB with ``cbrt``). :func:`encode`
  picks one per platform (``lax.platform_dependent``).
  """
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  r = jax.lax.bitcast_convert_type(bits // np.uint32(3) + np.uint32(709921077), jnp.float32)
  for _ in range(2):
    r = r - (r * r * r - y) / (3.0 * r * r)
  return jnp.where(y > 0, r, 0.0)


def encode(x: jax.Array, fmt: str, non_negative: bool) -> tuple[jax.Array, jax.Array]:
  """Codes of float32 blocks ``x`` (shape ``(..., blocks, block_size)``) and their scales.

  Returns:
    ``(codes, scales)``: codes of ``x``'s shape (int8, uint8 or float8_e4m3fn), and
    float32 scales of shape ``x.shape[:-1]``.
  """
  x = x.astype(jnp.float32)
  if non_negative:
    x = jnp.maximum(x, 0.0)  # A rounding error of the inner update must not reach sqrt.
    x = jnp.sqrt(x)
  a = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  y = x * _safe_inverse(a)
  if fmt == "float8" and not non_negative:
    codes = (y * _E4M3_MAX).astype(jnp.float8_e4m3fn)
  elif non_negative:
    codes = jnp.round(255.0 * jax.lax.platform_dependent(y, cpu=_cube_root, default=jnp.cbrt)).astype(jnp.uint8)
  else:
    codes = jnp.round(127.0 * jnp.sign(y) * jnp.sqrt(jnp.abs(y))).astype(jnp.int8)
  return codes, a[..., 0]


def decode(codes: jax.Array, scales: jax.Array, fmt: str, non_negative: bool) -> jax.Array:
  """Float32 blocks from :func:`encode`'s ``codes`` and ``scales``."""
  a = scales[..., None]
  if fmt == "float8" and not non_negative:
    y = codes.astype(jnp.float32) * (1.0 / _E4M3_MAX)
  elif non_negative:
    t = codes.astype(jnp.float32) * (1.0 / 255.0)
    y = t * t * t
  else:
    t = codes.astype(jnp.float32) * (1.0 / 127.0)
    y = t * jnp.abs(t)
  x = y * a
  if not non_negative:
    return x
  return x * x

"""A coded optimizer-state leaf: :class:`QuantizedArray`, and coding a float32 leaf into one.

Blocks of ``block_size`` elements run along the leaf's last axis when it is
a multiple of ``block_size``, else over the flattened, zero-padded leaf; each
block has one float32 scale and is coded by
:mod:`jmp_lite._src.optim.codes` (or :mod:`jmp_lite._src.optim.codes4`, two
codes a byte), with stochastic rounding that draws from :func:`dither`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src import masters
from jmp_lite._src.optim import codes as codes_lib
from jmp_lite._src.optim import codes4


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """One state leaf in 8 or 4 bits: codes, one scale per block, and how to decode them.

  A pytree: ``codes`` and ``scales`` are its children; the rest is static.

  Attributes:
    codes: uint8 codes. The leaf's own shape when its last axis is a
      multiple of ``block_size`` (blocks run along it); otherwise
      ``(blocks, block_size)`` over the flattened, zero-padded leaf. For
      ``"int4"`` two codes share a byte: the leaf's own shape (a scalar's:
      one block) with the last axis halved, rounded up (a zero code pads an
      odd one), element ``2j`` of a row in the low nibble of byte ``j`` and
      ``2j + 1`` in its high nibble.
    scales: one per block (``codes.shape[:-1] + (blocks,)`` or
      ``(blocks,)``), float32 (bfloat16 for ``"int4"``'s momenta, rounded
      up): the block's largest magnitude, negative for a block
      with a negative value (coded by ``format``'s signed code), positive for
      a block coded with the non-negative code (of the square root).
    shape: the leaf's shape.
    dtype: the leaf's dtype (what decoding returns).
    format: ``"int8"``, ``"float8"`` or ``"int4"``.
    block_size: elements per block.
    never_zero: a non-zero value of a non-negative block never codes 0 (it
      rounds up to the smallest code): set for a leaf the update divides by
      (``classify.divisors``), such as Adam's ``nu``. Otherwise a value under
      the smallest code rounds to it or to 0 without bias, so that a
      decaying momentum reaches 0.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> state = jmp.quantize_state(optax.adam(1e-3), min_size=0).init({"w": jnp.ones((2, 256))})
    >>> nu = state.inner[0].nu["w"]
    >>> nu.codes.dtype, nu.scales.shape, nu.dequantize().shape
    (dtype('uint8'), (2, 1), (2, 256))
    >>> state = jmp.quantize_state(optax.adam(1e-3), "int4", min_size=0).init({"w": jnp.ones((2, 256))})
    >>> mu = state.inner[0].mu["w"]
    >>> mu.codes.shape, mu.scales.shape, mu.scales.dtype, mu.dequantize().shape
    ((2, 128), (2, 8), dtype(bfloat16), (2, 256))
  """

  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
  format: str = dataclasses.field(metadata=dict(static=True))
  block_size: int = dataclasses.field(metadata=dict(static=True))
  never_zero: bool = dataclasses.field(default=True, metadata=dict(static=True))

  def dequantize(self) -> jax.Array:
    """The leaf in its own dtype and shape."""
    return _decoded(self.codes, self.scales, self.shape, self.dtype, self.format, self.block_size)


jax.tree_util.register_dataclass(QuantizedArray)


# Jitted (here and in quantize), so that an eager call compiles one program, not each of
# its dozens of ops apart: the first eager quantize_state update of a 3-leaf Adam took
# 6.9 s (242 compiles), 2.0 s so (35, most of them optax's own ops). Under an outer jit,
# XLA inlines the call.
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _decoded(codes: jax.Array, scales: jax.Array, shape: tuple[int, ...], dtype: np.dtype,
             fmt: str, block_size: int) -> jax.Array:
  if _int4_across_rows(shape, fmt, block_size):
    s = _per_element(scales.astype(jnp.float32), shape, block_size)
    c = codes4.unpack(codes)[..., :shape[-1]]
    return (jnp.abs(s) * codes4.levels(c, s < 0)).astype(dtype)
  work = _work_shape(_blocked_shape(shape, block_size))
  packed = work[:-1] + (work[-1] // codes_lib.codes_per_byte(fmt),)
  x = codes_lib.decode(codes.reshape(packed), scales.reshape(work[:-1]), fmt)
  if _along_last(shape, block_size):
    return x.reshape(shape).astype(dtype)
  return x.reshape(-1)[: int(np.prod(shape))].reshape(shape).astype(dtype)


def _int4_across_rows(shape: tuple[int, ...], fmt: str, block_size: int) -> bool:
  """Whether ``"int4"`` codes a leaf in blocks across its rows, so its codes keep its shape.

  A leaf blocked over its flattened elements (its last axis not a multiple
  of ``block_size``) keeps its shape in ``"int4"``, the last axis halved and
  rounded up (a zero code pads an odd one), so that the two codes of a byte
  are neighbours in a row: as blocks, a byte's pair crossed rows where the
  last axis is odd, and XLA:GPU wrote the new state to float32 before coding
  it (an LM head's kernel ``(768, 5025)``: 2.1x optax AdamW's update temp,
  0.30x so).
  """
  return fmt == "int4" and bool(shape) and not _along_last(shape, block_size)


def _along_last(shape: tuple[int, ...], block_size: int) -> bool:
  """Whether blocks run along the last axis (else over the flattened, padded leaf)."""
  return bool(shape) and shape[-1] % block_size == 0


def _blocked_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  if _along_last(shape, block_size):
    return shape[:-1] + (shape[-1] // block_size, block_size)
  size = int(np.prod(shape))
  return (-(-size // block_size), block_size)


def dither(shape: tuple[int, ...], leaf: int, count: jax.Array) -> jax.Array:
  """The ``uint32`` draws of coded leaf number ``leaf`` at update ``count``, one per element.

  Each element's draws are a Weyl sequence: a random phase (the hash of its
  index, seeded by the leaf's number, ``masters.hashed_bits``) plus ``count``
  times 2**32 over the golden ratio. Each draw is uniform over the phases,
  so the rounding is unbiased; along the updates an element's draws are
  spread evenly rather than independently, so a code that rounds up with
  probability ``p`` at each update does so once every ``1 / p`` updates, not
  in random clusters, and a moving average's rounding errors do not add up
  as a random walk.
  """
  phase = masters.hashed_bits(shape, jnp.uint32(leaf) * np.uint32(0x85EBCA6B) + np.uint32(1))
  return phase + jnp.asarray(count).astype(jnp.uint32) * np.uint32(0x9E3779B9)


def _work_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
  """The blocks' shape for the arithmetic: without the blocks axis where it is 1.

  A leaf whose last axis is one block (an embedding of width 256) has blocks
  ``(rows, 1, 256)``. Coded in that shape, XLA:GPU wrote its new state to a
  float32 buffer before coding it (an update temp of twice optax AdamW's);
  as ``(rows, 256)`` it fuses. Same elements in the same order, so the same
  draws (:func:`dither` hashes the flat index) and bitwise the same codes.
  """
  return blocks[:-2] + blocks[-1:] if len(blocks) > 2 and blocks[-2] == 1 else blocks


def as_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` as blocks (``float32`` if floating): its last axis split, or flattened and zero-padded."""
  shape = tuple(x.shape)
  blocks = _blocked_shape(shape, block_size)
  flat = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
  if not _along_last(shape, block_size):
    flat = jnp.pad(flat.reshape(-1), (0, int(np.prod(blocks)) - flat.size))
  return flat.reshape(_work_shape(blocks))


def scales_of(x: jax.Array, fmt: str, block_size: int) -> jax.Array:
  """The float32 block scales :func:`quantize` gives ``x``: ``codes.block_scales`` of its blocks.

  An ``"int4"`` leaf blocked over its flattened elements and padded to whole
  blocks is reduced in two levels, first over runs of 32 (the smallest
  block) and then over those runs' results: the same scales. Padded as one
  reduction, XLA:GPU computed the new ``nu`` of a ``(1000, 1000)`` matrix
  inside ``mu``'s block-scale fusion (whose blocks of 32 divide it) and
  wrote it to float32 for ``nu``'s (1.1x optax AdamW's update temp; 0.16x
  so). The 8-bit formats code ``mu`` and ``nu`` in the same blocks and keep
  one reduction (two levels raised int8's temp there by 12%).
  """
  shape, fine = tuple(x.shape), codes_lib.INT4_MOMENT_BLOCK
  if (fmt != "int4" or _along_last(shape, block_size) or not x.size % block_size
      or x.size % fine or block_size % fine):
    return codes_lib.block_scales(as_blocks(x, block_size))
  runs = x.astype(jnp.float32).reshape(-1, fine)
  per, blocks = block_size // fine, -(-x.size // block_size)
  pad = (0, blocks * per - runs.shape[0])  # whole runs of zeros: no effect on either
  largest = jnp.pad(jnp.max(jnp.abs(runs), -1), pad).reshape(blocks, per).max(-1)
  negative = jnp.pad(jnp.min(runs, -1), pad).reshape(blocks, per).min(-1) < 0
  return jnp.where(negative, -largest, largest)


def quantize(x: jax.Array, fmt: str, block_size: int, leaf: int,
             count: jax.Array, never_zero: bool = True,
             scales: jax.Array | None = None, scale_dtype: Any = np.float32) -> QuantizedArray:
  """``x`` as a :class:`QuantizedArray` (float32 arithmetic, whatever ``x``'s dtype).

  The stochastic rounding draws from :func:`dither` of coded leaf number
  ``leaf`` at update ``count``; ``never_zero`` as :class:`QuantizedArray`'s.
  ``scales`` are :func:`scales_of` ``x`` when the caller has them (from
  another computation of the same ``x``);
  they are stored as ``scale_dtype`` (``codes.stored_scales``: bfloat16
  rounded up in magnitude, and the codes made against the rounded scale).

  A leaf whose blocks split its last axis is coded as blocks (their layout
  is the leaf's). One blocked over its flattened elements (its last axis
  not a multiple of ``block_size``: an attention kernel ``(768, 12, 64)``,
  a convolution) is coded in its own shape, each element given its block's
  scale, and only then laid out as blocks: coded as blocks, XLA:GPU
  computed its new state in the leaf's shape and wrote it to a float32
  buffer before coding it (the 134M Transformer of
  ``benchmarks.optim_state``: 141 MiB of update temp against optax AdamW's
  94; 8 MiB in its own shape). The draws (:func:`dither` hashes the flat
  index) and so the codes are bitwise the same. ``"int4"`` codes such a
  leaf in its own shape too and keeps its codes so (:func:`_int4_across_rows`).
  A leaf blocked along its last axis is coded as blocks (in the leaf's
  shape, XLA wrote the benchmark LSTM's int8 embedding to float32: 2.0x
  optax's temp, against 0.04x as blocks).
  """
  shape = tuple(x.shape)
  blocks = _blocked_shape(shape, block_size)
  # The codes keep the leaf's shape (its last axis over the codes a byte) when blocked
  # along it, else the blocks' shape.
  per_byte = codes_lib.codes_per_byte(fmt)
  stored = (shape[:-1] + (-(-shape[-1] // per_byte),)
            if _along_last(shape, block_size) or _int4_across_rows(shape, fmt, block_size)
            else blocks[:-1] + (block_size // per_byte,))
  if _zeros_on_one_device(x):  # init's zero moments, eagerly: what encode gives them
    return QuantizedArray(jnp.zeros(stored, jnp.uint8), jnp.zeros(blocks[:-1], scale_dtype),
                          shape, np.dtype(x.dtype), fmt, block_size, never_zero)
  codes, scales = _coded(x, count, scales, fmt, block_size, leaf, never_zero,
                         np.dtype(scale_dtype))
  return QuantizedArray(codes.reshape(stored), scales.reshape(blocks[:-1]), shape,
                        np.dtype(x.dtype), fmt, block_size, never_zero)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _coded(x: jax.Array, count: jax.Array, scales: jax.Array | None, fmt: str, block_size: int,
           leaf: int, never_zero: bool, scale_dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
  """:func:`quantize`'s codes and scales, in the blocks' shape (jitted, as :func:`_decoded`)."""
  shape = tuple(x.shape)
  work = _work_shape(_blocked_shape(shape, block_size))
  scales = scales_of(x, fmt, block_size) if scales is None else scales.reshape(work[:-1])
  scales = codes_lib.stored_scales(scales, scale_dtype)
  if not shape or _along_last(shape, block_size):
    codes, _ = codes_lib.encode(as_blocks(x, block_size), fmt, dither(work, leaf, count),
                                never_zero, scales)
  else:  # In the leaf's shape: 8-bit then as blocks (a padding element codes 0, as 0.0
    # does); int4 packed in it, an odd last axis padded with a zero code.
    codes = codes_lib.encode_elements(x, _per_element(scales, shape, block_size), fmt,
                                      dither(shape, leaf, count), never_zero)
    codes = (codes4.pack(jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, shape[-1] % 2)]))
             if fmt == "int4" else as_blocks(codes, block_size))
  return codes, scales.astype(scale_dtype)


def _per_element(scales: jax.Array, shape: tuple[int, ...], block_size: int) -> jax.Array:
  """The ``(blocks,)`` scales of a leaf blocked over its flattened elements, one per element."""
  each = jnp.broadcast_to(scales.reshape(-1, 1), (scales.size, block_size))
  return each.reshape(-1)[: int(np.prod(shape))].reshape(shape)


def _zeros_on_one_device(x: jax.Array) -> bool:
  """Whether ``x`` is a concrete array of zeros on one device (a freshly made moment).

  Zeros code to zero codes and zero scales in every format; making those
  directly spares ``init`` an eager dispatch of each op of the encode. Traced
  and sharded arrays take the encode, whose output follows their sharding.
  The test is a reduction on the device, so only a bool leaves it (run
  eagerly also inside an outer trace that closes over ``x``).
  """
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return False
  if len(x.sharding.device_set) != 1:
    return False
  with jax.ensure_compile_time_eval():
    return not bool(jnp.any(x))

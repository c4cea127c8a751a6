"""Scaling per device's rows: the blocks of a value's first axis under a mesh (issue 44).

Under FSDP or data parallelism activations and cotangents are sharded by
batch, and one amax per tensor is an all-reduce at every matmul. With
:func:`groups_of` blocks of rows, each device's block is its own shard, and
its amax is local. A scale of ``g`` blocks has ``g`` entries on its first
axis: :func:`rows` spreads it over the rows it scales, and where a matmul
contracts those rows (a weight gradient), :func:`grouped_pair` and
:func:`split` turn the blocks into a batch axis of the GEMM, whose scaled
products the caller sums.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def groups_of(x: Any) -> int:
  """How many groups of rows along its first axis ``x`` is scaled in, one amax each.

  Under a mesh with one axis of ``n > 1`` devices (FSDP, data parallel) ``x``'s
  batch is sharded on that axis, and a per-tensor amax would be an all-reduce
  at every matmul (issue 44). So an ``x`` whose first axis ``n`` divides is
  scaled per block of ``shape[0] / n`` rows: on a batch-sharded ``x`` each
  device reduces its own shard, as each rank does under torchao. The mesh is
  the one ``x``'s type carries (``jax.typeof(x).sharding.mesh``), which every
  value traced from sharded arguments has. One group (per tensor) otherwise:
  no mesh, a mesh of several axes of more than one device, or an ``x`` whose
  first axis ``n`` does not divide.

  Examples:
    >>> import jax.numpy as jnp
    >>> groups_of(jnp.ones((8, 4)))  # No mesh.
    1
  """
  try:
    mesh = jax.typeof(x).sharding.mesh
    sizes = [n for n in mesh.axis_sizes if n > 1]
  except AttributeError:  # A concrete array on one device: a sharding without a mesh.
    return 1
  if len(sizes) != 1 or not getattr(x, "ndim", 0) or x.size == 0 or x.shape[0] % sizes[0]:
    return 1
  return sizes[0]


def rows(s: jax.Array, axis: int, n: int) -> jax.Array:
  """A scale of ``g`` groups along ``axis`` spread over the ``n`` rows it scales (or kept whole)."""
  g = s.shape[axis]
  if g in (1, n):
    return s
  spread = s.reshape(s.shape[:axis] + (g, 1) + s.shape[axis + 1:])
  spread = jnp.broadcast_to(spread, s.shape[:axis] + (g, n // g) + s.shape[axis + 1:])
  return spread.reshape(s.shape[:axis] + (n,) + s.shape[axis + 1:])


def split(q: jax.Array, s: jax.Array, axis: int, g: int) -> tuple[jax.Array, jax.Array]:
  """``axis`` of ``q`` split into ``g`` groups, moved to the front as a new batch axis; ``s`` alike."""
  n = q.shape[axis]
  q = jnp.moveaxis(q.reshape(q.shape[:axis] + (g, n // g) + q.shape[axis + 1:]), axis, 0)
  s = rows(s, axis, g) if s.shape[axis] > 1 else s  # g groups, or one scale for all.
  s = jnp.moveaxis(s.reshape(s.shape[:axis] + (s.shape[axis], 1) + s.shape[axis + 1:]), axis, 0)
  return q, s


def grouped_pair(s_l: jax.Array, s_r: jax.Array, dims: Dims) -> tuple[int, int, int] | None:
  """The contracting pair ``(lhs axis, rhs axis, groups)`` along which a scale varies, if one does.

  Only a first axis scaled per group of rows (:func:`groups_of`) varies, so
  at most one pair can: a backward GEMM contracting the batch rows of an
  activation and of the cotangent.
  """
  (lc, rc), _ = dims
  pairs = [(a, b) for a, b in zip(lc, rc) if s_l.shape[a] > 1 or s_r.shape[b] > 1]
  if not pairs:
    return None
  if len(pairs) > 1:
    raise NotImplementedError(f"scales that vary along several contracting axes: {pairs}")
  a, b = pairs[0]
  g = max(s_l.shape[a], s_r.shape[b])
  if g % s_l.shape[a] or g % s_r.shape[b]:
    raise NotImplementedError(f"row groups that do not nest: {s_l.shape[a]} and {s_r.shape[b]}")
  return a, b, g

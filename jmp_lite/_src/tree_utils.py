"""Small pytree and dtype helpers shared by the other modules."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

T = TypeVar("T")

KeyPath = tuple[Any, ...]


def is_floating_array(x: Any) -> bool:
  """True for jax/numpy arrays and numpy scalars with a floating dtype.

  Python scalars, ``None``, PRNG keys and integer or bool arrays are not
  floating arrays. Tracers count as ``jax.Array``.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  return bool(jnp.issubdtype(x.dtype, jnp.floating))


def is_inexact_array(x: Any) -> bool:
  """True for jax/numpy arrays and numpy scalars with a floating or complex dtype.

  These are the leaves that loss scaling scales and unscales and that the
  finiteness checks look at. Casting (policies) only touches the real
  floating ones (:func:`is_floating_array`), as jmp does.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def wide_dtype(dtype: Any) -> np.dtype:
  """The dtype to unscale and reduce ``dtype`` values in: at least float32.

  float16, bfloat16 and float8 widen to float32, float64 stays float64, and
  complex dtypes keep their width (complex64 at least). No implicit promotion
  is involved, so it works for float8 and under strict promotion.

  Examples:
    >>> import jax.numpy as jnp
    >>> [wide_dtype(d).name for d in (jnp.float16, jnp.float8_e4m3fn, jnp.float32)]
    ['float32', 'float32', 'float32']
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  return np.dtype(jnp.float64) if dtype.itemsize >= 8 else np.dtype(jnp.float32)


def path_str(path: KeyPath) -> str:
  """Joins a key path with ``/``: ``("params", "Dense_0", "kernel")`` style.

  Examples:
    >>> import jax
    >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": {"b": [1]}})[0]]
    ['a/b/0']
  """
  return jax.tree_util.keystr(path, simple=True, separator="/")


def unique_path_strs(paths: list[KeyPath]) -> list[str]:
  """:func:`path_str` of each path, made unique where two joined paths collide.

  ``{"x": {"0": a}, "x/0": b}`` joins both to ``"x/0"``; colliding paths are
  written in :func:`jax.tree_util.keystr`'s full form instead (``"['x']['0']"``
  and ``"['x/0']"``), which is unique.

  Examples:
    >>> import jax
    >>> paths = [p for p, _ in jax.tree_util.tree_flatten_with_path({"x": {"0": 1}, "x/0": 2, "y": 3})[0]]
    >>> unique_path_strs(paths)
    ["['x']['0']", "['x/0']", 'y']
  """
  simple = [path_str(p) for p in paths]
  counts: dict[str, int] = {}
  for s in simple:
    counts[s] = counts.get(s, 0) + 1
  return [s if counts[s] == 1 else jax.tree_util.keystr(p) for s, p in zip(simple, paths)]


def floating_part(tree: Any) -> Any:
  """Replaces every non-floating leaf with ``None`` (an empty subtree)."""
  return jax.tree.map(lambda x: x if is_floating_array(x) else None, tree)


def merge_floating(float_tree: Any, full_tree: T) -> T:
  """Inverse of :func:`floating_part`: fills the ``None`` holes from ``full_tree``."""
  return jax.tree.map(
      lambda f, x: x if f is None else f,
      float_tree,
      full_tree,
      is_leaf=lambda x: x is None,
  )


def map_floating(fn: Callable[[jax.Array], jax.Array], tree: T) -> T:
  """Applies ``fn`` to floating leaves only; every other leaf is returned as is."""
  return jax.tree.map(lambda x: fn(x) if is_floating_array(x) else x, tree)


def map_inexact(fn: Callable[[jax.Array], jax.Array], tree: T) -> T:
  """Applies ``fn`` to floating and complex leaves only; others are returned as is."""
  return jax.tree.map(lambda x: fn(x) if is_inexact_array(x) else x, tree)


def cast_floating(tree: T, dtype: DTypeLike) -> T:
  """Casts floating leaves to ``dtype``; a leaf already in ``dtype`` is returned as is."""

  def cast(x: jax.Array) -> jax.Array:
    return x if x.dtype == dtype else x.astype(dtype)

  return map_floating(cast, tree)

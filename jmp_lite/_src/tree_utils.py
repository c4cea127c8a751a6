"""Small pytree helpers shared by the policy, transform, train and diagnostics modules."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

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


def path_str(path: KeyPath) -> str:
  """Joins a key path with ``/``: ``("params", "Dense_0", "kernel")`` style.

  Examples:
    >>> import jax
    >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": {"b": [1]}})[0]]
    ['a/b/0']
  """
  return jax.tree_util.keystr(path, simple=True, separator="/")


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


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts floating leaves to ``dtype``; a leaf already in ``dtype`` is returned as is."""

  def cast(x):
    return x if x.dtype == dtype else x.astype(dtype)

  return map_floating(cast, tree)

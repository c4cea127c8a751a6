"""Which leaves of a pytree are traced and which are static: the one rule.

**The rule** (Equinox's ``eqx.is_array``, which ``eqx.filter_jit`` uses): a
leaf is *traced* if it is an array: a ``jax.Array`` (PRNG keys included), a
NumPy array or NumPy scalar, or a ``jax.ShapeDtypeStruct`` standing for one.
Every other leaf (Python numbers and bools, strings, functions, enum values,
any other object) is *static*: configuration that is carried through as the
very same object, never converted to an array, never differentiated, donated
or given optimizer state, and part of the compilation key (compared by value
when hashable, by identity otherwise).

The train step, :func:`autocast` and :func:`precision_lint` all partition
their arguments with :func:`partition`; :class:`TrainState` keeps the static
leaves of its params, optimizer state and model state in its aux data
(:func:`hollow`), so its leaves are arrays only (orbax, ``jax.eval_shape``).
:meth:`TrainState.create` normalises state before that: outside an Equinox
module a Python number becomes a strongly typed array (a plain ``{"w": ...,
"b": 0.5}`` trains ``b``, as ``jax.jit`` and optax would treat it); a field of
an Equinox module (``eqx.nn.MaxPool2d``'s ``-inf``, ``eqx.nn.Dropout``'s ``p``
and ``inference``) stays a static field, as it is under ``eqx.filter_jit``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
from typing import Any, Callable

import jax
import numpy as np

# (treedef, one Static or None per leaf): the static half of a partition.
Spec = tuple[Any, tuple[Any, ...]]


def is_traced(x: Any) -> bool:
  """Whether ``x`` is a leaf to trace: an array (or a ``ShapeDtypeStruct``)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_module(x: Any) -> bool:
  """Whether ``x`` is an Equinox module (without importing Equinox)."""
  eqx = sys.modules.get("equinox")
  module = getattr(eqx, "Module", None)
  return module is not None and isinstance(x, module)


def map_outside_modules(
    fn: Callable[[Any], Any], tree: Any, in_module: Callable[[Any], Any]
) -> Any:
  """Maps ``fn`` over the leaves of ``tree`` outside Equinox modules, ``in_module`` inside."""

  def node(x: Any) -> Any:
    return jax.tree.map(in_module, x) if is_module(x) else fn(x)

  return jax.tree.map(node, tree, is_leaf=is_module)


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
  """A static leaf, compared by value if hashable and by identity otherwise."""

  value: Any

  def _key(self) -> Any:
    try:
      hash(self.value)
    except TypeError:
      return ("id", id(self.value))
    return ("value", type(self.value), self.value)

  def __hash__(self) -> int:
    return hash(self._key())

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, Static) and self._key() == other._key()


def partition(tree: Any) -> tuple[list[Any], Spec]:
  """``(traced leaves with None holes, spec)``, like ``eqx.partition(tree, eqx.is_array)``.

  The spec (the tree structure and the static leaves, wrapped in
  :class:`Static`) is hashable, so it can be a ``static_argnums`` argument.

  Examples:
    >>> import jax.numpy as jnp
    >>> traced, spec = partition({"w": jnp.ones(2), "act": "relu", "p": 0.5})
    >>> [x is None for x in traced]
    [True, True, False]
    >>> combine(traced, spec)["act"]
    'relu'
  """
  leaves, treedef = jax.tree.flatten(tree)
  traced = [x if is_traced(x) else None for x in leaves]
  static = tuple(None if is_traced(x) else Static(x) for x in leaves)
  return traced, (treedef, static)


def combine(traced: list[Any], spec: Spec) -> Any:
  """The tree that :func:`partition` split, with ``traced`` in the traced places."""
  treedef, static = spec
  return treedef.unflatten([t if s is None else s.value for t, s in zip(traced, static)])


def has_static(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is static."""
  return not all(is_traced(x) for x in jax.tree.leaves(tree))


def _is_hole(x: Any) -> bool:
  """``None`` or an empty node: a place that a tree map may fill (orbax does)."""
  return x is None or not jax.tree.leaves(x)


def hollow(tree: Any) -> tuple[Any, Spec | None]:
  """``(tree with its static leaves replaced by None, the spec to put them back)``.

  A tree with no static leaf comes back as it is, with spec ``None``. Unlike
  :func:`partition`, the hollow tree keeps its structure (and key paths), so
  a container can hold it as its pytree children and the spec as aux data:
  that is how :class:`TrainState` keeps an Equinox module's static fields out
  of ``jax.tree.leaves``, orbax checkpoints and ``jax.eval_shape``.

  Examples:
    >>> import jax.numpy as jnp
    >>> holes, spec = hollow({"w": jnp.ones(2), "act": "relu", "b": None})
    >>> holes["act"] is None, fill(holes, spec)["act"]
    (True, 'relu')
  """
  if not has_static(tree):
    return tree, None
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_hole)
  keep = [_is_hole(x) or is_traced(x) for x in leaves]
  static = tuple(None if k else Static(x) for x, k in zip(leaves, keep))
  holes = jax.tree.unflatten(treedef, [x if k else None for x, k in zip(leaves, keep)])
  return holes, (treedef, static)


def fill(holes: Any, spec: Spec | None) -> Any:
  """The tree :func:`hollow` split, whatever now stands in its traced places.

  ``None`` and empty nodes (Equinox's ``BatchNorm`` holds one) are places a
  tree map may have filled (orbax puts its ``SaveArgs`` there): whatever
  stands there is kept.
  """
  if spec is None:
    return holes
  return combine(spec[0].flatten_up_to(holes), spec)


# What snapshot records: the tree structure and the leaves, as objects.
Snapshot = tuple[Any, list[Any]]


def snapshot(tree: Any) -> Snapshot | None:
  """What :func:`edited` compares ``tree`` with; ``None`` if it cannot be edited in place.

  A tree of tuples (named tuples: optax states), ``None`` and Equinox modules
  (frozen) cannot be edited in place, so it needs no record; one with a
  dict, a list or another container can.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones(2), "act": "relu"}
    >>> shot = snapshot(params)
    >>> edited(params, shot)
    False
    >>> params["w"] = jnp.zeros(2)
    >>> edited(params, shot)
    True
    >>> snapshot((jnp.ones(2), "relu")) is None
    True
  """
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, leaves) if _editable(treedef) else None


def edited(tree: Any, shot: Snapshot) -> bool:
  """Whether ``tree`` changed since :func:`snapshot`: one C++ flatten, leaves compared by identity."""
  treedef, leaves = shot
  now, now_def = jax.tree.flatten(tree)
  return now_def != treedef or len(now) != len(leaves) or not all(map(operator.is_, now, leaves))


def _editable(treedef: Any) -> bool:
  try:
    return _editable_cached(treedef)
  except TypeError:  # Unhashable node data: assume editable.
    return True


@functools.lru_cache(maxsize=256)
def _editable_cached(treedef: Any) -> bool:
  node = treedef.node_data()
  if node is None:  # A leaf.
    return False
  kind = node[0]
  if not (issubclass(kind, tuple) or kind is type(None) or _is_module_type(kind)):
    return True  # A dict, a list, any other container: editable in place.
  return any(_editable_cached(c) for c in treedef.children())


def _is_module_type(kind: type) -> bool:
  module = getattr(sys.modules.get("equinox"), "Module", None)
  return module is not None and issubclass(kind, module)

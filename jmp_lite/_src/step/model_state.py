"""Storing the model state that ``loss_fn`` returns: dtypes, structure, static leaves.

The train step passes ``state.model_state`` to ``loss_fn`` and stores what it
returns (:func:`step_stages.next_model_state`, which keeps the old state on a
skipped step). :func:`stored` is the rule for what may be stored:

- the tree structure is the stored one;
- floating leaves are stored in their stored dtype, integer and bool leaves
  in theirs (an NNX ``uint32`` counter returned as ``int32``);
- static leaves (:mod:`jmp_lite._src.filtering`'s rule: an Equinox EMA
  model's activation function, a ``float`` field of an Equinox module, a
  string tag) are configuration, kept as the params keep theirs: the very same
  objects, never traced, never passed through the skip's ``lax.cond``. A
  returned static leaf must equal the stored one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite._src import filtering
from jmp_lite._src import tree_utils

_STORE_MSG = (
    "loss_fn returned model state leaf {path!r} as {got}, which cannot be stored "
    "in its state's {stored} (integer and bool leaves are cast from other integer "
    "or bool dtypes; shapes, PRNG keys and floats in an integer leaf must match)"
)
_STATIC_MSG = (
    "loss_fn returned model state leaf {path!r} as {got}, but the state holds it "
    "as the static (non-array) value {stored}. Static model-state leaves (an "
    "Equinox module's functions and Python number fields, strings) are "
    "configuration: the step keeps them as they are, as it keeps the params'. "
    "Return the state's own value (eqx.tree_at replaces only the arrays), or "
    "store a value that changes as an array (jnp.asarray) in TrainState.create"
)


def stored(new: Any, old: Any) -> tuple[list[Any], filtering.Spec]:
  """``new``'s traced leaves in ``old``'s dtypes, and ``old``'s spec (its static leaves).

  ``filtering.combine(traced, spec)`` is the model state to store.

  Raises:
    TypeError: if ``new`` has another tree structure than ``old``, a leaf
      that cannot be stored in its stored dtype, or a static leaf that is
      not the stored one (an array where the state holds a Python number,
      another string or function).

  Examples:
    >>> import jax.numpy as jnp
    >>> traced, spec = stored({"m": jnp.ones(2, jnp.float16), "tag": "ema"},
    ...                       {"m": jnp.zeros(2), "tag": "ema"})
    >>> traced[0].dtype, traced[1], filtering.combine(traced, spec)["tag"]
    (dtype('float32'), None, 'ema')
  """
  structure: Any = jax.tree.structure(new)  # Any: mypy cannot compare jaxlib's PyTreeDef.
  if structure != jax.tree.structure(old):
    raise TypeError(
        "loss_fn returned a model state of another structure than state.model_state:\n"
        f"  expected: {jax.tree.structure(old)}\n  received: {jax.tree.structure(new)}"
    )
  old_traced, spec = filtering.partition(old)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(old)[0]]
  return [_store(p, n, o, s) for p, n, o, s in zip(paths, jax.tree.leaves(new), old_traced,
                                                      spec[1])], spec


def _store(path: tree_utils.KeyPath, n: Any, o: Any, static: filtering.Static | None) -> Any:
  """One leaf of the new model state as stored (``None`` at a static leaf)."""
  if static is not None:
    if filtering.is_traced(n) or filtering.Static(n) != static:
      got = _describe(n) if filtering.is_traced(n) else repr(n)
      raise TypeError(_STATIC_MSG.format(
          path=tree_utils.path_str(path), got=got, stored=repr(static.value)))
    return None
  if tree_utils.is_inexact_array(o):
    return jnp.asarray(n).astype(o.dtype)
  # Integer and bool leaves (and PRNG keys): the skip's select needs one type.
  n = jnp.asarray(n) if isinstance(n, (bool, int, float, complex)) else n
  if filtering.is_traced(n) and n.shape == o.shape:
    if n.dtype == o.dtype:
      return n
    if _is_integer_or_bool(n.dtype) and _is_integer_or_bool(o.dtype):
      return n.astype(o.dtype)
  raise TypeError(_STORE_MSG.format(
      path=tree_utils.path_str(path), got=_describe(n), stored=_describe(o)))


def _describe(x: Any) -> str:
  """``float32[2]``, or the type's name for something that is not an array."""
  return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"


def _is_integer_or_bool(dtype: Any) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_))

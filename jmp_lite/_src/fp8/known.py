"""The weights' amaxes, known before their matmuls: FP8 weights cast before the gather (issue 44).

Under FSDP each weight is sharded and XLA's SPMD partitioner gathers it where
a matmul uses it. Per-tensor current scaling needs the weight's amax first,
and the amax of a sharded weight is a cross-device reduction: one tiny
all-reduce per weight use, and a float8 cast that XLA may place after the
gather (which then carries half-precision bytes).

:func:`weight_amaxes` takes the amax of every weight matrix of the params at
the top of the step, all in one computation (XLA combines their all-reduces),
with no gradient. While :func:`known` is active, autocast's FP8 rule quantises
an operand that holds a weight's values (:func:`jmp_lite._src.fp8.plan.exact_sources`)
with that amax, rounded to the operand's dtype, instead of reducing the
operand: ``clip(w / s).astype(float8)`` is then element-wise on each shard,
so the gather carries float8. Rounding is monotone, so the rounded amax is
the amax of the rounded weight, and the float8 values are bit for bit those
of casting after the gather.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite._src import tree_utils

_KNOWN: contextvars.ContextVar[Union[Mapping[str, jax.Array], None]] = contextvars.ContextVar(
    "jmp_lite_fp8_known_amaxes", default=None)
# The amaxes a train step read from its state (TrainState.weight_amaxes), by path.
_GIVEN: contextvars.ContextVar[Union[Mapping[str, jax.Array], None]] = contextvars.ContextVar(
    "jmp_lite_fp8_given_amaxes", default=None)


def _is_matrix(leaf: Any) -> bool:
  """Whether ``leaf`` is a floating array of two or more dims (a weight FP8 may multiply)."""
  return hasattr(leaf, "dtype") and jnp.ndim(leaf) >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating)


def _amax(leaf: Any) -> Any:
  """``max|leaf|`` in its own dtype, no gradient, for a weight matrix; else ``None``."""
  if not _is_matrix(leaf):
    return None
  return lax.stop_gradient(jnp.max(jnp.abs(leaf), initial=0))  # As fp8_dot._scale takes it.


def tree_amaxes(params: Any) -> Any:
  """``params`` with each weight matrix's amax in its place (``None`` at the other leaves).

  What :class:`jmp_lite.TrainState` keeps as ``weight_amaxes``: taken from
  the masters when a step writes them, all in one computation, so that the
  next step's FP8 casts need no reduction before their gathers.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree_amaxes({"w": jnp.array([[1.0, -3.0]]), "b": jnp.ones(2), "n": 3})
    {'b': None, 'n': None, 'w': Array(3., dtype=float32)}
  """
  return jax.tree.map(_amax, params)


_AMAXES_MSG = ("weight_amaxes must be None or hold a scalar amax at each weight matrix of the "
               "params and None at their other leaves (the tree TrainState.create(..., "
               "weight_amaxes=True) keeps): {what}")


def check_amaxes(amaxes: Any, params: Any) -> None:
  """Refuses ``amaxes`` that are not :func:`tree_amaxes` of ``params`` in form.

  Structure and shapes only: nothing is computed (under ``jit`` it adds no
  operation).

  Raises:
    ValueError: naming the weights without an amax, the leaves that are no
      weight matrix, a non-scalar amax, or the two tree structures.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> check_amaxes(tree_amaxes(params), params)
    >>> check_amaxes({"b": jnp.ones(()), "w": jnp.ones(())}, params)
    Traceback (most recent call last):
    ValueError: weight_amaxes must ...: leaves at ['b'], which hold no weight matrix of the params
  """
  if amaxes is None:
    return
  want = jax.tree.structure(jax.tree.map(lambda x: 0 if _is_matrix(x) else None, params))
  found = jax.tree_util.tree_flatten_with_path(amaxes)[0]
  got: Any = jax.tree.structure(amaxes)  # Any: mypy cannot compare jaxlib's PyTreeDef.
  if got != want:
    weights = {tree_utils.path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
               if _is_matrix(x)}
    given = {tree_utils.path_str(p) for p, _ in found}
    missing, extra = sorted(weights - given), sorted(given - weights)
    what = "; ".join(
        [f"no amax for the weight(s) {missing}"] * bool(missing)
        + [f"leaves at {extra}, which hold no weight matrix of the params"] * bool(extra)) or (
            f"its tree structure is {got}, the params' amaxes' {want}")
    raise ValueError(_AMAXES_MSG.format(what=what))
  for path, amax in found:
    if jnp.shape(amax) != ():
      raise ValueError(_AMAXES_MSG.format(what=f"the amax at {tree_utils.path_str(path)!r} has "
                                          f"shape {jnp.shape(amax)}, not ()"))


def by_path(amaxes: Any) -> Union[dict[str, jax.Array], None]:
  """A :func:`tree_amaxes` tree as ``{path: amax}``, the paths autocast names argument leaves by.

  Examples:
    >>> import jax.numpy as jnp
    >>> by_path(tree_amaxes({"dense": {"w": jnp.ones((2, 2))}, "b": jnp.ones(2)}))
    {'dense/w': Array(1., dtype=float32)}
  """
  if amaxes is None:
    return None
  return {tree_utils.path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(amaxes)[0]}


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def given(amaxes: Union[Mapping[str, jax.Array], None]) -> contextlib.AbstractContextManager[None]:
  """Makes ``amaxes`` (by params path) the ones a step autocast uses instead of taking its own."""
  return _holding(_GIVEN, amaxes)


def given_amaxes() -> Union[Mapping[str, jax.Array], None]:
  """The amaxes :func:`given` set, or ``None``."""
  return _GIVEN.get()


def weight_amaxes(paths: Sequence[Union[str, None]], leaves: Sequence[Any]) -> dict[str, jax.Array]:
  """``{path: max|leaf|}`` for every floating leaf of two or more dims, in its own dtype, no gradient.

  Leaves that no FP8 matmul reads cost nothing: XLA drops unused amaxes.

  Examples:
    >>> import jax.numpy as jnp
    >>> amaxes = weight_amaxes(["w", "b", None], [jnp.array([[1.0, -3.0]]), jnp.ones(2), jnp.ones((2, 2))])
    >>> {k: float(v) for k, v in amaxes.items()}
    {'w': 3.0}
  """
  found: dict[str, jax.Array] = {}
  for path, leaf in zip(paths, leaves):
    if path is not None and _is_matrix(leaf):
      found[path] = _amax(leaf)
  return found


def known(amaxes: Union[Mapping[str, jax.Array], None]) -> contextlib.AbstractContextManager[None]:
  """Makes ``amaxes`` (by argument path) the ones :func:`amax_of` reads while the block runs."""
  return _holding(_KNOWN, amaxes)


def row_amaxes(needs: Sequence[tuple[str, tuple[int, ...]]],
               leaf_of: Mapping[str, Any]) -> dict[Any, jax.Array]:
  """``{(path, axes): max|leaf| over axes}`` (kept dims), for a rowwise recipe's weight operands.

  A rowwise recipe scales an operand per row of its free dimensions: its
  amax over the contracting ``axes``. For a weight that reaches its matmul in
  its own layout (:func:`jmp_lite._src.fp8.plan.row_needs`) that is the
  leaf's, taken here with the others at the top of the step.

  Examples:
    >>> import jax.numpy as jnp
    >>> w = jnp.array([[1.0, -5.0], [-3.0, 2.0]])
    >>> {k: v.tolist() for k, v in row_amaxes([("w", (0,))], {"w": w}).items()}
    {('w', (0,)): [[3.0, 5.0]]}
  """
  found = {}
  for path, axes in needs:
    if path in leaf_of and _is_matrix(leaf_of[path]):
      found[(path, axes)] = lax.stop_gradient(jnp.max(jnp.abs(leaf_of[path]), axis=axes, keepdims=True))
  return found


def is_weight(path: Union[str, None]) -> bool:
  """Whether :func:`known` holds an amax for ``path``: a params leaf of two or more dims."""
  amaxes = _KNOWN.get()
  return path is not None and amaxes is not None and path in amaxes


def amax_of(path: Any, operand: Any) -> Union[jax.Array, None]:
  """The known amax of the leaf at ``path``, in ``operand``'s dtype, or ``None`` if none is known.

  ``path`` is a params path (per tensor) or ``(path, axes)`` (:func:`row_amaxes`).

  Examples:
    >>> import jax.numpy as jnp
    >>> w = jnp.array([[1.0, -3.0001]])
    >>> with known(weight_amaxes(["w"], [w])):
    ...   amax_of("w", w.astype(jnp.bfloat16)).tolist(), amax_of("v", w)
    (3.0, None)
  """
  amaxes = _KNOWN.get()
  if path is None or amaxes is None or path not in amaxes:
    return None
  return amaxes[path].astype(operand.dtype)

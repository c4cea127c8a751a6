"""Calling a jitted train step: the checks that need Python, and the jit wrapper.

:class:`TrainStep` wraps the traced step (see :mod:`jmp_lite._src.step`) in
``jax.jit``, or in :class:`FilteredJit` when the state or the batch has static
(non-array) leaves under :mod:`jmp_lite._src.filtering`'s rule. Before each
call it checks, on the Python side, that the params and batch trees keep the
first call's structure and the batch its static leaves (each change would
recompile silently); when a donating call fails it names the deleted or
aliased array; on a multi-device CPU mesh it waits for each call.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jmp_lite._src import checks
from jmp_lite._src import filtering
from jmp_lite._src.train_state import TrainState

_STRUCTURE_MSG = (
    "the {what} tree changed structure between calls of the same train step "
    "(the step was first called with one structure and would silently recompile "
    "for another).\n  expected: {expected}\n  received: {received}\n"
    "Pass trees of the first structure, or build a separate step with "
    "make_train_step for the new one."
)
_STATIC_MSG = (
    "a static (non-array) batch leaf changed value between calls of the same train "
    "step: {where} was {expected} on the first call and is {received} now. Static "
    "leaves are part of the compilation key, so the step would silently recompile; "
    "pass an array (jnp.asarray) for a value that changes per step, or build another "
    "step with make_train_step."
)
_DELETED_MSG = (
    "{where} was deleted: a donating step (make_train_step(..., donate=True), the "
    "default) consumed the state it was part of. Keep using the state each call "
    "returns (state, metrics = step(state, batch)), or build the step with "
    "donate=False to keep old states alive."
)
_ALIASED_MSG = (
    "{first} and {second} are the same array, and a donating step cannot donate "
    "one buffer twice (or donate a buffer it also reads from the batch). Give "
    "them separate arrays (TrainState.create copies every leaf, so build states "
    "with it), or build the step with donate=False."
)

# What the structure check remembers: (params treedef, batch treedef, the
# batch's static leaves, as in filtering.partition's spec).
_Signature = tuple[Any, Any, tuple[Any, ...]]


def _named_leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(prefix + jax.tree_util.keystr(p), x) for p, x in flat]


def _donation_problem(state: TrainState, batch: Any) -> str | None:
  """Why a donating call failed on its inputs (deleted or aliased arrays), if it did."""
  leaves = _named_leaves("state", state) + _named_leaves("batch", batch)
  seen: dict[int, str] = {}
  for name, x in leaves:
    if not isinstance(x, jax.Array):
      continue
    if x.is_deleted():
      return _DELETED_MSG.format(where=name)
    if id(x) in seen:
      return _ALIASED_MSG.format(first=seen[id(x)], second=name)
    seen[id(x)] = name
  return None


def _not_a_state_message(state: Any) -> str:
  """Why ``state`` is refused, naming both classes when it is another library's TrainState."""
  name = checks.type_name(state)
  msg = f"state must be a jmp_lite.TrainState (see TrainState.create), got {name}"
  if type(state).__name__ == "TrainState":
    msg += (f" (another library's TrainState, not jmp_lite.TrainState: build one with "
            "jmp_lite.TrainState.create(params=..., tx=...))")
  return msg


def _check_not_donated(state: TrainState, batch: Any) -> None:
  """A state that a donating step already consumed, refused before dispatch.

  Dispatching deleted buffers makes XLA log an error line before the call
  fails; checking ``state.step`` (donated with every other leaf, and a
  single read) keeps that line away at no cost per leaf. Other deleted or
  aliased arrays are diagnosed after a failed call (:func:`_donation_problem`).
  """
  step = state.step
  if isinstance(step, jax.Array) and not checks.is_traced(step) and step.is_deleted():
    raise ValueError(_donation_problem(state, batch) or _DELETED_MSG.format(where="state.step"))


def _signature(state: TrainState, batch: Any) -> _Signature:
  _, (batch_def, batch_static) = filtering.partition(batch)
  return jax.tree.structure(state.params), batch_def, batch_static


def _check_signature(expected: _Signature, received: _Signature, batch: Any) -> None:
  """Raises a ValueError naming what changed since the first call, if anything did."""
  for what, first, now in zip(("params", "batch"), expected, received):
    if first != now:
      raise ValueError(_STRUCTURE_MSG.format(what=what, expected=first, received=now))
  if expected[2] == received[2]:
    return
  for (name, _), first, now in zip(_named_leaves("batch", batch), expected[2], received[2]):
    if first != now:
      raise ValueError(_STATIC_MSG.format(
          where=name, expected=_describe(first), received=_describe(now)))


def _describe(static: filtering.Static | None) -> str:
  return "an array" if static is None else repr(static.value)


class FilteredJit:
  """``jax.jit`` for trees with static leaves (like ``eqx.filter_jit``).

  Leaves are split by :func:`filtering.partition`: the static ones are part of
  the compilation key and come back as the very same objects; only the arrays
  are traced. The first argument's arrays are donated if ``donate``.

  Examples:
    >>> import jax.numpy as jnp
    >>> double = FilteredJit(lambda tree, n: {"y": tree["x"] * n, "act": tree["act"]}, False)
    >>> out = double({"x": jnp.ones(2), "act": "relu"}, 3.0)
    >>> out["y"].tolist(), out["act"]
    ([3.0, 3.0], 'relu')
  """

  def __init__(self, fn: Callable[..., Any], donate: bool):
    self._out_specs: dict[Any, Any] = {}

    def inner(first: list[Any], rest: list[Any], spec: Any) -> list[Any]:
      args = filtering.combine(first, spec[0]), filtering.combine(rest, spec[1])
      out_traced, self._out_specs[spec] = filtering.partition(fn(*args))
      return out_traced

    self._jitted = jax.jit(inner, static_argnums=2, donate_argnums=(0,) if donate else ())

  def _split(self, first: Any, rest: Any) -> tuple[list[Any], list[Any], Any]:
    (first, first_spec), (rest, rest_spec) = filtering.partition(first), filtering.partition(rest)
    return first, rest, (first_spec, rest_spec)

  def __call__(self, first: Any, rest: Any) -> Any:
    first, rest, spec = self._split(first, rest)
    return filtering.combine(self._jitted(first, rest, spec), self._out_specs[spec])

  def lower(self, first: Any, rest: Any) -> Any:
    return self._jitted.lower(*self._split(first, rest))


class TrainStep:
  """The jitted step plus the checks that need Python: tree structures, donation.

  The structure check compares tree structures and the batch's static leaves
  on the Python side (cheap) before the call. A state already consumed by a
  donating step is refused before dispatch (one read of ``state.step``);
  other deleted or aliased input arrays are diagnosed only when the call
  fails, so they cost nothing otherwise. A
  state or batch with static leaves (an Equinox module's activation
  functions, a string in the batch) goes through a :class:`FilteredJit` that
  keeps them static; otherwise the plain ``jax.jit`` runs, with no Python work
  per leaf. Attribute access (``trace``, ``eval_shape``, ...) goes to the
  underlying ``jax.jit`` object.
  """

  def __init__(self, step: Callable[..., Any], donate: bool):
    self._jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
    self._filtered = FilteredJit(step, donate)
    self._donate = donate
    self._signature: _Signature | None = None
    self._has_static: bool | None = None
    self._block = False
    self.__wrapped__ = self._jitted

  def _target(self, state: Any, batch: Any) -> Any:
    if self._has_static is None:
      self._has_static = filtering.has_static((state, batch))
    return self._filtered if self._has_static else self._jitted

  def lower(self, state: TrainState, batch: Any) -> Any:
    """``jax.jit(...).lower`` for these arguments (static leaves included)."""
    return self._target(state, batch).lower(state, batch)

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    if not isinstance(state, TrainState):
      raise TypeError(_not_a_state_message(state))
    _check_not_donated(state, batch)
    signature = _signature(state, batch)
    if self._signature is not None:
      _check_signature(self._signature, signature, batch)
    try:
      out = self._target(state, batch)(state, batch)
    except (RuntimeError, ValueError) as e:
      problem = _donation_problem(state, batch) if self._donate else None
      if problem is None:
        raise
      raise ValueError(problem) from e
    if self._signature is None:
      self._signature = signature
      self._block = _multi_device_cpu((state, batch))
    if self._block:
      jax.block_until_ready(out)
    return out

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in ("_jitted", "_filtered"):
      raise AttributeError(name)
    return getattr(self._jitted, name)


def _multi_device_cpu(tree: Any) -> bool:
  """Whether any array of ``tree`` is spread over several CPU devices.

  XLA:CPU runs every device of a step on one shared thread pool; with many
  steps in flight, their collectives' rendezvous can wait on each other until
  XLA aborts the process ("Termination timeout ... 40 seconds"), with or
  without jmp_lite. Such a step waits for each call to finish, which costs
  little on a CPU and never hangs.
  """
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    devices = getattr(sharding, "device_set", ())
    if len(devices) > 1 and next(iter(devices)).platform == "cpu":
      return True
  return False

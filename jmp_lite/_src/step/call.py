"""Calling a jitted train step: the checks that need Python, and the jit wrapper.

:class:`TrainStep` wraps the traced step (see :mod:`jmp_lite._src.step.make`) in
``jax.jit``, or in :class:`FilteredJit` when the batch has static (non-array)
leaves under :mod:`jmp_lite._src.filtering`'s rule (a :class:`TrainState`
keeps its own static leaves in its tree structure). A call costs what the
``jax.jit`` call costs: the checks that the params and batch trees keep the
first call's structure and the batch its static leaves run when jax traces
the step again (any such change makes it retrace), not per call; a donated
state is refused with one read; when a call fails it names the changed
signature or the deleted or aliased array; on a multi-device CPU mesh it
waits for each call.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax

from jmp_lite._src import checks
from jmp_lite._src import filtering
from jmp_lite._src.step.train_state import TrainState

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

# The types of concrete jax arrays seen as state.step (jaxlib's ArrayImpl).
_CONCRETE_ARRAY_TYPES: set[type] = set()

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


def _consumed_by_the_call(state: TrainState) -> bool:
  """Whether ``state.step``, alive before a failed donating call, was consumed by it."""
  step = state.step
  return isinstance(step, jax.Array) and not checks.is_traced(step) and step.is_deleted()


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
  if type(step) not in _CONCRETE_ARRAY_TYPES:  # isinstance on jax.Array's ABC costs a microsecond
    if not isinstance(step, jax.Array) or checks.is_traced(step):
      return  # A Python number, or a tracer: a step called inside jit or scan.
    _CONCRETE_ARRAY_TYPES.add(type(step))
  if step.is_deleted():
    raise ValueError(_donation_problem(state, batch) or _DELETED_MSG.format(where="state.step"))


def _signature(state: TrainState, batch: Any) -> _Signature:
  _, (batch_def, batch_static) = filtering.partition(batch)
  return jax.tree.structure(state.params), batch_def, batch_static


def _signature_problem(expected: _Signature, received: _Signature, batch: Any) -> str | None:
  """What changed since the first call, if anything did, as the ValueError's message."""
  for what, first, now in zip(("params", "batch"), expected, received):
    if first != now:
      return _STRUCTURE_MSG.format(what=what, expected=first, received=now)
  if expected[2] == received[2]:
    return None
  for (name, _), first, now in zip(_named_leaves("batch", batch), expected[2], received[2]):
    if first != now:
      return _STATIC_MSG.format(where=name, expected=_describe(first), received=_describe(now))
  return None


def _describe(static: filtering.Static | None) -> str:
  return "an array" if static is None else repr(static.value)


class FilteredJit:
  """``jax.jit`` for a function whose second argument has static leaves (like ``eqx.filter_jit``).

  The first argument (a :class:`TrainState`, whose static leaves are part of
  its tree structure) goes to ``jax.jit`` as it is, and is donated if
  ``donate``. The second is split by :func:`filtering.partition`: its static
  leaves are part of the compilation key and reach ``fn`` as the very same
  objects; only its arrays are traced. Static leaves of the output come back
  as the very same objects too.

  Examples:
    >>> import jax.numpy as jnp
    >>> double = FilteredJit(lambda x, rest: {"y": x * rest["n"], "act": rest["act"]}, False)
    >>> out = double(jnp.ones(2), {"n": 3.0, "act": "relu"})
    >>> out["y"].tolist(), out["act"]
    ([3.0, 3.0], 'relu')
  """

  def __init__(self, fn: Callable[..., Any], donate: bool):
    self._out_specs: dict[Any, Any] = {}

    def inner(first: Any, rest: list[Any], spec: Any) -> list[Any]:
      out_traced, self._out_specs[spec] = filtering.partition(fn(first, filtering.combine(rest, spec)))
      return out_traced

    self._jitted = jax.jit(inner, static_argnums=2, donate_argnums=(0,) if donate else ())

  def __call__(self, first: Any, rest: Any) -> Any:
    rest, spec = filtering.partition(rest)
    return filtering.combine(self._jitted(first, rest, spec), self._out_specs[spec])

  def method(self, name: str, first: Any, rest: Any) -> Any:
    """The jitted function's ``lower``, ``trace`` or ``eval_shape`` for these arguments."""
    rest, spec = filtering.partition(rest)
    out = getattr(self._jitted, name)(first, rest, spec)
    return filtering.combine(out, self._out_specs[spec]) if name == "eval_shape" else out


class _Retrace(Exception):
  """Raised when jax traces the step again after its first call, before ``loss_fn`` runs."""


class _SignatureError(ValueError):
  """A tree structure or static batch leaf that differs from the first call's."""


# The jax.jit methods that trace (TrainStep lets them trace, as a call that passed the checks).
_TRACING_METHODS = ("lower", "trace", "eval_shape")


class TrainStep:
  """The jitted step plus the checks that need Python: tree structures, donation.

  A call costs what a call of the underlying ``jax.jit`` costs, plus a type
  check and one read of ``state.step``: jax's C++ dispatch flattens the state
  and the batch (a :class:`TrainState` flattens with one attribute read) and
  finds the compiled program. The checks run where they cost nothing per call:

  - A state already consumed by a donating step is refused before dispatch
    (``state.step`` is deleted).
  - The first call records the params' and the batch's tree structures and
    the batch's static leaves. Any other structure, a changed static leaf, a
    Python number where the first call had an array, or a new shape changes
    what jax compiles for, so jax traces the step again. That trace stops
    before ``loss_fn`` runs (:class:`_Retrace`); the call then compares its
    own arguments with the first call's, refuses a change with a
    ``ValueError``, and lets a new shape or dtype trace and compile. A static
    leaf jax cannot take (a string where the first call had an array) fails
    in jax's argument handling, and is named the same way.
  - Other deleted or aliased input arrays are diagnosed only when the call
    fails.

  A batch with static leaves (a ``"split": "train"`` tag) goes through a
  :class:`FilteredJit` that keeps them static. Attribute access (``trace``,
  ``eval_shape``, ...) goes to the underlying ``jax.jit`` object; ``lower``,
  ``trace`` and ``eval_shape`` check their arguments as a call does.
  """

  def __init__(self, step: Callable[..., Any], donate: bool,
               inspect: Callable[[Any, TrainState, Any], None] | None = None):
    self._step = step
    self._inspect = inspect  # Reads the first call's traced program (half_share.check).
    self._jitted = jax.jit(self._traced, donate_argnums=(0,) if donate else ())
    self._filtered = FilteredJit(self._traced, donate)
    self._donate = donate
    self._signature: _Signature | None = None
    self._target: Any = None
    self._block = False
    # Set (per thread: a trace runs in its caller's thread) while a call
    # whose arguments passed the checks may trace.
    self._tracing = threading.local()
    self.__wrapped__ = self._jitted

  def _traced(self, state: TrainState, batch: Any) -> Any:
    """The step as jax traces it: a trace after the first call waits for the checks."""
    if self._signature is not None and not getattr(self._tracing, "allowed", False):
      raise _Retrace()
    return self._step(state, batch)

  def _choose(self, batch: Any) -> Any:
    return self._filtered if filtering.has_static(batch) else self._jitted

  def _checked(self, method: Callable[..., Any], state: Any, batch: Any) -> Any:
    """``method(state, batch)`` allowed to trace, once the arguments passed the checks."""
    if self._signature is not None:
      problem = _signature_problem(self._signature, _signature(state, batch), batch)
      if problem is not None:
        raise _SignatureError(problem)
    self._tracing.allowed = True
    try:
      return method(state, batch)
    finally:
      self._tracing.allowed = False

  def _method(self, name: str, state: Any, batch: Any) -> Any:
    """``jax.jit(...).<name>`` (``lower``, ``trace``, ``eval_shape``) for these arguments."""
    target = self._target or self._choose(batch)
    if target is self._filtered:
      return self._checked(functools.partial(target.method, name), state, batch)
    return self._checked(getattr(target, name), state, batch)

  def lower(self, state: TrainState, batch: Any) -> Any:
    """``jax.jit(...).lower`` for these arguments (static leaves included)."""
    return self._method("lower", state, batch)

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    if not isinstance(state, TrainState):
      raise TypeError(_not_a_state_message(state))
    step = state.step
    if type(step) not in _CONCRETE_ARRAY_TYPES or step.is_deleted():
      _check_not_donated(state, batch)
    if self._signature is None:
      return self._first_call(state, batch)
    try:
      out = self._target(state, batch)
    except _Retrace:
      out = self._explained(self._checked, self._target, state, batch)
    except (RuntimeError, ValueError, TypeError) as e:
      self._explain(state, batch, e)
      raise
    if self._block:
      jax.block_until_ready(out)
    return out

  def _first_call(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """The first call: chooses the jit, and records the signature once the call succeeds."""
    target = self._choose(batch)
    signature = _signature(state, batch)
    if self._inspect is not None and not checks.is_traced(state.step):
      # Traced once: the call below reuses this trace (jax caches it).
      trace = (functools.partial(target.method, "trace") if target is self._filtered
               else target.trace)
      self._inspect(self._explained(trace, state, batch).jaxpr.jaxpr, state, batch)
    out = self._explained(target, state, batch)
    self._signature, self._target = signature, target
    self._block = _multi_device_cpu((state, batch))
    if self._block:
      jax.block_until_ready(out)
    return out

  def _explained(self, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, a failure explained by :meth:`_explain` (``args`` end in state, batch)."""
    try:
      return call(*args)
    except _SignatureError:
      raise
    except (RuntimeError, ValueError, TypeError) as e:
      self._explain(args[-2], args[-1], e)
      raise

  def _explain(self, state: TrainState, batch: Any, error: Exception) -> None:
    """Raises a ValueError naming a changed signature or a donation problem behind ``error``.

    A call reaches here with ``state.step`` alive (:meth:`__call__` refuses a
    consumed state first). If it is deleted now, this very call donated the
    state and ran: ``error`` was raised while the step ran (``eqx.error_if``,
    ``checkify``, diffrax's maximum number of steps), and it is re-raised
    unchanged, not explained as a donation problem.
    """
    problem = None
    if self._signature is not None:
      problem = _signature_problem(self._signature, _signature(state, batch), batch)
    if problem is None and self._donate and not _consumed_by_the_call(state):
      problem = _donation_problem(state, batch)
    if problem is not None:
      raise ValueError(problem) from error

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in ("_jitted", "_filtered", "_tracing"):
      raise AttributeError(name)
    if name in _TRACING_METHODS:
      return functools.partial(self._method, name)
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

"""Reading jaxprs: sub-jaxprs, data flow and source lines.

Shared by :mod:`jmp_lite._src.diagnostics.lint` (which reads a jaxpr) and
:mod:`jmp_lite._src.autocast.autocast` (which re-evaluates one). Higher-order
primitives (``jit``, ``closed_call``, ``scan``, ``while``, ``cond``,
``remat``, ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``, ...) keep
their bodies in their params as ``Jaxpr`` or ``ClosedJaxpr`` values;
:func:`subjaxprs` finds them without a per-primitive table, so a new
higher-order primitive is walked too.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
from typing import Any, Callable, ContextManager, Iterator, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

try:  # Frames of a trace. JAX has no public API for them yet; degrade to no source.
  from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - depends on the JAX release.
  _source_info_util = None  # type: ignore[assignment]  # The fallback: no module.
try:  # Dead-code elimination of a jaxpr: no public API either; degrade to none.
  from jax._src.interpreters import partial_eval as _partial_eval
except ImportError:  # pragma: no cover - depends on the JAX release.
  _partial_eval = None  # type: ignore[assignment]  # The fallback: no module.

# Packages whose frames are not "user code" when naming a source line.
LIBRARIES = ("jax", "flax", "optax", "chex", "equinox", "haiku", "jmp", "jmp_lite")


def subjaxprs(eqn: Any) -> Iterator[Any]:
  """The (open) jaxprs held in ``eqn``'s params, in params order; not recursive."""
  return jex_core.jaxprs_in_params(eqn.params)


def walk(jaxpr: Any) -> Iterator[Any]:
  """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first, in program order.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...   return jax.lax.cond(x.sum() > 0, jnp.exp, jnp.log, x)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(2)).jaxpr
    >>> [e.primitive.name for e in walk(jaxpr) if e.primitive.name in ("exp", "log")]
    ['log', 'exp']
  """
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in subjaxprs(eqn):
      yield from walk(sub)


def without_dead_code(jaxpr: Any) -> Any:
  """``jaxpr`` less the equations whose outputs reach no output, as XLA drops them.

  A ``custom_vjp`` backward (an FP8 matmul's) computes the cotangents of all
  its inputs, also those nothing differentiates (the batch's); the compiled
  program does not. The inputs that nothing reads are dropped too. Returns
  ``jaxpr`` itself if this JAX release has no ``dce_jaxpr``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> jaxpr = jax.make_jaxpr(lambda x: (jnp.sin(x), jnp.cos(x))[0])(1.0).jaxpr
    >>> [e.primitive.name for e in without_dead_code(jaxpr).eqns]
    ['sin']
  """
  dce = getattr(_partial_eval, "dce_jaxpr", None)
  if dce is None:  # pragma: no cover - depends on the JAX release.
    return jaxpr
  return dce(jaxpr, [True] * len(jaxpr.outvars))[0]


def dtype_of(v: Any) -> Union[np.dtype, None]:
  """The numpy dtype of a jaxpr variable; ``None`` for tokens and PRNG keys."""
  dtype = getattr(getattr(v, "aval", None), "dtype", None)
  if dtype is None or jnp.issubdtype(dtype, jax.dtypes.extended):
    return None
  return np.dtype(dtype)


def is_floating(dtype: Any) -> bool:
  """True for real floating dtypes (float8 to float64); False for ``None``, keys, ints."""
  return dtype is not None and _is_floating(dtype)


@functools.lru_cache(maxsize=None)
def _is_floating(dtype: Any) -> bool:  # issubdtype is slow, and called per operand.
  return (not jnp.issubdtype(dtype, jax.dtypes.extended)
          and jnp.issubdtype(dtype, np.floating))


def bind(eqn: Any, args: list[Any], params: Union[Mapping[str, Any], None] = None) -> list[Any]:
  """Applies ``eqn``'s primitive to ``args`` (with ``params``, default its own); a list."""
  params = eqn.params if params is None else params
  out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


def eqn_context(eqn: Any) -> ContextManager[None]:
  """Re-binds under ``eqn``'s source line, name stack and context (compute type, mesh).

  Equations created inside it (the primitive re-bound, and any cast placed
  before it) carry the original equation's traceback, so that errors, HLO
  metadata and :func:`source_of` name the user's line, as
  ``jax.core.eval_jaxpr`` does.
  """
  return _EqnContext(eqn)


class _EqnContext:
  """:func:`eqn_context`, without ``contextlib.ExitStack``'s cost (it runs per equation)."""

  __slots__ = ("eqn", "managers")

  def __init__(self, eqn: Any) -> None:
    self.eqn = eqn
    self.managers: list[Any] = []

  def __enter__(self) -> None:
    eqn = self.eqn
    if _source_info_util is not None:
      name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
      self.managers.append(_source_info_util.user_context(
          eqn.source_info.traceback, name_stack=name_stack))
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
      self.managers.append(manager)
    for m in self.managers:
      m.__enter__()

  def __exit__(self, *exc: Any) -> None:
    for m in reversed(self.managers):
      m.__exit__(*exc)
    self.managers.clear()


def primitive_names() -> frozenset[str]:
  """Names of every primitive defined at module level in the imported modules.

  JAX has no public registry of primitives; this finds ``jax.lax``'s, the
  control-flow and random ones, and those of any library already imported
  (Pallas, Equinox, ...).
  """
  names: set[str] = set()
  for module in list(sys.modules.values()):
    try:
      values = list(vars(module).values())
    except TypeError:  # Modules without a __dict__.
      continue
    names.update(v.name for v in values if isinstance(v, jex_core.Primitive))
  return frozenset(names)


def last_uses(jaxpr: Any) -> list[list[Any]]:
  """Per equation, the variables it is the last reader of (outputs of ``jaxpr`` aside).

  An evaluator drops them after the equation, as ``jax.core.eval_jaxpr`` does,
  so that eager evaluation does not keep every intermediate array alive.
  """
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        last[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, jex_core.Var):  # An output may be a Literal (unhashable).
      last.pop(v, None)
  drops: list[list[Any]] = [[] for _ in jaxpr.eqns]
  for v, i in last.items():
    drops[i].append(v)
  return drops


def consumers(jaxpr: Any) -> Mapping[Any, list[Any]]:
  """Maps each variable of ``jaxpr`` to the equations that read it."""
  out: collections.defaultdict[Any, list[Any]] = collections.defaultdict(list)
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jex_core.Var):
        out[v].append(eqn)
  return out


def reaches(
    var: Any,
    readers: Mapping[Any, list[Any]],
    through: frozenset[str],
    hit: Callable[[Any], bool],
    max_hops: int = 4,
) -> list[Any]:
  """Equations satisfying ``hit`` reachable from ``var`` through ``through`` primitives."""
  found: list[Any] = []
  frontier, seen = [var], set()
  for _ in range(max_hops):
    nxt: list[Any] = []
    for v in frontier:
      for eqn in readers.get(v, ()):
        if id(eqn) in seen:
          continue
        seen.add(id(eqn))
        if hit(eqn):
          found.append(eqn)
        elif eqn.primitive.name in through:
          nxt.extend(eqn.outvars)
    frontier = nxt
  return found


_JAX_ROOT = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def written_convert(eqn: Any) -> bool:
  """Whether a ``convert_element_type`` was written, not made by ``jax.numpy``'s type promotion.

  Written: ``x.astype(...)``, ``jnp.asarray(x, dtype)``, ``lax.convert_element_type``,
  a layer casting to its ``dtype`` (Flax's ``promote_dtype``). Made by
  promotion: the convert of a half operand that a ``jax.numpy`` operation
  meets with a float32 one (``x + table``), bound inside ``jax.numpy``'s
  ``promote_dtypes`` or inlined from its jitted operation. Read from the
  equation's traceback (the functions of JAX's own frames); ``False`` where
  it has none.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, table: (x.astype(jnp.float32), x + table)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(2, jnp.float16), jnp.ones(2)).jaxpr
    >>> [written_convert(e) for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    [True, False]
  """
  frames = getattr(getattr(getattr(eqn, "source_info", None), "traceback", None), "frames", None)
  if eqn.primitive.name != "convert_element_type" or not frames:
    return False
  names = [f.function_name for f in frames if os.path.abspath(f.file_name).startswith(_JAX_ROOT)]
  return "_convert_element_type" in names and not any(
      n.lstrip("_").startswith("promote_") for n in names)


def library_roots() -> tuple[str, ...]:
  """Directories of the imported :data:`LIBRARIES`, each ending in a separator."""
  roots = []
  for name in LIBRARIES:
    file = getattr(sys.modules.get(name), "__file__", None)
    if file:
      roots.append(os.path.dirname(os.path.abspath(file)) + os.sep)
  return tuple(roots)


def source_of(eqn: Any, roots: tuple[str, ...], fallback: bool = True) -> Union[str, None]:
  """``"file:line (function)"`` of the first frame outside ``roots``, or ``None``.

  Without such a frame: the first frame inside ``roots`` if ``fallback``, else ``None``.
  """
  user, frames = _frames(eqn, roots)
  if not (user or (frames and fallback)):
    return None
  return _where((user or frames)[0])


def user_sources(eqn: Any, roots: tuple[str, ...]) -> list[str]:
  """Every user frame of ``eqn``'s traceback (``roots``' too), as :func:`source_of` writes one.

  A jaxpr that JAX cached (``jnp.matmul``'s body, a helper under ``jit``) keeps
  the traceback of its first trace: when the call being read is not among
  these frames, the equation's own source belongs to another call site.
  """
  return [_where(f) for f in _frames(eqn, roots)[1]]


def _frames(eqn: Any, roots: tuple[str, ...]) -> tuple[list[Any], list[Any]]:
  """(frames outside ``roots``, all user frames) of ``eqn``'s traceback."""
  if _source_info_util is None or eqn is None:
    return [], []
  frames = list(_source_info_util.user_frames(eqn.source_info.traceback))
  return [f for f in frames if not os.path.abspath(f.file_name).startswith(roots)], frames


def _where(frame: Any) -> str:
  name = frame.file_name
  try:
    rel = os.path.relpath(name)
    name = rel if not rel.startswith("..") else name
  except ValueError:  # Another drive on Windows.
    pass
  return f"{name}:{frame.start_line} ({frame.function_name})"

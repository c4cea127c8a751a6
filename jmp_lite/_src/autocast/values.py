"""Autocast's values: dtypes, constants, deferred data movement and casts.

The interpreter (:mod:`autocast_interpret`) holds each value of a jaxpr as a
concrete value (an array or a tracer, or a NumPy constant for a literal), a
node of a float32 region (:mod:`autocast_regions`), or a :class:`Moved`: data
movement put off until a consumer asks for a dtype. This module has what
reads and casts them, and the helpers the control-flow handlers share.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src.autocast import promote as rules
from jmp_lite._src.autocast import regions
from jmp_lite._src import jaxpr_utils

F32 = rules.F32
HALVES = rules.HALVES
# The dtypes autocast may change. float64, float8 and complex values are never
# cast, and an operation that reads one runs in its original dtypes (torch
# leaves float64 alone too).
ELIGIBLE = frozenset(HALVES + (F32,))

_CONSTANTS = (np.ndarray, np.generic, int, float)
# jax.core is being slimmed down release by release; without Tracer, arrays count as traced.
TRACER = getattr(getattr(jax, "core", None), "Tracer", None)


def is_constant_value(x: Any) -> bool:
  """A NumPy or Python number (a literal of the jaxpr), not an array of JAX."""
  return isinstance(x, _CONSTANTS) and not isinstance(x, jax.Array)


def value_dtype(x: Any) -> Union[np.dtype, None]:
  """The dtype of a value (a virtual node's half dtype); ``None`` for keys, tokens, non-arrays."""
  virtual = getattr(x, "virtual", None)
  if virtual is not None:
    return virtual
  dtype = getattr(x, "dtype", None)
  return None if dtype is None or extended(dtype) else np.dtype(dtype)


@functools.lru_cache(maxsize=None)
def extended(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jax.dtypes.extended)


def binder(eqn: Any, params: Any) -> Callable[..., Any]:
  return lambda *args: jaxpr_utils.bind(eqn, list(args), params)[0]


class Moved:
  """A broadcast, reshape, squeeze or transpose of ``src``, done when its dtype is known.

  Autocast casts before moving data, not after: a float16 bias broadcast to
  an activation's shape and then needed in float32 is cast once, at its own
  size, and then broadcast (as a hand-written ``bias.astype(f32)`` would be),
  so the backward pass also sums the broadcast's cotangent in float32, and a
  float32 region reads the bias, not its broadcast.
  """

  __slots__ = ("src", "steps", "dtype", "shape", "_done", "_nodes")

  def __init__(self, src: Any, steps: tuple[Any, ...]) -> None:
    self.src, self.steps, self.dtype = src, steps, value_dtype(src)
    self.shape = tuple(steps[-1].outvars[0].aval.shape)
    self._done: dict[Any, Any] = {}
    self._nodes: dict[Any, Any] = {}

  @property
  def virtual(self) -> Union[np.dtype, None]:
    return getattr(self.src, "virtual", None)

  def get(self, ev: Any, dtype: Any = None) -> Any:
    """The moved value in ``dtype`` (default: the source's), computed once per dtype."""
    dtype = self.dtype if dtype is None else dtype
    if dtype not in self._done:
      x = ev.cast(self.src, dtype)
      for eqn in self.steps:
        with jaxpr_utils.eqn_context(eqn):
          (x,) = jaxpr_utils.bind(eqn, [x])
      self._done[dtype] = x
    return self._done[dtype]

  def node(self, ev: Any, dtype: Any) -> Any:
    """The moved value in ``dtype`` as region nodes (the cast and the moves in the region)."""
    hit = self._nodes.get(dtype)
    if hit is not None and not hit.region.done:
      return hit
    x = ev.pcast(self.src, dtype)
    for eqn in self.steps:
      x = regions.node(binder(eqn, eqn.params), [x], dtype, eqn.outvars[0].aval.shape, eqn)
    self._nodes[dtype] = x
    return x


def pending_of(x: Any) -> Union[regions.Node, None]:
  """The region node ``x`` holds (itself, or the source of its moves)."""
  if isinstance(x, Moved):
    x = x.src
  return x if isinstance(x, regions.Node) and not x.region.done else None


def held_of(x: Any) -> Union[regions.Node, None]:
  """The float32 chain's node ``x`` holds (itself, or the source of its moves), bound or not."""
  if isinstance(x, Moved):
    x = x.src
  return x if isinstance(x, regions.Node) and x.held else None


def constant_of(x: Any) -> Any:
  """The value of a constant operand (a literal, a broadcast of one); ``None`` if traced."""
  if isinstance(x, Moved):
    return constant_of(x.src)
  if is_constant_value(x):
    return x
  if (isinstance(x, jax.Array) and TRACER is not None and not isinstance(x, TRACER)
      and x.size <= 16):
    return np.asarray(x)
  return None


def saturated(x: Any, dtype: np.dtype) -> Any:
  """A constant (or a move of one) saturated at ``dtype``'s largest finite value; else ``x``."""
  if is_constant_value(x):
    return rules.saturate(x, dtype) if jaxpr_utils.is_floating(value_dtype(x)) else x
  if isinstance(x, Moved) and is_constant_value(x.src):
    return Moved(saturated(x.src, dtype), x.steps)
  return x


def cast(x: Any, dtype: Any, cache: dict[Any, Any]) -> Any:
  """Concrete ``x`` in ``dtype``; literals stay NumPy constants, one convert per value."""
  if value_dtype(x) == dtype:
    return x
  if is_constant_value(x):
    return np.asarray(x, dtype)
  key = (id(x), dtype)
  hit = cache.get(key)
  if hit is None:
    hit = cache[key] = (x, jax.lax.convert_element_type(x, dtype))
  return hit[1]


def _widest(dtypes: Iterable[Any]) -> np.dtype:
  return functools.reduce(lambda a, b: np.dtype(jnp.promote_types(a, b)), dtypes)


def join(a: Union[np.dtype, None], b: Union[np.dtype, None]) -> Union[np.dtype, None]:
  """The carry dtype for ``a`` in and ``b`` out: the wider, if both may be cast."""
  if a in ELIGIBLE and b in ELIGIBLE:
    return _widest((a, b))
  return a


def cast_all(xs: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
  """Each ``x`` in its ``dtype``; values whose dtype autocast may not change stay as they are."""
  casts: dict[Any, Any] = {}
  return [x if d not in ELIGIBLE else cast(x, d, casts) for x, d in zip(xs, dtypes)]


def retarget(eqn: Any, target: np.dtype) -> Any:
  """``eqn``'s params with a floating ``preferred_element_type`` set to ``target``.

  A ``preferred_element_type`` that none of the traced operands has was asked
  for on purpose (``jnp.einsum(f16, f16, preferred_element_type=jnp.float32)``)
  and is kept; one that an operand has (what ``jnp.matmul`` and
  ``jnp.einsum`` pass after promoting) follows the operands. A scatter's
  combiner (its ``update_jaxpr``, typed in the traced dtype) is traced again
  in ``target``.
  """
  update = eqn.params.get("update_jaxpr")
  if update is not None and not eqn.params.get("update_consts"):  # A scatter's combiner.
    return {**eqn.params, "update_jaxpr": _combiner(update, np.dtype(target))}
  pet = eqn.params.get("preferred_element_type")
  if pet is None or not jaxpr_utils.is_floating(pet):
    return eqn.params
  if np.dtype(pet) not in {jaxpr_utils.dtype_of(v) for v in eqn.invars}:
    return eqn.params
  return {**eqn.params, "preferred_element_type": target}


@functools.lru_cache(maxsize=256)
def _combiner(update: Any, dtype: np.dtype) -> Any:
  """A scatter's ``update_jaxpr`` (``add`` of two scalars, say) traced again on ``dtype`` scalars."""
  if all(jaxpr_utils.dtype_of(v) == dtype for v in update.invars):
    return update
  scalar = jax.ShapeDtypeStruct((), dtype)
  fun = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(update, ()))
  return jax.make_jaxpr(lambda a, b: fun(a, b)[0])(scalar, scalar).jaxpr


def is_constant(atom: Any) -> bool:
  """A literal, or a weakly typed value (from a Python scalar)."""
  return isinstance(atom, jex_core.Literal) or getattr(atom.aval, "weak_type", False)


def bind_original(
    eqn: Any, ins: Sequence[Any], casts: Union[dict[Any, Any], None] = None
) -> list[Any]:
  """``eqn`` applied as traced to concrete ``ins``: floating inputs cast back to the declared dtypes."""
  casts = {} if casts is None else casts
  ins = [cast(x, np.dtype(v.aval.dtype), casts) if jaxpr_utils.is_floating(value_dtype(x))
         else x for x, v in zip(ins, eqn.invars)]
  return jaxpr_utils.bind(eqn, ins)



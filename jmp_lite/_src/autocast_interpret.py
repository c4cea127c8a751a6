"""The autocast interpreter: evaluates a jaxpr again, choosing each operation's dtypes.

:func:`eval_jaxpr` walks a jaxpr's equations and, for each primitive, casts
its floating inputs by the rule of its list (:mod:`autocast_lists`): half,
float32, promote, or the traced dtypes. Two registries extend it without an
import of their modules here:

* :data:`HANDLERS`: one function per higher-order primitive (``jit``,
  ``scan``, ``cond``, ...), filled by :mod:`autocast` with the handlers of
  :mod:`autocast_control`; a handler evaluates its sub-jaxprs with
  :func:`eval_jaxpr` and re-binds them.
* :data:`HALF_RULES`: per-op rules for half-list primitives (an FP8 matmul),
  called after the inputs are cast to the half dtype (:func:`register_half_rule`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src import autocast_lists
from jmp_lite._src import jaxpr_utils

F32 = np.dtype(jnp.float32)
HALVES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# The dtypes autocast may change. float64, float8 and complex values are never
# cast, and an operation that reads one runs in its original dtypes (torch
# leaves float64 alone too).
ELIGIBLE = frozenset(HALVES + (F32,))


@dataclasses.dataclass(frozen=True)
class _Config:
  """What one :func:`autocast` evaluates with; hashable (it keys the nested-jit cache).

  Attributes:
    dtype: the half dtype, float16 or bfloat16.
    lists: the op lists.
    fp8: an opaque, hashable recipe that a half rule may read (``None``: off).
  """

  dtype: np.dtype
  lists: autocast_lists.AutocastLists
  fp8: Any = None


# ---------------------------------------------------------------------------
# Registries: higher-order primitives and per-op half rules.

Handler = Callable[[Any, list[Any], _Config], list[Any]]
HalfRule = Callable[[Any, list[Any], _Config], Union[list[Any], None]]

# Higher-order primitive name -> its handler, given the inputs as values.
HANDLERS: dict[str, Handler] = {}
# Half-list primitive name -> its rule (see register_half_rule).
HALF_RULES: dict[str, HalfRule] = {}

_NOT_OWN_MSG = ("a handler for {name!r} needs the name in autocast_lists.OWN_RULES, "
                "so that no AutocastLists list holds it")


def register_handler(name: str, fn: Handler, params: tuple[str, ...]) -> None:
  """Makes ``fn`` autocast's rule for the higher-order primitive ``name``.

  ``params`` are the equation params ``fn`` reads: an equation that lacks one
  (a JAX release that renamed it) runs as traced instead of failing.

  Raises:
    ValueError: if ``name`` is not in :data:`autocast_lists.OWN_RULES`.
  """
  if name not in autocast_lists.OWN_RULES:
    raise ValueError(_NOT_OWN_MSG.format(name=name))

  def guarded(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
    if not all(k in eqn.params for k in params):
      return bind_original(eqn, ins)
    return fn(eqn, ins, cfg)

  HANDLERS[name] = guarded


def register_half_rule(name: str, rule: HalfRule) -> None:
  """Runs ``rule(eqn, ins, cfg)`` for each half-list primitive ``name``.

  The interpreter calls it where the primitive would be bound, after casting
  its floating inputs ``ins`` to ``cfg.dtype``; it returns the outputs, or
  ``None`` for the ordinary bind. It is not called where the primitive runs
  in another list or as traced (float64 operands, ``lists`` moved it).
  Nested jits are interpreted once per config and cached: register rules at
  import, before autocast runs. A name has one rule: registering replaces
  the previous one (autocast registers its FP8 rule for ``dot_general``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> seen, previous = [], HALF_RULES.get("dot_general")
    >>> def note(eqn, ins, cfg):
    ...   seen.append((eqn.primitive.name, str(ins[0].dtype)))
    ...   return None  # the ordinary bind
    >>> register_half_rule("dot_general", note)
    >>> out = jmp.autocast(lambda a: a @ a, jnp.bfloat16)(jnp.ones((2, 2)))
    >>> seen, str(out.dtype)
    ([('dot_general', 'bfloat16')], 'bfloat16')
    >>> register_half_rule("dot_general", previous)  # autocast's FP8 rule back
  """
  HALF_RULES[name] = rule


# ---------------------------------------------------------------------------
# Values: dtypes, weak types and casts.


def value_dtype(x: Any) -> Union[np.dtype, None]:
  """The dtype of a value; ``None`` for PRNG keys, tokens and other non-arrays."""
  dtype = getattr(x, "dtype", None)
  return None if dtype is None or _extended(dtype) else np.dtype(dtype)


@functools.lru_cache(maxsize=None)
def _extended(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jax.dtypes.extended)


class _Moved:
  """A broadcast, reshape, squeeze or transpose of ``src``, done when its dtype is known.

  Autocast casts before moving data, not after: a float16 bias broadcast to
  an activation's shape and then needed in float32 is cast once, at its own
  size, and then broadcast (as a hand-written ``bias.astype(f32)`` would be),
  so the backward pass also sums the broadcast's cotangent in float32.
  """

  __slots__ = ("src", "steps", "dtype", "_done")

  def __init__(self, src: Any, steps: tuple[Any, ...]) -> None:
    self.src, self.steps, self.dtype = src, steps, value_dtype(src)
    self._done: dict[Any, Any] = {}

  def get(self, dtype: Any = None) -> Any:
    """The moved value in ``dtype`` (default: the source's), computed once per dtype."""
    dtype = self.dtype if dtype is None else dtype
    if dtype not in self._done:
      x = self.src if dtype == self.dtype else jax.lax.convert_element_type(self.src, dtype)
      for eqn in self.steps:
        with jaxpr_utils.eqn_context(eqn):
          (x,) = jaxpr_utils.bind(eqn, [x])
      self._done[dtype] = x
    return self._done[dtype]


def _value(x: Any) -> Any:
  """``x`` itself, or a deferred move done in its own dtype."""
  return x.get() if isinstance(x, _Moved) else x


def _cast(x: Any, dtype: Any, cache: dict[Any, Any]) -> Any:
  """``x`` in ``dtype``; literals stay NumPy constants, one convert per value."""
  if isinstance(x, _Moved):
    return x.get(dtype)
  if value_dtype(x) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic, int, float)) and not isinstance(x, jax.Array):
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
  return [x if d not in ELIGIBLE else _cast(x, d, casts) for x, d in zip(xs, dtypes)]


# ---------------------------------------------------------------------------
# The interpreter.


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], cfg: _Config) -> list[Any]:
  """Evaluates an open ``jaxpr`` on ``args`` with autocast's per-op dtypes."""
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  casts: dict[Any, Any] = {}
  for eqn, dead in zip(jaxpr.eqns, jaxpr_utils.last_uses(jaxpr)):
    ins = [read(v) for v in eqn.invars]
    with jaxpr_utils.eqn_context(eqn):
      outs = _eval_eqn(eqn, ins, cfg, casts)
    env.update(zip(eqn.outvars, outs))
    for v in dead:
      del env[v]
  return [_value(read(v)) for v in jaxpr.outvars]


def eval_closed(closed: Any, args: Sequence[Any], cfg: _Config) -> list[Any]:
  """:func:`eval_jaxpr` of a ``ClosedJaxpr``."""
  return eval_jaxpr(closed.jaxpr, closed.consts, args, cfg)


# Data movement deferred until a consumer asks for a dtype (see _Moved).
_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose"})
# The default lists hold first-order primitives only; other names may carry
# sub-jaxprs typed in the traced dtypes, which must then run as traced.
_FIRST_ORDER = autocast_lists.HALF_OPS | autocast_lists.FLOAT32_OPS | autocast_lists.PROMOTE_OPS


def _eval_eqn(eqn: Any, ins: list[Any], cfg: _Config, casts: dict[Any, Any]) -> list[Any]:
  name = eqn.primitive.name
  handler = HANDLERS.get(name)
  if handler is not None:
    return handler(eqn, [_value(x) for x in ins], cfg)
  if name == "convert_element_type":
    return _convert(eqn, ins, casts)
  floats = [i for i, x in enumerate(ins) if jaxpr_utils.is_floating(value_dtype(x))]
  if not floats:  # Integers, bools, keys: untouched.
    return jaxpr_utils.bind(eqn, ins)
  dtypes: list[Any] = [value_dtype(ins[i]) for i in floats]
  rule = cfg.lists.rule(name)
  if name == "mul" and eqn.invars[0] is eqn.invars[1] and rule == "promote":
    rule = cfg.lists.rule("square")  # x * x is a square (jnp.linalg.norm writes it so).
  if (rule != "original" and (any(d not in ELIGIBLE for d in dtypes)
                              or (name not in _FIRST_ORDER and any(jaxpr_utils.subjaxprs(eqn)))
                              or eqn.params.get("out_dtype") is not None)):
    rule = "original"  # float64/float8/complex operands, or sub-jaxprs typed in the old dtypes.
  if rule == "original":
    for i in floats:
      ins[i] = _cast(ins[i], np.dtype(eqn.invars[i].aval.dtype), casts)
    return jaxpr_utils.bind(eqn, ins)
  if rule == "promote" and name in _MOVES and len(ins) == 1:
    x = ins[0]
    return [_Moved(x.src, x.steps + (eqn,)) if isinstance(x, _Moved) else _Moved(x, (eqn,))]
  if rule == "half":
    target = cfg.dtype
  elif rule == "float32":
    target = F32
  elif all(d == dtypes[0] for d in dtypes):
    target = dtypes[0]
  else:
    target = _promote_target(eqn, ins, floats)
  for i in floats:
    ins[i] = _cast(ins[i], target, casts)
  half_rule = HALF_RULES.get(name) if rule == "half" else None
  outs = None if half_rule is None else half_rule(eqn, ins, cfg)
  return jaxpr_utils.bind(eqn, ins, retarget(eqn, target)) if outs is None else outs


def _promote_target(eqn: Any, ins: list[Any], floats: list[int]) -> np.dtype:
  """The widest dtype among the floating operands, constants aside if they fit.

  A jaxpr records Python scalars as strongly typed literals, so ``h * 0.5``
  and ``h * jnp.float32(0.5)`` look alike; a literal, or a weakly typed value,
  does not widen the operation unless its value overflows or underflows (is
  below the smallest normal number) in the dtype of the other operands.
  """

  def constant(i: int) -> bool:
    return _is_constant(eqn.invars[i])

  strong = [value_dtype(ins[i]) for i in floats if not constant(i)]
  if not strong:
    return _widest(value_dtype(ins[i]) for i in floats)
  target = _widest(strong)
  for i in floats:
    if constant(i) and not _fits(ins[i], target):
      target = _widest((target, value_dtype(ins[i])))
  return target


def _fits(x: Any, dtype: np.dtype) -> bool:
  """Whether a constant keeps its magnitude in ``dtype`` (traced values: assumed so)."""
  if not isinstance(x, (np.ndarray, np.generic, int, float)) or isinstance(x, jax.Array):
    return True
  v = np.abs(np.asarray(x, np.float64))
  info = jnp.finfo(dtype)
  ok = (v == 0) | ~np.isfinite(v) | ((v >= float(info.tiny)) & (v <= float(info.max)))
  return bool(np.all(ok))


def retarget(eqn: Any, target: np.dtype) -> Any:
  """``eqn``'s params with a floating ``preferred_element_type`` set to ``target``.

  A ``preferred_element_type`` that none of the traced operands has was asked
  for on purpose (``jnp.einsum(f16, f16, preferred_element_type=jnp.float32)``)
  and is kept; one that an operand has (what ``jnp.matmul`` and
  ``jnp.einsum`` pass after promoting) follows the operands.
  """
  pet = eqn.params.get("preferred_element_type")
  if pet is None or not jaxpr_utils.is_floating(pet):
    return eqn.params
  if np.dtype(pet) not in {jaxpr_utils.dtype_of(v) for v in eqn.invars}:
    return eqn.params
  return {**eqn.params, "preferred_element_type": target}


def _convert(eqn: Any, ins: list[Any], casts: dict[Any, Any]) -> list[Any]:
  """convert_element_type: float32 to float16/bfloat16 is kept wide; the rest is done.

  Constants are the exception: a literal or a weakly typed operand (a Python
  scalar that ``jnp.where``/``jnp.clip`` pass along) takes the half dtype, as
  written, so that it does not widen the tensor it meets. A convert between
  float16, bfloat16 and float32 shares autocast's cache of casts, so that
  ``jnp.mean(x)`` and ``x - mean`` convert ``x`` once (and the backward pass
  adds their cotangents before converting back, as hand-written code would).
  """
  (x,) = ins
  new = np.dtype(eqn.params["new_dtype"]) if not _extended(eqn.params["new_dtype"]) else None
  if value_dtype(x) == F32 and new in HALVES and not _is_constant(eqn.invars[0]):
    return [x]
  if (new in ELIGIBLE and value_dtype(x) in ELIGIBLE and not eqn.params.get("weak_type")
      and eqn.params.get("sharding") is None):
    return [_cast(x, new, casts)]  # Shared with autocast's own casts of ``x``.
  return jaxpr_utils.bind(eqn, [_value(x)])


def _is_constant(atom: Any) -> bool:
  """A literal, or a weakly typed value (from a Python scalar)."""
  return isinstance(atom, jex_core.Literal) or getattr(atom.aval, "weak_type", False)


def bind_original(
    eqn: Any, ins: Sequence[Any], casts: Union[dict[Any, Any], None] = None
) -> list[Any]:
  """``eqn`` applied as traced: floating inputs cast back to the declared dtypes."""
  casts = {} if casts is None else casts
  ins = [_cast(x, np.dtype(v.aval.dtype), casts) if jaxpr_utils.is_floating(value_dtype(x))
         else _value(x) for x, v in zip(ins, eqn.invars)]
  return jaxpr_utils.bind(eqn, ins)

"""Autocast: per-operation mixed precision for any JAX function, as a function transform.

``autocast(fun, dtype)`` traces ``fun`` to a jaxpr and evaluates that jaxpr
again, choosing each operation's precision from three public lists (the
half list, the float32 list and the promote list), as ``torch.autocast``
does per ATen op. Sub-jaxprs (``jit``, ``scan``, ``while``, ``cond``,
``checkpoint``, ``custom_jvp``/``custom_vjp``, ``shard_map``) are evaluated the
same way: a nested jit is re-bound with its evaluated jaxpr, the others
through JAX's public APIs (``jax.lax.scan``, ``jax.custom_vjp``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterable, ParamSpec, Sequence, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jmp_lite._src import jaxpr_utils

T = TypeVar("T")
P = ParamSpec("P")

_F32 = np.dtype(jnp.float32)
_HALVES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# The dtypes autocast may change. float64, float8 and complex values are never
# cast, and an operation that reads one runs in its original dtypes (torch
# leaves float64 alone too).
_ELIGIBLE = frozenset(_HALVES + (_F32,))

# torch's lower-precision (fp16) list: matmuls, convolutions and the ops built on
# them (linear, bmm, einsum, RNN cells, attention). In JAX all of these lower to
# these primitives.
HALF_OPS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})

# torch's fp32 and fp32_set_opt_dtype lists, as the primitives their ops lower to:
# softmax, log_softmax, logsumexp, norms, variances and losses are built from
# these, so they run in float32 too.
FLOAT32_OPS = frozenset({
    # Pointwise ops that overflow or lose precision in half.
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "erf_inv", "acos", "asin", "cosh", "sinh", "tan",
    # Reductions (jnp.sum, jnp.mean, jnp.var, jnp.prod, jnp.cumsum, ...).
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
})

# torch's promote list, widened to every primitive that computes in the dtype of
# its floating inputs: it runs in the widest floating dtype among them.
PROMOTE_OPS = frozenset({
    # Arithmetic and comparisons.
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min",
    "nextafter", "atan2", "clamp", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "is_finite", "floor", "ceil", "round",
    # Pointwise functions that are safe in half precision.
    "sqrt", "cbrt", "sin", "cos", "tanh", "atan", "acosh", "asinh", "atanh", "logistic",
    "erf", "erfc", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma",
    "zeta", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "reduce_precision",
    # Exact reductions, sorting and windows.
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin", "sort", "top_k",
    "approx_top_k", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    # Data movement.
    "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "split", "tile", "stack",
    "unstack", "copy", "stop_gradient", "zeros_like", "optimization_barrier",
    "device_put", "name",
    # Sharding and collectives (their operands keep their dtypes).
    "sharding_constraint", "reshard", "psum", "psum_invariant", "pmax", "pmin", "pvary",
    "pbroadcast", "all_gather", "all_gather_invariant", "all_to_all", "ppermute",
    "reduce_scatter",
})

_TARGETS = ("half", "float32", "promote", "original")

_LISTS_MSG = "{field} must be a collection of primitive names (or jax Primitives), got {value!r}"
_UNKNOWN_MSG = ("unknown primitive name(s) {names} for AutocastLists.{field}: not a primitive "
                "of JAX or of an imported library (e.g. 'exp', 'dot_general', 'reduce_sum')")
_OWN_MSG = ("{names} for AutocastLists.{field}: autocast has its own rule for it "
            "(it recurses into control flow, calls and custom derivatives, and decides "
            "convert_element_type itself)")
_OVERLAP_MSG = "primitive(s) {names} appear in both AutocastLists.{a} and AutocastLists.{b}"
_DTYPE_MSG = "dtype must be jnp.float16 or jnp.bfloat16, got {value!r}"


def _as_names(field: str, value: Any) -> frozenset[str]:
  if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
    raise TypeError(_LISTS_MSG.format(field=field, value=value))
  names = set()
  for item in value:
    if isinstance(item, jex_core.Primitive):
      item = item.name
    if not isinstance(item, str):
      raise TypeError(_LISTS_MSG.format(field=field, value=value))
    names.add(item)
  return frozenset(names)


def _check_known(field: str, names: frozenset[str]) -> None:
  own = names & _OWN_RULES
  if own:
    raise ValueError(_OWN_MSG.format(names=sorted(own), field=field))
  new = names - HALF_OPS - FLOAT32_OPS - PROMOTE_OPS
  if new:  # Only names beyond the defaults need the (slower) registry scan.
    unknown = new - jaxpr_utils.primitive_names()
    if unknown:
      raise ValueError(_UNKNOWN_MSG.format(names=sorted(unknown), field=field))


@dataclasses.dataclass(frozen=True)
class AutocastLists:
  """The op lists of :func:`autocast`: which primitives run in which precision.

  Every primitive (by its jaxpr name, ``jax.extend.core.Primitive.name``) is in
  at most one list:

  * ``half``: floating inputs are cast to the autocast dtype, and so is the
    output (by default ``dot_general``, ``conv_general_dilated``,
    ``ragged_dot_general``: matmuls and convolutions).
  * ``float32``: half inputs are cast to float32; the output is float32
    (by default exp, log, pow, rsqrt, sums, products, ...).
  * ``promote``: floating inputs are cast to the widest floating dtype among
    them, constants not counting unless they do not fit (by default every
    other primitive that computes in its inputs' dtype).
  * in none of them ("original"): the primitive runs in the dtypes of the
    traced program; inputs that autocast changed are cast back first. This is
    also what happens to primitives autocast does not know (callbacks,
    Pallas kernels, linear algebra, scatters, anything new).

  Build a variant with :meth:`move`. Unknown names are a ``ValueError``.

  Attributes:
    half: names of the half-list primitives.
    float32: names of the float32-list primitives.
    promote: names of the promote-list primitives.

  Examples:
    >>> import jmp_lite as jmp
    >>> lists = jmp.AutocastLists().move("tanh", "logistic", to="float32")
    >>> "tanh" in lists.float32, "tanh" in lists.promote
    (True, False)
    >>> lists.rule("dot_general"), lists.rule("pure_callback")
    ('half', 'original')
  """

  half: frozenset[str] = HALF_OPS
  float32: frozenset[str] = FLOAT32_OPS
  promote: frozenset[str] = PROMOTE_OPS

  def __post_init__(self) -> None:
    fields = ("half", "float32", "promote")
    for field in fields:
      object.__setattr__(self, field, _as_names(field, getattr(self, field)))
    for i, a in enumerate(fields):
      for b in fields[i + 1:]:
        both = getattr(self, a) & getattr(self, b)
        if both:
          raise ValueError(_OVERLAP_MSG.format(names=sorted(both), a=a, b=b))
    for field in fields:
      _check_known(field, getattr(self, field))

  def move(self, *names: Union[str, jex_core.Primitive], to: str) -> "AutocastLists":
    """A copy with ``names`` moved to list ``to`` (out of any other list).

    Args:
      *names: primitive names (``"tanh"``) or primitives (``jax.lax.tanh_p``).
      to: ``"half"``, ``"float32"``, ``"promote"``, or ``"original"`` (no list:
        run in the traced program's dtypes).

    Returns:
      The new lists.

    Raises:
      ValueError: if ``to`` is not one of those, or a name is not a known
        primitive or is one autocast has its own rule for.
      TypeError: if a name is not a string or primitive.
    """
    if to not in _TARGETS:
      raise ValueError(f"to must be one of {_TARGETS}, got {to!r}")
    moved = _as_names("names", names)
    _check_known(to, moved)
    lists = {f: getattr(self, f) - moved for f in ("half", "float32", "promote")}
    if to != "original":
      lists[to] = lists[to] | moved
    return AutocastLists(**lists)

  def rule(self, name: str) -> str:
    """``"half"``, ``"float32"``, ``"promote"`` or ``"original"`` for primitive ``name``."""
    return self._rules.get(name, "original")

  @functools.cached_property
  def _rules(self) -> dict[str, str]:
    return {n: f for f in ("half", "float32", "promote") for n in getattr(self, f)}


@dataclasses.dataclass(frozen=True)
class _Config:
  dtype: np.dtype
  lists: AutocastLists


def _check_dtype(dtype: Any) -> np.dtype:
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(_DTYPE_MSG.format(value=dtype)) from e
  if isinstance(dtype, bool) or dt not in _HALVES:
    raise ValueError(_DTYPE_MSG.format(value=dtype))
  return dt


# ---------------------------------------------------------------------------
# Values: dtypes, weak types and casts.


def _dtype(x: Any) -> Union[np.dtype, None]:
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
    self.src, self.steps, self.dtype = src, steps, _dtype(src)
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
  if _dtype(x) == dtype:
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


def _join(a: Union[np.dtype, None], b: Union[np.dtype, None]) -> Union[np.dtype, None]:
  """The carry dtype for ``a`` in and ``b`` out: the wider, if both may be cast."""
  if a in _ELIGIBLE and b in _ELIGIBLE:
    return _widest((a, b))
  return a


# ---------------------------------------------------------------------------
# The interpreter.


def _eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], cfg: _Config) -> list[Any]:
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


def _eval_closed(closed: Any, args: Sequence[Any], cfg: _Config) -> list[Any]:
  return _eval_jaxpr(closed.jaxpr, closed.consts, args, cfg)


# Data movement deferred until a consumer asks for a dtype (see _Moved).
_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose"})
# The default lists hold first-order primitives only; other names may carry
# sub-jaxprs typed in the traced dtypes, which must then run as traced.
_FIRST_ORDER = HALF_OPS | FLOAT32_OPS | PROMOTE_OPS


def _eval_eqn(eqn: Any, ins: list[Any], cfg: _Config, casts: dict[Any, Any]) -> list[Any]:
  name = eqn.primitive.name
  handler = _HANDLERS.get(name)
  if handler is not None:
    return handler(eqn, [_value(x) for x in ins], cfg)
  if name == "convert_element_type":
    return _convert(eqn, ins, casts)
  floats = [i for i, x in enumerate(ins) if jaxpr_utils.is_floating(_dtype(x))]
  if not floats:  # Integers, bools, keys: untouched.
    return jaxpr_utils.bind(eqn, ins)
  dtypes: list[Any] = [_dtype(ins[i]) for i in floats]
  rule = cfg.lists.rule(name)
  if name == "mul" and eqn.invars[0] is eqn.invars[1] and rule == "promote":
    rule = cfg.lists.rule("square")  # x * x is a square (jnp.linalg.norm writes it so).
  if (rule != "original" and (any(d not in _ELIGIBLE for d in dtypes)
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
    target = _F32
  elif all(d == dtypes[0] for d in dtypes):
    target = dtypes[0]
  else:
    target = _promote_target(eqn, ins, floats)
  for i in floats:
    ins[i] = _cast(ins[i], target, casts)
  return jaxpr_utils.bind(eqn, ins, _retarget(eqn, target))


def _promote_target(eqn: Any, ins: list[Any], floats: list[int]) -> np.dtype:
  """The widest dtype among the floating operands, constants aside if they fit.

  A jaxpr records Python scalars as strongly typed literals, so ``h * 0.5``
  and ``h * jnp.float32(0.5)`` look alike; a literal, or a weakly typed value,
  does not widen the operation unless its value overflows or underflows (is
  below the smallest normal number) in the dtype of the other operands.
  """

  def constant(i: int) -> bool:
    return _is_constant(eqn.invars[i])

  strong = [_dtype(ins[i]) for i in floats if not constant(i)]
  if not strong:
    return _widest(_dtype(ins[i]) for i in floats)
  target = _widest(strong)
  for i in floats:
    if constant(i) and not _fits(ins[i], target):
      target = _widest((target, _dtype(ins[i])))
  return target


def _fits(x: Any, dtype: np.dtype) -> bool:
  """Whether a constant keeps its magnitude in ``dtype`` (traced values: assumed so)."""
  if not isinstance(x, (np.ndarray, np.generic, int, float)) or isinstance(x, jax.Array):
    return True
  v = np.abs(np.asarray(x, np.float64))
  info = jnp.finfo(dtype)
  ok = (v == 0) | ~np.isfinite(v) | ((v >= float(info.tiny)) & (v <= float(info.max)))
  return bool(np.all(ok))


def _retarget(eqn: Any, target: np.dtype) -> Any:
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
  if _dtype(x) == _F32 and new in _HALVES and not _is_constant(eqn.invars[0]):
    return [x]
  if (new in _ELIGIBLE and _dtype(x) in _ELIGIBLE and not eqn.params.get("weak_type")
      and eqn.params.get("sharding") is None):
    return [_cast(x, new, casts)]  # Shared with autocast's own casts of ``x``.
  return jaxpr_utils.bind(eqn, [_value(x)])


def _is_constant(atom: Any) -> bool:
  """A literal, or a weakly typed value (from a Python scalar)."""
  return isinstance(atom, jex_core.Literal) or getattr(atom.aval, "weak_type", False)


def _bind_original(
    eqn: Any, ins: Sequence[Any], casts: Union[dict[Any, Any], None] = None
) -> list[Any]:
  """``eqn`` applied as traced: floating inputs cast back to the declared dtypes."""
  casts = {} if casts is None else casts
  ins = [_cast(x, np.dtype(v.aval.dtype), casts) if jaxpr_utils.is_floating(_dtype(x))
         else _value(x) for x, v in zip(ins, eqn.invars)]
  return jaxpr_utils.bind(eqn, ins)


# ---------------------------------------------------------------------------
# Higher-order primitives: evaluate the bodies with autocast, re-bind publicly.

# Interpreted bodies of nested jits, per (jaxpr, config, input avals). JAX caches
# a jitted function's jaxpr, so a function autocast sees again (a second call,
# or a second use of the same jnp function) is interpreted once and compiled once.
_JIT_CACHE: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()
_MAX_FIXPOINT = 4  # Carry dtypes only widen: f16/bf16 -> f32 takes at most two rounds.


# jax.core is being slimmed down release by release; without Tracer, nothing is cached.
_TRACER = getattr(getattr(jax, "core", None), "Tracer", None)


def _no_tracers(closed: Any) -> bool:
  """Whether ``closed`` may be cached: none of its constants is a tracer."""
  return _TRACER is not None and not any(isinstance(c, _TRACER) for c in closed.consts)


def _jit(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  closed = eqn.params["jaxpr"]
  key = (cfg, tuple(jax.typeof(x) for x in ins))
  per_jaxpr = _JIT_CACHE.setdefault(closed, {}) if _no_tracers(closed) else {}
  new = per_jaxpr.get(key)
  if new is None:
    new = jax.make_jaxpr(lambda *a: _eval_closed(closed, a, cfg))(*ins)
    if _no_tracers(new):
      per_jaxpr[key] = new
  return jaxpr_utils.bind(eqn, ins, {**eqn.params, "jaxpr": new})


def _call(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  body = eqn.params["call_jaxpr"]
  if isinstance(body, jex_core.ClosedJaxpr):
    return _eval_closed(body, ins, cfg)
  return _eval_jaxpr(body, (), ins, cfg)


def _remat(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  p = eqn.params
  body = lambda *a: _eval_jaxpr(p["jaxpr"], (), a, cfg)
  return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*ins))


def _cast_all(xs: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
  casts: dict[Any, Any] = {}
  return [x if d not in _ELIGIBLE else _cast(x, d, casts) for x, d in zip(xs, dtypes)]


def _carry_fixpoint(
    body: Any, consts: list[Any], init: list[Any], x_avals: list[Any], cfg: _Config
) -> tuple[Any, list[Any]]:
  """Traces ``body(consts, carry, xs) -> (carry, ys)`` until the carry dtypes are stable.

  Each carry starts in its initial value's dtype and widens to what the body
  returns (an f16 carry whose update runs in f32 becomes f32), so a loop never
  narrows what autocast widened. Returns the interpreted body and the dtypes.
  """
  dtypes = [_dtype(c) for c in init]
  fn = lambda *a: _eval_closed(body, a, cfg)
  for _ in range(_MAX_FIXPOINT):
    carry_avals = [jax.ShapeDtypeStruct(np.shape(c), d) if d in _ELIGIBLE else c
                   for c, d in zip(init, dtypes)]
    closed = jax.make_jaxpr(fn)(*consts, *carry_avals, *x_avals)
    out = [jaxpr_utils.dtype_of(v) for v in closed.jaxpr.outvars[:len(init)]]
    joined = [_join(d, o) for d, o in zip(dtypes, out)]
    if joined == dtypes:
      break
    dtypes = joined
  return closed, dtypes


def _scan(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  x_avals = [jax.ShapeDtypeStruct(np.shape(x)[1:], jax.typeof(x).dtype) for x in xs]
  closed, dtypes = _carry_fixpoint(p["jaxpr"], consts, init, x_avals, cfg)

  def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    outs = jex_core.jaxpr_as_fun(closed)(*consts, *carry, *x)
    return _cast_all(outs[:nk], dtypes), outs[nk:]

  carry, ys = jax.lax.scan(step, _cast_all(init, dtypes), list(xs), length=p["length"],
                           reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


def _while(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
  closed, dtypes = _carry_fixpoint(p["body_jaxpr"], body_consts, init, [], cfg)
  cond = lambda carry: _eval_closed(p["cond_jaxpr"], [*cond_consts, *carry], cfg)[0]
  body = lambda carry: _cast_all(jex_core.jaxpr_as_fun(closed)(*body_consts, *carry), dtypes)
  return list(jax.lax.while_loop(cond, body, _cast_all(init, dtypes)))


def _cond(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  index, ops = ins[0], ins[1:]
  closed = [jax.make_jaxpr(lambda *a, b=b: _eval_closed(b, a, cfg))(*ops)
            for b in eqn.params["branches"]]
  dtypes = [functools.reduce(_join, [jaxpr_utils.dtype_of(c.jaxpr.outvars[i]) for c in closed])
            for i in range(len(eqn.outvars))]
  branches = [lambda *a, c=c: _cast_all(jex_core.jaxpr_as_fun(c)(*a), dtypes) for c in closed]
  return list(jax.lax.switch(index, branches, *ops))


def _floating_indices(atoms: Sequence[Any]) -> list[int]:
  return [i for i, v in enumerate(atoms) if jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))]


def _with(xs: Sequence[Any], idx: Sequence[int], values: Sequence[Any]) -> list[Any]:
  out = list(xs)
  for i, v in zip(idx, values):
    out[i] = v
  return out


def _declared(atoms: Sequence[Any]) -> list[Any]:
  return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in atoms]


def _custom_jvp(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  """A ``jax.custom_jvp`` whose primal and JVP rule both run under autocast.

  The rule is the original one, reached through ``jax.jvp`` of the equation
  applied as traced; its jaxpr (taken at the traced dtypes) is evaluated with
  autocast on the actual primals and tangents, and the tangents are cast to
  the primal outputs' dtypes.
  """
  fi, fo = _floating_indices(eqn.invars), _floating_indices(eqn.outvars)
  def primal(*xs: Any) -> list[Any]:
    return _eval_closed(eqn.params["call_jaxpr"], xs, cfg)

  def tangents_as_traced(*flat: Any) -> Any:
    xs, ts = flat[:len(ins)], flat[len(ins):]
    f = lambda *fx: [_bind_original(eqn, _with(xs, fi, fx))[j] for j in fo]
    return jax.jvp(f, [xs[i] for i in fi], list(ts))[1]

  def rule(xs: Sequence[Any], ts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    out = primal(*xs)
    closed = jax.make_jaxpr(tangents_as_traced)(
        *_declared(eqn.invars), *_declared([eqn.invars[i] for i in fi]))
    t_float = _eval_closed(closed, [*xs, *(ts[i] for i in fi)], cfg)
    t_out = [np.zeros(np.shape(o), jax.dtypes.float0) for o in out]
    t_out = _with(t_out, fo, _cast_all(t_float, [_dtype(out[j]) for j in fo]))
    return out, t_out

  f = jax.custom_jvp(primal)
  f.defjvp(rule)
  return list(f(*ins))


def _custom_vjp(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  """A ``jax.custom_vjp`` whose primal, forward and backward rules run under autocast.

  The original rules are reached through ``jax.vjp`` of the equation applied as
  traced: its forward jaxpr (outputs and residuals, taken at the traced dtypes)
  and its backward jaxpr (the pullback, from the residuals) are evaluated with
  autocast, so residuals stay in the dtypes autocast computed them in and the
  user's backward rule runs.
  """
  fi, fo = _floating_indices(eqn.invars), _floating_indices(eqn.outvars)
  in_dtypes = [_dtype(x) for x in ins]
  pullback: dict[str, Any] = {}

  def primal(*xs: Any) -> list[Any]:
    return _eval_closed(eqn.params["call_jaxpr"], xs, cfg)

  def forward_as_traced(*xs: Any) -> list[Any]:
    f = lambda *fx: _bind_original(eqn, _with(xs, fi, fx))
    _, vjp_fn = jax.vjp(f, *[xs[i] for i in fi])
    residuals, pullback["tree"] = jax.tree.flatten(vjp_fn)
    return residuals

  def backward_as_traced(*flat: Any) -> Any:
    residuals, cts = flat[:len(pullback["avals"])], flat[len(pullback["avals"]):]
    zeros = [np.zeros(v.aval.shape, jax.dtypes.float0) for v in eqn.outvars]
    return jax.tree.unflatten(pullback["tree"], residuals)(_with(zeros, fo, cts))

  def fwd(*xs: Any) -> tuple[list[Any], list[Any]]:
    closed = jax.make_jaxpr(forward_as_traced)(*_declared(eqn.invars))
    pullback["avals"] = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.out_avals]
    return primal(*xs), _eval_closed(closed, xs, cfg)

  def bwd(residuals: Sequence[Any], cts: Sequence[Any]) -> tuple[Any, ...]:
    closed = jax.make_jaxpr(backward_as_traced)(
        *pullback["avals"], *_declared([eqn.outvars[j] for j in fo]))
    grads = _eval_closed(closed, [*residuals, *(cts[j] for j in fo)], cfg)
    out: list[Any] = [None] * len(ins)
    return tuple(_with(out, fi, _cast_all(grads, [in_dtypes[i] for i in fi])))

  f = jax.custom_vjp(primal)
  f.defvjp(fwd, bwd)
  return list(f(*ins))


def _shard_map(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
  p = eqn.params

  def body(*a: Any) -> tuple[Any, ...]:
    return tuple(_eval_jaxpr(p["jaxpr"], (), a, cfg))

  mapped = jax.shard_map(body, mesh=p["mesh"], in_specs=p["in_specs"], out_specs=p["out_specs"],
                         check_vma=p["check_vma"], axis_names=p["newly_manual_axes"])
  return list(mapped(*ins))


# Each handler with the params it reads: a JAX release that renames them makes
# the primitive run as traced (safe) instead of failing.
_HANDLERS_AND_PARAMS: dict[str, tuple[Callable[..., list[Any]], tuple[str, ...]]] = {
    "jit": (_jit, ("jaxpr",)),
    "closed_call": (_call, ("call_jaxpr",)),
    "call": (_call, ("call_jaxpr",)),
    "remat2": (_remat, ("jaxpr", "prevent_cse", "policy")),
    "scan": (_scan, ("jaxpr", "num_consts", "num_carry", "length", "reverse", "unroll")),
    "while": (_while, ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts")),
    "cond": (_cond, ("branches",)),
    "custom_jvp_call": (_custom_jvp, ("call_jaxpr",)),
    "custom_vjp_call": (_custom_vjp, ("call_jaxpr",)),
    "shard_map": (_shard_map, ("jaxpr", "mesh", "in_specs", "out_specs", "check_vma",
                               "newly_manual_axes")),
}


def _handler(name: str) -> Union[Callable[..., list[Any]], None]:
  entry = _HANDLERS_AND_PARAMS.get(name)
  if entry is None:
    return None
  fn, needed = entry

  def guarded(eqn: Any, ins: list[Any], cfg: _Config) -> list[Any]:
    if not all(k in eqn.params for k in needed):
      return _bind_original(eqn, ins)
    return fn(eqn, ins, cfg)

  return guarded


_HANDLERS = {name: _handler(name) for name in _HANDLERS_AND_PARAMS}
# Primitives that are in no list: autocast recurses into them, or decides them itself.
_OWN_RULES = frozenset(_HANDLERS) | {"convert_element_type"}


# ---------------------------------------------------------------------------
# The transform.


def _is_array(x: Any) -> bool:
  """Leaves autocast traces (like ``eqx.filter_jit``); other leaves are static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
    fun: Callable[P, T], dtype: DTypeLike, *, lists: Union[AutocastLists, None] = None
) -> Callable[P, T]:
  """Runs ``fun`` with per-operation mixed precision, as ``torch.autocast`` does.

  Returns a function with ``fun``'s signature (positional and keyword
  arguments, any pytrees in and out). Each call traces ``fun`` to a jaxpr on
  its arguments (``jax.make_jaxpr``) and evaluates that jaxpr again, op by op:

  * **half list** (matmuls and convolutions): floating inputs are cast to
    ``dtype``; the result is ``dtype``.
  * **float32 list** (exp, log, pow, rsqrt, sums and products, ...): half
    inputs are cast to float32; the result is float32. Softmax, log-softmax,
    logsumexp, means, variances, norms and cross-entropies are built from
    these and so run in float32.
  * **promote list** (everything else that computes in its inputs' dtype):
    runs in the widest floating dtype among its inputs; constants
    (``h * 0.5``) do not count unless their value does not fit.
  * ``convert_element_type`` from float32 to float16 or bfloat16 of a
    computed value is **kept wide**: the float32 value passes through.
    ``jnp.sum``/``jnp.mean``/``jnp.var`` of a half array accumulate in
    float32 and then narrow the result; under autocast it stays float32 (the
    sum of 100000 float16 ones is 100000.0, not inf), as torch's does. A
    constant (a literal, or a weakly typed Python scalar that ``jnp.where``
    passes along) is narrowed as written, and so is every other convert
    (widening, to or from integers, between float16 and bfloat16).
  * ``x * x`` (a ``mul`` of a value by itself) follows ``square``'s list.
  * Integer, bool and PRNG-key values are never touched; float64, float8 and
    complex values are never cast.
  * Anything else (callbacks, Pallas kernels, linear algebra, scatters,
    primitives autocast does not know) runs in the dtypes of the traced
    program: inputs that autocast changed are cast back first.

  ``jit``, ``closed_call``, ``scan``, ``while``/``fori_loop``, ``cond``/
  ``switch``, ``checkpoint``, ``custom_jvp``, ``custom_vjp`` and ``shard_map``
  bodies are evaluated the same way: a nested jit is re-bound with its
  evaluated jaxpr, the others through ``jax.lax.scan``/``while_loop``/
  ``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp`` and
  ``jax.shard_map``. A loop carry takes the widest dtype it has across
  iterations, and a ``cond`` output the widest across branches. Custom
  derivative rules are kept (``jax.grad`` of ``jax.nn.relu`` at 0 is still 0)
  and run under autocast too. Effects and sharding constraints are kept.

  The result composes with ``jax.grad`` (the backward pass runs in the
  precision chosen for each forward op; gradients with respect to float32
  inputs are float32), ``jax.vmap`` and ``jax.jit``. Outputs come back in the
  dtypes autocast computed them in (a loss from ``jnp.mean`` is float32).

  Arguments: every leaf that is a ``jax.Array`` or NumPy array is traced;
  other leaves (Python numbers, functions, strings; an Equinox module's
  activation function) are static, as in ``eqx.filter_jit``.

  Cost: each call traces ``fun`` once (under ``jax.jit``, once per
  compilation) and evaluates its jaxpr once; loops and conds are traced once
  more to settle their dtypes. A nested ``jax.jit`` function is evaluated once
  per input signature and cached.

  Args:
    fun: the function to run, e.g. a loss or ``model.apply``.
    dtype: the half dtype, ``jnp.float16`` or ``jnp.bfloat16``.
    lists: the op lists (default :class:`AutocastLists` ``()``).

  Returns:
    The autocast function.

  Raises:
    TypeError: if ``fun`` is not callable, ``dtype`` is not a dtype, or
      ``lists`` is not an :class:`AutocastLists`.
    ValueError: if ``dtype`` is not float16 or bfloat16.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def loss(w, x):
    ...   logits = x @ w  # a matmul: float16
    ...   return jnp.mean(jnp.exp(logits)), logits
    >>> w, x = jnp.full((4, 4), 3.0, jnp.float16), jnp.ones((2, 4), jnp.float16)
    >>> loss(w, x)[0]  # exp(12) overflows float16
    Array(inf, dtype=float16)
    >>> mean, logits = jmp.autocast(loss, jnp.float16)(w, x)
    >>> mean.dtype, logits.dtype, round(float(mean))
    (dtype('float32'), dtype('float16'), 162755)
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}")
  lists = AutocastLists() if lists is None else lists
  if not isinstance(lists, AutocastLists):
    raise TypeError(f"lists must be a jmp_lite.AutocastLists, got {lists!r}")
  cfg = _Config(_check_dtype(dtype), lists)

  @functools.wraps(fun)
  def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [_is_array(x) for x in leaves]
    out_info: dict[str, Any] = {}

    def flat_fun(*arrays: Any) -> list[Any]:
      it = iter(arrays)
      a, k = jax.tree.unflatten(treedef, [next(it) if t else x for x, t in zip(leaves, traced)])
      out_leaves, out_info["tree"] = jax.tree.flatten(fun(*a, **k))
      out_info["leaves"] = out_leaves
      return [x for x in out_leaves if _is_array(x)]

    closed = jax.make_jaxpr(flat_fun)(*[x for x, t in zip(leaves, traced) if t])
    it = iter(_eval_closed(closed, [x for x, t in zip(leaves, traced) if t], cfg))
    outs = [next(it) if _is_array(x) else x for x in out_info["leaves"]]
    return jax.tree.unflatten(out_info["tree"], outs)

  return wrapped

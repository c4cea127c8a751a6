"""The autocast interpreter: evaluates a jaxpr again, choosing each operation's dtypes.

:func:`eval_jaxpr` walks a jaxpr's equations and, for each primitive, casts
its floating inputs by the rule of its list (:mod:`autocast_lists`): half,
float32, promote (decided by :mod:`autocast_promote` from what each value
is), or the traced dtypes. What it computes in float32 is recorded in
regions (:mod:`autocast_regions`) and bound when a value leaves them. Two
registries extend it without an import of their modules here:

* :data:`HANDLERS`: one function per higher-order primitive (``jit``,
  ``scan``, ``cond``, ...), filled by :mod:`autocast` with the handlers of
  :mod:`autocast_control`; a handler evaluates its sub-jaxprs with
  :func:`eval_jaxpr` and re-binds them.
* :data:`HALF_RULES`: per-op rules for half-list primitives (an FP8 matmul),
  called after the inputs are cast to the half dtype (:func:`register_half_rule`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src.autocast import chains
from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src.autocast import promote as rules
from jmp_lite._src.autocast import regions
from jmp_lite._src.autocast import values
from jmp_lite._src.fp8 import plan as fp8_plan
from jmp_lite._src import jaxpr_utils
# What the handlers (autocast_control) and half rules (autocast_fp8) read from here.
from jmp_lite._src.autocast.registry import HALF_RULES as HALF_RULES
from jmp_lite._src.autocast.registry import OP_RULES as OP_RULES
from jmp_lite._src.autocast.registry import register_op_rule as register_op_rule
from jmp_lite._src.autocast.registry import HANDLERS as HANDLERS
from jmp_lite._src.autocast.registry import Handler as Handler
from jmp_lite._src.autocast.registry import HalfRule as HalfRule
from jmp_lite._src.autocast.registry import register_half_rule as register_half_rule
from jmp_lite._src.autocast.registry import register_handler as register_handler
from jmp_lite._src.autocast.values import ELIGIBLE as ELIGIBLE
from jmp_lite._src.autocast.values import F32 as F32
from jmp_lite._src.autocast.values import HALVES as HALVES
from jmp_lite._src.autocast.values import bind_original as bind_original
from jmp_lite._src.autocast.values import cast_all as cast_all
from jmp_lite._src.autocast.values import is_constant_value as is_constant_value
from jmp_lite._src.autocast.values import join as join
from jmp_lite._src.autocast.values import retarget as retarget
from jmp_lite._src.autocast.values import value_dtype as value_dtype

Moved = values.Moved


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
# The interpreter.


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], cfg: _Config,
               metas: Union[Sequence[Any], None] = None,
               out_metas: Union[list[Any], None] = None) -> list[Any]:
  """Evaluates an open ``jaxpr`` on ``args`` with autocast's per-op dtypes.

  ``metas`` are what autocast knows of ``args`` (``None``: only their dtypes);
  ``out_metas``, if given, receives what it knows of the outputs.
  """
  return _Evaluator(cfg).run(jaxpr, consts, args, metas, out_metas)


def eval_closed(closed: Any, args: Sequence[Any], cfg: _Config,
                metas: Union[Sequence[Any], None] = None,
                out_metas: Union[list[Any], None] = None) -> list[Any]:
  """:func:`eval_jaxpr` of a ``ClosedJaxpr``."""
  return eval_jaxpr(closed.jaxpr, closed.consts, args, cfg, metas, out_metas)


# The outputs of the nested call being evaluated that its caller reads only in
# float32 (see chains.feeding_float32): read once, by the call body's evaluator.
TAKEN: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "jmp_lite_autocast_taken", default=frozenset())


@contextlib.contextmanager
def taking(indices: frozenset[int]) -> Any:
  """Evaluates the next body with ``indices`` as its outputs read only in float32.

  A rule that JAX runs later (a ``custom_jvp``'s JVP when it differentiates)
  runs wherever JAX is then, inside another call's evaluation: the handler
  that made it passes the value it saw, so that the rule's primal is the
  primal's.
  """
  token = TAKEN.set(indices)
  try:
    yield
  finally:
    TAKEN.reset(token)


# Data movement deferred until a consumer asks for a dtype (see Moved).
_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose"})
# The default lists hold first-order primitives only; other names may carry
# sub-jaxprs typed in the traced dtypes, which must then run as traced.
_FIRST_ORDER = autocast_lists.HALF_OPS | autocast_lists.FLOAT32_OPS | autocast_lists.PROMOTE_OPS
# Promote-list primitives bound at once even in float32: sharding, collectives,
# placement, barriers, and the expensive or multi-output ones.
_NOT_IN_REGIONS = frozenset({
    "sharding_constraint", "reshard", "psum", "psum_invariant", "pmax", "pmin", "pvary",
    "pbroadcast", "all_gather", "all_gather_invariant", "all_to_all", "ppermute",
    "reduce_scatter", "device_put", "optimization_barrier", "name", "sort", "top_k",
    "approx_top_k",
})


def _carries(eqn: Any) -> range:
  """The positions of a loop's initial carries among its operands (empty for other primitives)."""
  p, name = eqn.params, eqn.primitive.name
  if name == "scan" and "num_consts" in p and "num_carry" in p:
    return range(p["num_consts"], p["num_consts"] + p["num_carry"])
  if name == "while" and "cond_nconsts" in p and "body_nconsts" in p:
    return range(p["cond_nconsts"] + p["body_nconsts"], len(eqn.invars))
  return range(0)


class _Evaluator:
  """One evaluation of one jaxpr: its environment, the metas of its values, its casts."""

  def __init__(self, cfg: _Config, parent: Union["_Evaluator", None] = None) -> None:
    self.cfg, self.parent = cfg, parent
    self.env: dict[Any, Any] = {}
    self.meta: dict[Any, rules.Meta] = {}
    self.refs: dict[Any, regions.Node] = {}  # Variables that hold a region's node.
    self.casts: dict[Any, Any] = {}
    self.pcasts: dict[Any, Any] = {}
    self.chains = chains.Chains(frozenset(), {}, frozenset(), frozenset(), {})

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          metas: Union[Sequence[Any], None], out_metas: Union[list[Any], None],
          keep: bool = False, wanted: frozenset[int] = frozenset()) -> list[Any]:
    """The outputs of ``jaxpr``: concrete, or (``keep``) as held (region nodes, moves).

    ``wanted``: the outputs a hazard of the caller needs in float32 (the
    caller evaluates ``jaxpr`` in place and keeps them).
    """
    # The outputs the caller reads only in float32 (a nested jit's chain goes on there).
    taken, token = TAKEN.get(), TAKEN.set(frozenset())
    constants = {i: rules.finer(x, self.cfg.dtype) for i, x in enumerate(args)
                 if is_constant_value(x) and jaxpr_utils.is_floating(value_dtype(x))}
    try:
      self.chains = chains.feeding_float32(jaxpr, self.cfg.lists.rule, self.cfg.dtype, taken,
                                           constants, wanted)
      return self._run(jaxpr, consts, args, metas, out_metas, keep, taken)
    finally:
      TAKEN.reset(token)

  def _run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
           metas: Union[Sequence[Any], None], out_metas: Union[list[Any], None],
           keep: bool, taken: frozenset[int]) -> list[Any]:
    for v, x in zip(jaxpr.constvars, consts):
      self.write(v, x, None)
    for v, x, m in zip(jaxpr.invars, args, [None] * len(args) if metas is None else metas):
      self.write(v, x, m)
    for eqn, dead in zip(jaxpr.eqns, jaxpr_utils.last_uses(jaxpr)):
      ins = [self.read(v) for v in eqn.invars]
      with jaxpr_utils.eqn_context(eqn):
        outs, written = self.eqn(eqn, ins, [self.meta_of(v) for v in eqn.invars])
      for v, x, m in zip(eqn.outvars, outs, written):
        self.write(v, x, m)
      for v in dead:
        for table in (self.env, self.meta, self.refs):
          table.pop(v, None)
    outs = [self.read(v) for v in jaxpr.outvars]
    asked = [not keep and isinstance(x, regions.Node) and x.asked for x in outs]
    # Wide where asked in float32 here, or where the caller reads it only in float32
    # (the chain goes on there: the same value, its meta unchanged).
    wides = [wide or (not keep and isinstance(x, regions.Node) and i in taken)
             for i, (x, wide) in enumerate(zip(outs, asked))]
    outs = [x if keep else self.concrete(x, wide) for x, wide in zip(outs, wides)]
    if out_metas is not None:
      out_metas.extend(self.meta_of(v)._replace(kind=rules.DATA) if wide else self.meta_of(v)
                       for v, wide in zip(jaxpr.outvars, asked))
    return outs

  # -- the environment -------------------------------------------------------

  def read(self, v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else self.env[v]

  def meta_of(self, v: Any) -> rules.Meta:
    if isinstance(v, jex_core.Literal):
      return rules.Meta(rules.CONST, 1)
    return self.meta[v]

  def write(self, v: Any, x: Any, meta: Union[rules.Meta, None]) -> None:
    if meta is None:
      meta = rules.default_meta(value_dtype(x), np.shape(x) if not isinstance(
          x, (Moved, regions.Node)) else x.shape, values.is_constant(v))
    self.env[v], self.meta[v] = x, meta
    node = values.pending_of(x)
    if node is not None:
      self.refs[v] = node

  # -- casts -----------------------------------------------------------------

  def concrete(self, x: Any, wide: bool = False) -> Any:
    """``x`` as a value: moves done, its region bound (a virtual value rounded to half).

    With ``wide``, a virtual value is returned in the float32 it is held in.
    """
    if isinstance(x, Moved):
      return x.get(self)
    if isinstance(x, regions.Node):
      target = regions.narrowed(x) if x.virtual is not None and not wide else x
      if not target.region.done:
        self.flush(target)
      return regions.concrete(target)
    return x

  def flush(self, target: regions.Node) -> None:
    """Binds ``target``'s region, with every node of it a variable still holds."""
    region, outs = target.region, [target]
    ev: Union[_Evaluator, None] = self
    while ev is not None:  # An inlined body's evaluator, and the one it is inlined in.
      for n in list(ev.refs.values()):
        if n.region is region:
          outs.append(regions.narrowed(n) if n.virtual is not None else n)
      ev = ev.parent
    regions.bind(region, outs)

  def cast(self, x: Any, dtype: Any) -> Any:
    """Concrete ``x`` in ``dtype`` (constants saturate at a half dtype's largest value)."""
    if isinstance(x, Moved):
      return x.get(self, dtype)
    if isinstance(x, regions.Node):
      if x.held and x.region.done and dtype == x.dtype:
        return regions.concrete(x)  # A float32 chain's value, after its region was bound.
      if dtype == value_dtype(x) or x.region.done:
        return values.cast(self.concrete(x), dtype, self.casts)
      n = regions.convert(x, dtype)  # From the value it holds (a virtual one's float32).
      self.flush(n)
      return regions.concrete(n)
    if dtype in HALVES:
      x = values.saturated(x, dtype)
    return values.cast(x, dtype, self.casts)

  def pcast(self, x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` for a region: a node (or ``x``, a constant, when nothing changes)."""
    if isinstance(x, Moved):
      return x.node(self, dtype)
    if isinstance(x, regions.Node) and not x.region.done:
      if x.virtual is not None and dtype == x.virtual:
        return regions.narrowed(x)
      return x if dtype == x.dtype else regions.convert(x, dtype)
    if isinstance(x, regions.Node) and x.held and dtype == x.dtype:
      return regions.concrete(x)  # A float32 chain's value, after its region was bound.
    x = self.concrete(x)
    if value_dtype(x) == dtype or is_constant_value(x):
      return values.cast(x, dtype, self.casts)
    hit = self.pcasts.get((id(x), dtype))
    if hit is None or hit[1].region.done:
      hit = self.pcasts[(id(x), dtype)] = (x, regions.convert(x, dtype))
    return hit[1]

  # -- equations -------------------------------------------------------------

  def eqn(self, eqn: Any, ins: list[Any], metas: list[rules.Meta]) -> tuple[list[Any], list[Any]]:
    """``eqn`` on ``ins``: its outputs and their metas (``None``: from the value)."""
    name = eqn.primitive.name
    calls, wanted = self.chains.calls.get(id(eqn), frozenset()), self.chains.inline.get(id(eqn))
    if name == "jit" and chains.inlinable(eqn) and (wanted is not None or any(
        values.pending_of(x) is not None or values.held_of(x) is not None for x in ins)):
      # A jnp function reading a float32 region's value (jnp.take_along_axis in a loss),
      # or whose value a hazard needs in float32 (jnp.where before p + 1e-8): evaluated
      # in place, so that the region goes on through it.
      closed, written = eqn.params["jaxpr"], list[Any]()
      with fp8_plan.within(eqn), taking(calls):
        outs = _Evaluator(self.cfg, self).run(closed.jaxpr, closed.consts, ins, metas, written,
                                              True, wanted or frozenset())
      return outs, written
    handler = HANDLERS.get(name)
    if handler is not None:
      with fp8_plan.within(eqn), taking(calls):
        return handler(eqn, self.handler_ins(eqn, ins, metas), self.cfg, metas)
    if name == "convert_element_type":
      return self.convert(eqn, ins[0], metas[0])
    floats = [i for i, x in enumerate(ins) if jaxpr_utils.is_floating(value_dtype(x))]
    if not floats:  # Integers, bools, keys: untouched.
      outs = jaxpr_utils.bind(eqn, [self.concrete(x) for x in ins])
      return outs, [None] * len(outs)
    own_rule = OP_RULES.get(name)  # (applies, rule)
    if own_rule is not None and own_rule[0](eqn, self.cfg):  # Before the lists, as traced.
      outs = own_rule[1](eqn, [self.concrete(x) for x in ins], self.cfg)
      return outs, [None] * len(outs)
    rule = self.cfg.lists.rule(name)
    if name == "mul" and eqn.invars[0] is eqn.invars[1] and rule == "promote":
      rule = self.cfg.lists.rule("square")  # x * x is a square (jnp.linalg.norm writes it so).
    if rule == "half" and name == "dot_general" and not autocast_lists.is_matmul(
        eqn, (metas[0].kind == rules.CONST, metas[1].kind == rules.CONST)):
      rule = "original"  # An inner product or a weighted sum of a few vectors: a reduction.
    if (rule != "original" and (any(value_dtype(ins[i]) not in ELIGIBLE for i in floats)
                                or (name not in _FIRST_ORDER and any(jaxpr_utils.subjaxprs(eqn)))
                                or eqn.params.get("out_dtype") is not None)):
      rule = "original"  # float64/float8/complex operands, or sub-jaxprs typed in the old dtypes.
    if rule == "promote" and name in _MOVES and len(ins) == 1:
      x = ins[0]
      moved = Moved(x.src, x.steps + (eqn,)) if isinstance(x, Moved) else Moved(x, (eqn,))
      return [moved], [metas[0]]
    if rule in ("original", "half"):
      return self.bind_as(eqn, ins, floats, rule)
    out_size = rules.size(eqn.outvars[0].aval.shape)
    ops = [self.operand(ins[i], metas[i], name) for i in floats]
    if rule == "float32":
      decision = rules.Decision(F32, None, rules.float32_kind(name, ops, out_size))
    else:
      decision = rules.promote(name, ops, out_size)
      if id(eqn) in self.chains.forced:  # It feeds float32 work: float32 back to the matmul.
        decision = chains.reach_back(decision)
    if (decision.compute == F32 and name not in _NOT_IN_REGIONS
        and not eqn.primitive.multiple_results):
      return self.pending(eqn, ins, floats, decision, id(eqn) in self.chains.forced)
    for i in floats:
      ins[i] = self.cast(ins[i], decision.compute)
    ins = [self.concrete(x) for x in ins]
    outs = jaxpr_utils.bind(eqn, ins, retarget(eqn, decision.compute))
    if decision.virtual is not None:
      outs = [values.cast(o, decision.virtual, self.casts) if jaxpr_utils.is_floating(value_dtype(o))
              else o for o in outs]
    return outs, [decision.meta if jaxpr_utils.is_floating(value_dtype(o)) else None
                  for o in outs]

  def operand(self, x: Any, meta: rules.Meta, name: str = "") -> rules.Operand:
    const = values.constant_of(x) if meta.kind == rules.CONST else None
    fits = rules.operand_fits(const, meta, self.cfg.dtype, name)
    return rules.Operand(np.dtype(value_dtype(x)), meta, fits,
                         getattr(x, "virtual", None) is not None)

  def bind_as(self, eqn: Any, ins: list[Any], floats: list[int], rule: str) -> Any:
    """A half-list primitive in the half dtype, or any primitive in its traced dtypes."""
    for i in floats:
      ins[i] = self.cast(ins[i], self.cfg.dtype if rule == "half"
                         else np.dtype(eqn.invars[i].aval.dtype))
    ins = [self.concrete(x) for x in ins]
    half_rule = HALF_RULES.get(eqn.primitive.name) if rule == "half" else None
    outs = None if half_rule is None else half_rule(eqn, ins, self.cfg)
    if outs is None:
      outs = jaxpr_utils.bind(eqn, ins, retarget(eqn, self.cfg.dtype) if rule == "half"
                              else None)
    return outs, [None] * len(outs)

  def pending(self, eqn: Any, ins: list[Any], floats: list[int], decision: rules.Decision,
              held: bool = False) -> tuple[list[Any], list[Any]]:
    """``eqn`` in float32 as a region node (bound later, with its region).

    An operation that stores half and passes values through (a select, max,
    clamp, pad) gets its constants saturated at the half dtype's largest
    finite value first, as it would computing in half. ``held``: a float32
    chain's value (:attr:`regions.Node.held`).
    """
    if decision.virtual is not None and eqn.primitive.name not in rules.ARITHMETIC:
      ins = [values.saturated(x, decision.virtual) if i in floats else x
             for i, x in enumerate(ins)]
    args = [self.pcast(x, F32) if i in floats
            else x if values.pending_of(x) is x else self.concrete(x)
            for i, x in enumerate(ins)]
    out = eqn.outvars[0].aval
    floating = jaxpr_utils.is_floating(out.dtype)
    node = regions.node(values.binder(eqn, retarget(eqn, F32)), args, F32 if floating else out.dtype,
                        out.shape, eqn, decision.virtual if floating else None)
    node.held = held
    return [node], [decision.meta if floating else None]

  def handler_ins(self, eqn: Any, ins: list[Any], metas: list[rules.Meta]) -> list[Any]:
    """A higher-order primitive's operands, concrete; a loop's constant carries in half.

    A constant initial carry (``jnp.zeros(...)`` in float32, as the float32
    program writes it) does not widen the loop: it starts in the half dtype,
    and the carry fixpoint widens it if the body needs float32.
    """
    out = [self.concrete(x) for x in ins]
    for i in _carries(eqn):
      const = values.constant_of(ins[i]) if metas[i].kind == rules.CONST else None
      if const is not None and value_dtype(out[i]) == F32 and rules.fits(const, self.cfg.dtype):
        out[i] = self.cast(ins[i], self.cfg.dtype)
    return out

  def convert(self, eqn: Any, x: Any, meta: rules.Meta) -> tuple[list[Any], list[Any]]:
    """convert_element_type: float32 statistics and widened values are kept wide.

    A narrowing convert (float32 to float16/bfloat16) of a STAT (a sum, a
    mean, a norm: the sum of 100000 float16 ones is 100000.0, not inf) or of
    a value autocast widened is kept wide; of float32 data or a constant it is
    done (a value in a float32 region becomes a virtual half value). A
    widening convert, or one between half dtypes, is done. A convert between
    float16, bfloat16 and float32 shares autocast's cache of casts.
    """
    new = np.dtype(eqn.params["new_dtype"]) if not values.extended(eqn.params["new_dtype"]) else None
    src = value_dtype(x)
    plain = not eqn.params.get("weak_type") and eqn.params.get("sharding") is None
    if not (plain and new in ELIGIBLE and src in ELIGIBLE):
      const = meta.kind == rules.CONST and jaxpr_utils.is_floating(new)
      return jaxpr_utils.bind(eqn, [self.concrete(x)]), [meta if const else None]
    if src == F32 and new in HALVES and meta.kind in (rules.STAT, rules.WIDE):
      return [x], [meta]
    node = values.pending_of(x)
    if node is not None and node is x and new in HALVES and src == F32:
      view = regions.node(lambda v: v, [x], F32, x.shape, eqn, virtual=new)
      return [view], [meta._replace(kind=rules.HALF)]
    if src in HALVES and new == F32:
      if meta.kind == rules.CONST:
        return [self.pcast(x, F32)], [meta]
      # A half value in float32, as asked: the same activation, held exactly in float32.
      view = regions.node(lambda v: v, [self.pcast(x, F32)], F32, x.shape, eqn, virtual=src)
      view.asked = True
      return [view], [meta]
    out = (np.asarray(x, new) if is_constant_value(x)  # A literal is narrowed as written.
           else self.pcast(x, new) if node is not None else self.cast(x, new))
    keep = new == F32 or meta.kind == rules.CONST
    return [out], [meta if keep else meta._replace(kind=rules.HALF)]

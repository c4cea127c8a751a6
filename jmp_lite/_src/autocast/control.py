"""Autocast's handlers for higher-order primitives: control flow, calls, custom rules.

Each handler evaluates its primitive's sub-jaxprs with the interpreter
(:func:`autocast_interpret.eval_jaxpr`) and binds the result again: a nested
``jit`` is re-bound with its evaluated jaxpr (cached per input types); the
others go through JAX's public APIs (``jax.lax.scan``, ``while_loop``,
``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp``,
``jax.shard_map``). A loop carry takes the widest dtype it has across
iterations (:func:`_carry_fixpoint`), a ``cond`` output the widest across
branches. :data:`HANDLERS` is the table that :mod:`autocast` registers.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src.autocast import interpret as interp
from jmp_lite._src.autocast import promote as rules
from jmp_lite._src.fp8 import plan as fp8_plan
from jmp_lite._src import jaxpr_utils

# Interpreted bodies of nested jits, per (jaxpr, config, input avals). JAX caches
# a jitted function's jaxpr, so a function autocast sees again (a second call,
# or a second use of the same jnp function) is interpreted once and compiled once.
_JIT_CACHE: "weakref.WeakKeyDictionary[Any, dict[Any, Any]]" = weakref.WeakKeyDictionary()


# jax.core is being slimmed down release by release; without Tracer, nothing is cached.
_TRACER = getattr(getattr(jax, "core", None), "Tracer", None)


def _no_tracers(closed: Any) -> bool:
  """Whether ``closed`` may be cached: none of its constants is a tracer."""
  return _TRACER is not None and not any(isinstance(c, _TRACER) for c in closed.consts)


def _constant_key(x: Any) -> Any:
  """A floating literal's dtype and bytes; ``None`` for anything else."""
  if not interp.is_constant_value(x) or not jaxpr_utils.is_floating(interp.value_dtype(x)):
    return None
  c = np.asarray(x)
  return (c.dtype.str, c.shape, c.tobytes())


def _canonical(metas: Sequence[Any]) -> tuple[list[Any], dict[Any, Any]]:
  """``metas`` with their sources renamed -1, -2, ... by first appearance, and the way back.

  A nested jit is evaluated once per input types and metas: renamed, the
  metas of two calls that share their pattern of sources are equal.
  """
  names: dict[Any, int] = {}
  out = [m if m is None or m.source is None
         else m._replace(source=names.setdefault(m.source, -1 - len(names))) for m in metas]
  return out, {v: k for k, v in names.items()}


def _restore(metas: Sequence[Any], back: dict[Any, Any]) -> list[Any]:
  """Output metas of a body evaluated on :func:`_canonical` metas, in the caller's sources."""
  new: dict[Any, Any] = {}
  return [m if m is None or m.source is None else m._replace(
      source=back[m.source] if m.source in back else new.setdefault(m.source, rules.fresh()))
          for m in metas]


def _jit(eqn: Any, ins: list[Any], cfg: interp._Config,
         metas: list[Any]) -> tuple[list[Any], list[Any]]:
  """A nested jit, re-bound with its evaluated body; its literal operands stay constants in it.

  ``jnp.where(m, h, 0.0)``, ``jnp.clip`` and ``jnp.nan_to_num`` pass Python
  scalars to a jitted body: the body is evaluated with their values (and
  cached per value), so that they count as constants there.
  """
  closed = eqn.params["jaxpr"]
  if fp8_plan.choosing_at_run_time():
    # fp8_sensitivity: its matmuls read the traced choice, which a jit's body cannot
    # close over; evaluated in place (a jit only names a call), never cached.
    written: list[Any] = []
    return interp.eval_closed(closed, ins, cfg, metas, written), written
  consts = [_constant_key(x) for x in ins]
  metas, back = _canonical(metas)
  # The FP8 decisions under this call site: one helper jitted for many layers is one jaxpr.
  key = (cfg, tuple(jax.typeof(x) for x in ins), tuple(consts), tuple(metas),
         fp8_plan.signature(), interp.TAKEN.get())
  per_jaxpr = _JIT_CACHE.setdefault(closed, {}) if _no_tracers(closed) else {}
  hit = per_jaxpr.get(key)
  if hit is None:
    out_metas: list[Any] = []
    fun = lambda *a: interp.eval_closed(
        closed, [x if c is not None else v for v, x, c in zip(a, ins, consts)], cfg, metas,
        out_metas)
    hit = (jax.make_jaxpr(fun)(*ins), out_metas)
    if _no_tracers(hit[0]):
      per_jaxpr[key] = hit
  return jaxpr_utils.bind(eqn, ins, {**eqn.params, "jaxpr": hit[0]}), _restore(hit[1], back)


def _call(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  body = eqn.params["call_jaxpr"]
  if isinstance(body, jex_core.ClosedJaxpr):
    return interp.eval_closed(body, ins, cfg)
  return interp.eval_jaxpr(body, (), ins, cfg)


def _remat(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  p = eqn.params
  body = lambda *a: interp.eval_jaxpr(p["jaxpr"], (), a, cfg)
  return list(jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*ins))


def _carry_fixpoint(
    body: Any, consts: list[Any], init: list[Any], x_avals: list[Any], cfg: interp._Config
) -> tuple[Any, list[Any]]:
  """Traces ``body(consts, carry, xs) -> (carry, ys)`` until the carry dtypes are stable.

  Each carry starts in its initial value's dtype and widens to what the body
  returns (an f16 carry whose update runs in f32 becomes f32), so a loop never
  narrows what autocast widened. A carry that reads another carry widens a
  round after it, so a cascade of n carries takes n + 1 rounds. A round that
  does not settle widens at least one carry, and dtypes only widen, so
  ``len(init) * len(ELIGIBLE) + 1`` rounds always suffice. Each round traces
  the carries with their own types (``jax.typeof``: shape, sharding and the
  varying manual axes of a ``shard_map``) in the round's dtypes. Returns the
  interpreted body and the dtypes.
  """
  dtypes = [interp.value_dtype(c) for c in init]
  fn = lambda *a: interp.eval_closed(body, a, cfg)
  for _ in range(len(init) * len(interp.ELIGIBLE) + 1):
    carry_avals = [jax.typeof(c).update(dtype=d, weak_type=False) if d in interp.ELIGIBLE else c
                   for c, d in zip(init, dtypes)]
    closed = jax.make_jaxpr(fn)(*consts, *carry_avals, *x_avals)
    out = [jaxpr_utils.dtype_of(v) for v in closed.jaxpr.outvars[:len(init)]]
    joined = [interp.join(d, o) for d, o in zip(dtypes, out)]
    if joined == dtypes:
      return closed, dtypes
    dtypes = joined
  raise RuntimeError(f"autocast: loop carry dtypes did not settle (a bug), last {dtypes}")


def _scan(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  # The slices' types as traced (varying manual axes included), in the dtypes autocast gave xs.
  x_avals = [a.update(dtype=jax.typeof(x).dtype, weak_type=False)
             for a, x in zip(p["jaxpr"].in_avals[nc + nk:], xs)]
  closed, dtypes = _carry_fixpoint(p["jaxpr"], consts, init, x_avals, cfg)

  def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    outs = jex_core.jaxpr_as_fun(closed)(*consts, *carry, *x)
    return interp.cast_all(outs[:nk], dtypes), outs[nk:]

  carry, ys = jax.lax.scan(step, interp.cast_all(init, dtypes), list(xs), length=p["length"],
                           reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


def _while(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
  closed, dtypes = _carry_fixpoint(p["body_jaxpr"], body_consts, init, [], cfg)
  cond = lambda carry: interp.eval_closed(p["cond_jaxpr"], [*cond_consts, *carry], cfg)[0]
  body = lambda carry: interp.cast_all(jex_core.jaxpr_as_fun(closed)(*body_consts, *carry), dtypes)
  return list(jax.lax.while_loop(cond, body, interp.cast_all(init, dtypes)))


def _cond(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  index, ops = ins[0], ins[1:]
  closed = [jax.make_jaxpr(lambda *a, b=b: interp.eval_closed(b, a, cfg))(*ops)
            for b in eqn.params["branches"]]
  dtypes = [functools.reduce(interp.join, [jaxpr_utils.dtype_of(c.jaxpr.outvars[i])
                                           for c in closed])
            for i in range(len(eqn.outvars))]
  branches = [lambda *a, c=c: interp.cast_all(jex_core.jaxpr_as_fun(c)(*a), dtypes) for c in closed]
  return list(jax.lax.switch(index, branches, *ops))


def _floating_indices(atoms: Sequence[Any]) -> list[int]:
  return [i for i, v in enumerate(atoms) if jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))]


def _with(xs: Sequence[Any], idx: Sequence[int], values: Sequence[Any]) -> list[Any]:
  out = list(xs)
  for i, v in zip(idx, values):
    out[i] = v
  return out


def _declared(atoms: Sequence[Any]) -> list[Any]:
  """The traced types of ``atoms``, strongly typed (varying manual axes kept)."""
  return [v.aval.update(weak_type=False) for v in atoms]


def _custom_jvp(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  """A ``jax.custom_jvp`` whose primal and JVP rule both run under autocast.

  The rule is the original one, reached through ``jax.jvp`` of the equation
  applied as traced; its jaxpr (taken at the traced dtypes) is evaluated with
  autocast on the actual primals and tangents, and the tangents are cast to
  the primal outputs' dtypes. JAX may run the rule later (``jax.grad`` of a
  jitted autocast function), so both run under the FP8 plan and call site
  of this equation. The rule's matmuls run in the half dtype, never FP8:
  ``jax.grad`` transposes them, and an FP8 matmul (a ``custom_vjp`` with
  current scaling) cannot be transposed; the primal's follow the plan.
  """
  fi, fo = _floating_indices(eqn.invars), _floating_indices(eqn.outvars)
  plan, site, unplanned = fp8_plan.current()
  taken = interp.TAKEN.get()

  def primal(*xs: Any) -> list[Any]:
    with fp8_plan.active(plan, site, unplanned), interp.taking(taken):
      return interp.eval_closed(eqn.params["call_jaxpr"], xs, cfg)

  def tangents_as_traced(*flat: Any) -> Any:
    xs, ts = flat[:len(ins)], flat[len(ins):]
    f = lambda *fx: [interp.bind_original(eqn, _with(xs, fi, fx))[j] for j in fo]
    return jax.jvp(f, [xs[i] for i in fi], list(ts))[1]

  def rule(xs: Sequence[Any], ts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    out = primal(*xs)
    closed = jax.make_jaxpr(tangents_as_traced)(
        *_declared(eqn.invars), *_declared([eqn.invars[i] for i in fi]))
    with fp8_plan.active(plan, site, unplanned=False), interp.taking(frozenset()):
      t_float = interp.eval_closed(closed, [*xs, *(ts[i] for i in fi)], cfg)
    t_out = [np.zeros(np.shape(o), jax.dtypes.float0) for o in out]
    t_out = _with(t_out, fo, interp.cast_all(t_float, [interp.value_dtype(out[j]) for j in fo]))
    return out, t_out

  f = jax.custom_jvp(primal)
  f.defjvp(rule)
  return list(f(*ins))


def _custom_vjp(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  """A ``jax.custom_vjp`` whose primal, forward and backward rules run under autocast.

  The original rules are reached through ``jax.vjp`` of the equation applied as
  traced: its forward jaxpr (outputs and residuals, taken at the traced dtypes)
  and its backward jaxpr (the pullback, from the residuals) are evaluated with
  autocast, so residuals stay in the dtypes autocast computed them in and the
  user's backward rule runs. A rule defined with ``symbolic_zeros`` (Equinox's
  ``filter_custom_vjp``: diffrax's adjoints, its checkpointed loops) is
  rebuilt with it, and only its perturbed inputs are differentiated: it
  refuses a tangent on the inputs it declares non-differentiable. JAX runs
  the rules when it differentiates, so they run under the FP8 plan and call
  site of this equation; their matmuls (traced anew, so not in the plan) run
  in the half dtype when a keep rule keeps a matmul of the primal, in FP8
  otherwise.
  """
  symbolic = bool(eqn.params.get("symbolic_zeros", False))
  fi, fo = _floating_indices(eqn.invars), _floating_indices(eqn.outvars)
  in_dtypes = [interp.value_dtype(x) for x in ins]
  pullback: dict[str, Any] = {}
  plan, site, unplanned = fp8_plan.current()
  rules_fp8 = False if fp8_plan.keeps_any() else unplanned
  taken = interp.TAKEN.get()

  def primal(*xs: Any) -> list[Any]:
    with fp8_plan.active(plan, site, unplanned), interp.taking(taken):
      return interp.eval_closed(eqn.params["call_jaxpr"], xs, cfg)

  def forward_as_traced(*xs: Any) -> list[Any]:
    di = pullback["diff"]
    f = lambda *fx: interp.bind_original(eqn, _with(xs, di, fx))
    _, vjp_fn = jax.vjp(f, *[xs[i] for i in di])
    residuals, pullback["tree"] = jax.tree.flatten(vjp_fn)
    return residuals

  def backward_as_traced(*flat: Any) -> Any:
    residuals, cts = flat[:len(pullback["avals"])], flat[len(pullback["avals"]):]
    zeros = [np.zeros(v.aval.shape, jax.dtypes.float0) for v in eqn.outvars]
    return jax.tree.unflatten(pullback["tree"], residuals)(_with(zeros, fo, cts))

  def fwd(*primals: Any) -> tuple[list[Any], list[Any]]:
    xs = [p.value for p in primals] if symbolic else list(primals)
    pullback["diff"] = [i for i in fi if primals[i].perturbed] if symbolic else fi
    closed = jax.make_jaxpr(forward_as_traced)(*_declared(eqn.invars))
    pullback["avals"] = [a.update(weak_type=False) for a in closed.out_avals]
    with fp8_plan.active(plan, site, rules_fp8), interp.taking(frozenset()):
      residuals = interp.eval_closed(closed, xs, cfg)
    return primal(*xs), residuals

  def bwd(residuals: Sequence[Any], cts: Sequence[Any]) -> tuple[Any, ...]:
    di = pullback["diff"]
    closed = jax.make_jaxpr(backward_as_traced)(
        *pullback["avals"], *_declared([eqn.outvars[j] for j in fo]))
    with fp8_plan.active(plan, site, rules_fp8), interp.taking(frozenset()):
      grads = interp.eval_closed(closed, [*residuals, *(_materialized(cts[j]) for j in fo)], cfg)
    out: list[Any] = [None] * len(ins)
    return tuple(_with(out, di, interp.cast_all(grads, [in_dtypes[i] for i in di])))

  f = jax.custom_vjp(primal)
  f.defvjp(fwd, bwd, symbolic_zeros=symbolic)
  return list(f(*ins))


def _materialized(ct: Any) -> Any:
  """A cotangent as an array: a ``SymbolicZero`` (an output nothing reads) as zeros."""
  if isinstance(ct, jax.custom_derivatives.SymbolicZero):
    aval: Any = ct.aval
    return jax.numpy.zeros(aval.shape, aval.dtype)
  return ct


def _shard_map(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  p = eqn.params

  def body(*a: Any) -> tuple[Any, ...]:
    return tuple(interp.eval_jaxpr(p["jaxpr"], (), a, cfg))

  mapped = jax.shard_map(body, mesh=p["mesh"], in_specs=p["in_specs"], out_specs=p["out_specs"],
                         check_vma=p["check_vma"], axis_names=p["newly_manual_axes"])
  return list(mapped(*ins))


# Each handler with the params it reads: a JAX release that renames them makes
# the primitive run as traced (safe) instead of failing. autocast.py registers
# them with the interpreter (interp.register_handler).
HANDLERS: dict[str, tuple[interp.Handler, tuple[str, ...]]] = {
    "jit": (_jit, ("jaxpr",)),  # With metas (see META_HANDLERS).
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
# The handlers called with their operands' metas, returning their outputs'.
META_HANDLERS = frozenset({"jit"})

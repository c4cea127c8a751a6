"""Which matmuls of a traced function run in FP8: provenance, keep rules and sizes (issue 30).

Before autocast evaluates a jaxpr with an FP8 recipe, :func:`plan` walks it
once and describes every ``dot_general`` in it (sub-jaxprs included): its
position, its name-stack entry, its sizes, and the argument leaves its
operands come from. "Comes from" follows the ops that do not change a value's
meaning: casts, reshapes, transposes, broadcasts, squeezes, copies and
sharding constraints, into and out of ``jit``/``checkpoint``/custom-derivative
bodies, and from a ``scan``'s stacked input to its per-step slice (so a rule
that keeps a stacked weight keeps every layer of the stack).

The plan lives in a context variable while autocast evaluates the jaxpr
(:func:`active`); autocast's FP8 rule asks :func:`decide` for each matmul.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Mapping, Sequence, Union

from jax.extend import core as jex_core

from jmp_lite._src import jaxpr_utils
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.fp8 import Float8Recipe

# Ops through which a value keeps its source: same values, other dtype or layout.
_PASS = frozenset({
    "convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "copy", "copy_p", "reduce_precision", "sharding_constraint", "reshard",
    "device_put", "pvary", "optimization_barrier",
})


@dataclasses.dataclass(frozen=True)
class Matmul:
  """One ``dot_general`` of a traced function.

  Attributes:
    index: its position among the function's matmuls (depth first, program order).
    name: its name-stack entry (``Dense_0``, ``MultiHeadDotProductAttention_0/query``), or ``""``.
    sources: for the lhs and the rhs, the paths of the argument leaves it
      comes from (empty where it comes from none).
    shape: ``(lhs free size, contracting size, rhs free size, batch size)``.
  """

  index: int
  name: str
  sources: tuple[tuple[str, ...], tuple[str, ...]]
  shape: tuple[int, int, int, int]

  @property
  def paths(self) -> tuple[str, ...]:
    """Every argument path the operands come from, lhs first."""
    return tuple(dict.fromkeys(self.sources[0] + self.sources[1]))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The matmuls of one traced function, by equation, and the choices the recipe makes.

  Attributes:
    matmuls: ``{id(eqn): Matmul}``.
    kept: the indices that keep rules keep in the half dtype.
    only: when set, the indices that may run in FP8 (``fp8_sensitivity``);
      every other matmul runs in the half dtype.
  """

  matmuls: Mapping[int, Matmul]
  kept: frozenset[int] = frozenset()
  only: Union[frozenset[int], None] = None


_ACTIVE: contextvars.ContextVar[Union[Plan, None]] = contextvars.ContextVar(
    "jmp_lite_fp8_plan", default=None)
_ONLY: contextvars.ContextVar[Union[frozenset[int], None]] = contextvars.ContextVar(
    "jmp_lite_fp8_only", default=None)


def _dims(eqn: Any) -> tuple[int, int, int, int]:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  free = lambda shape, c, b: math.prod(d for i, d in enumerate(shape) if i not in c and i not in b)
  return (free(lhs, lc, lb), math.prod(lhs[i] for i in lc), free(rhs, rc, rb),
          math.prod(lhs[i] for i in lb))


def _name(eqn: Any) -> str:
  stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
  parts = [p for p in stack.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose("))]
  return "/".join(parts)


def _sub_inputs(eqn: Any, sub: Any, k: int, srcs: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
  """The sources of sub-jaxpr ``k``'s inputs, from the equation's operands."""
  n = len(sub.invars)
  if eqn.primitive.name == "while":
    cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = srcs[cond_n + body_n:]
    return (srcs[:cond_n] + carry) if k == 0 else (srcs[cond_n:cond_n + body_n] + carry)
  if len(srcs) == n:  # jit, closed_call, checkpoint, custom_jvp/vjp, scan, shard_map
    return srcs
  if len(srcs) == n + 1:  # cond: the branch index first
    return srcs[1:]
  return [()] * n


def _walk(jaxpr: Any, sources: list[tuple[str, ...]], found: list[tuple[Any, Matmul]]) -> list[tuple[str, ...]]:
  """Adds the matmuls of ``jaxpr`` to ``found``; the sources of its outputs."""
  env: dict[Any, tuple[str, ...]] = dict(zip(jaxpr.invars, sources))

  def src(v: Any) -> tuple[str, ...]:
    return () if isinstance(v, jex_core.Literal) else env.get(v, ())

  for eqn in jaxpr.eqns:
    ins = [src(v) for v in eqn.invars]
    name = eqn.primitive.name
    outs: list[tuple[str, ...]] = [()] * len(eqn.outvars)
    if name == "dot_general":
      found.append((eqn, Matmul(len(found), _name(eqn), (ins[0], ins[1]), _dims(eqn))))
    elif name in _PASS and eqn.invars:
      outs = [ins[0]] * len(eqn.outvars)
    subs = list(jaxpr_utils.subjaxprs(eqn))
    for k, sub in enumerate(subs):
      sub_outs = _walk(sub, _sub_inputs(eqn, sub, k, ins), found)
      if len(subs) == 1 and len(sub_outs) == len(eqn.outvars) and name != "scan":
        outs = sub_outs  # A call's outputs are its body's.
    env.update(zip(eqn.outvars, outs))
  return [src(v) for v in jaxpr.outvars]


def matmuls(jaxpr: Any, paths: Sequence[Union[str, None]]) -> list[tuple[Any, Matmul]]:
  """Every ``dot_general`` of ``jaxpr`` (sub-jaxprs too), with the argument paths it reads.

  Args:
    jaxpr: an open jaxpr whose invars are the function's traced argument leaves.
    paths: each invar's path (``None`` for one that is not an argument leaf).

  Returns:
    ``(eqn, Matmul)`` pairs, in program order.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def f(w, x):
    ...   return jnp.tanh(x @ w["a"].astype(jnp.bfloat16).T) @ w["b"]
    >>> w = {"a": jnp.ones((4, 3)), "b": jnp.ones((4, 2))}
    >>> jaxpr = jax.make_jaxpr(f)(w, jnp.ones((5, 3)))
    >>> [(m.index, m.sources, m.shape) for _, m in matmuls(jaxpr.jaxpr, ["0/a", "0/b", "1"])]
    [(0, (('1',), ('0/a',)), (5, 3, 4, 1)), (1, ((), ('0/b',)), (5, 4, 2, 1))]
  """
  found: list[tuple[Any, Matmul]] = []
  _walk(jaxpr, [() if p is None else (p,) for p in paths], found)
  return found


def plan(jaxpr: Any, paths: Sequence[Union[str, None]], leaves: Sequence[Any],
         recipe: Float8Recipe) -> Plan:
  """The :class:`Plan` of ``jaxpr`` under ``recipe``'s keep rules (and :func:`selecting`).

  A keep rule that keeps no matmul warns (``UserWarning``), naming the rule
  and the paths the matmuls read, as the policy's keep rules do.
  """
  found = matmuls(jaxpr, paths)
  kept: set[int] = set()
  if recipe.keep:
    leaf_of = {p: x for p, x in zip(paths, leaves) if p is not None}
    read = list({p: leaf_of[p] for _, m in found for p in m.paths if p in leaf_of}.items())
    rules = [policy_lib.compile_rule(r) for r in recipe.keep]
    for eqn, m in found:
      if any(rule(p, leaf_of[p]) for rule in rules for p in m.paths if p in leaf_of):
        kept.add(m.index)
    policy_lib.warn_unmatched(recipe.keep, read, "the Float8Recipe",
                              "argument leaf that a matmul reads", "no matmul in half",
                              "leaves the matmuls read")
  return Plan({id(eqn): m for eqn, m in found}, frozenset(kept), _ONLY.get())


@contextlib.contextmanager
def selecting(only: Union[frozenset[int], None]) -> Iterator[None]:
  """Plans made while the block runs let only the matmuls numbered ``only`` run in FP8."""
  token = _ONLY.set(only)
  try:
    yield
  finally:
    _ONLY.reset(token)


@contextlib.contextmanager
def active(p: Union[Plan, None]) -> Iterator[None]:
  """Makes ``p`` the plan :func:`decide` reads while the block runs."""
  token = _ACTIVE.set(p)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def decide(eqn: Any, recipe: Float8Recipe) -> bool:
  """Whether ``eqn`` (a half-list ``dot_general``) runs in FP8 under ``recipe`` and the active plan.

  FP8 unless a keep rule keeps it, it is smaller than ``recipe.min_size`` in
  one of its three GEMM sizes, or a sensitivity run leaves it out.
  """
  lhs_free, contracting, rhs_free, _ = _dims(eqn)
  if min(lhs_free, contracting, rhs_free) < recipe.min_size:
    return False
  p = _ACTIVE.get()
  m = None if p is None else p.matmuls.get(id(eqn))
  if m is None:
    return p is None or p.only is None
  return m.index not in p.kept and (p.only is None or m.index in p.only)

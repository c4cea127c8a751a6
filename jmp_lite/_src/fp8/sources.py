"""Where each matmul operand of a traced function comes from: the argument leaves it holds.

:func:`found_in` walks a jaxpr once (sub-jaxprs included) and describes every
``dot_general`` (:class:`Matmul`) and every row lookup of an argument leaf.
"Comes from" follows the ops that do not change a value's meaning: casts,
reshapes, transposes, broadcasts, squeezes, copies and sharding constraints,
into and out of ``jit``/``checkpoint``/custom-derivative bodies, and from a
``scan``'s stacked input to its per-step slice. :mod:`jmp_lite._src.fp8.plan`
decides from it which matmuls run in FP8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence, Union

from jax.extend import core as jex_core

from jmp_lite._src import jaxpr_utils
from jmp_lite._src.fp8 import lookup as fp8_lookup

# Ops through which a value keeps its source: same values, other dtype or layout.
_PASS = frozenset({
    "convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "expand_dims", "copy", "copy_p", "reduce_precision", "sharding_constraint", "reshard",
    "device_put", "pvary", "optimization_barrier",
})
# Pass ops that keep a value's layout too: the leaf's axes are the operand's.
_SAME_LAYOUT = _PASS - {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims"}
# Element-wise ops through which a keep rule follows a weight (w / norm(w), w * mask,
# w + a @ b), from an operand of the output's own shape that no broadcast made.
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "select_n",
    "clamp", "integer_pow", "square", "sqrt", "rsqrt", "pow",
})

# Bodies whose inputs are slices, carries or shards of what is passed in.
_INEXACT_BODIES = frozenset({"scan", "while", "shard_map", "xla_pmap"})


@dataclasses.dataclass(frozen=True)
class Matmul:
  """One ``dot_general`` of a traced function.

  Attributes:
    index: its position among the function's matmuls (depth first, program order).
    name: its name-stack entry (``Dense_0``, ``MultiHeadDotProductAttention_0/query``), or ``""``.
    sources: for the lhs and the rhs, the paths of the argument leaves it
      comes from (empty where it comes from none).
    shape: ``(lhs free size, contracting size, rhs free size, batch size)``.
    reads: every argument path an operand comes from, element-wise ops on
      it included (``w`` for ``x @ (w / norm(w))``, ``x @ (w * mask)``,
      ``x @ (w + a @ b)``): what keep rules test.
    exact: for the lhs and the rhs, the argument leaf whose values it holds
      (up to layout and rounding), or ``None``: a source followed through
      pass ops outside loop and ``shard_map`` bodies only, where an operand
      may be a slice, a shard or a later carry of the leaf. Its amax is the
      leaf's, rounded (issue 44).
    rows: for the lhs and the rhs, the operand's contracting axes where its
      ``exact`` leaf reaches it in the leaf's own layout (through casts, not
      reshapes or transposes), else ``None``: a rowwise recipe's amax of the
      operand is the leaf's over those axes.
  """

  index: int
  name: str
  sources: tuple[tuple[str, ...], tuple[str, ...]]
  shape: tuple[int, int, int, int]
  reads: tuple[str, ...] = ()
  exact: tuple[Union[str, None], Union[str, None]] = (None, None)
  rows: tuple[Union[tuple[int, ...], None], Union[tuple[int, ...], None]] = (None, None)

  @property
  def paths(self) -> tuple[str, ...]:
    """Every argument path the operands come from, lhs first."""
    return tuple(dict.fromkeys(self.sources[0] + self.sources[1]))


class _Src(NamedTuple):
  """Where a value comes from: through pass ops (``paths``), also element-wise ones (``reads``).

  ``whole`` is false for a broadcast value (a bias, a norm's scale spread
  over the activations), which element-wise ops do not follow. ``exact`` is
  false inside a body whose inputs may not be the values passed in (a loop's
  slices and carries, a ``shard_map``'s shards). ``laid_out`` is false once
  a pass op moved the axes (a reshape, a transpose, a broadcast).
  """

  paths: tuple[str, ...] = ()
  reads: tuple[str, ...] = ()
  whole: bool = True
  exact: bool = True
  laid_out: bool = True


_NONE = _Src()


def gemm_sizes(eqn: Any) -> tuple[int, int, int, int]:
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])

  def free(shape: Sequence[int], c: Sequence[int], b: Sequence[int]) -> int:
    return math.prod(d for i, d in enumerate(shape) if i not in c and i not in b)

  return (free(lhs, lc, lb), math.prod(lhs[i] for i in lc), free(rhs, rc, rb),
          math.prod(lhs[i] for i in lb))


def _name(eqn: Any) -> str:
  stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
  parts = [p for p in stack.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose("))]
  return "/".join(parts)


def _sub_inputs(eqn: Any, sub: Any, k: int, srcs: list[_Src]) -> list[_Src]:
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
  return [_NONE] * n


Found = list[tuple[tuple[int, ...], Any, Matmul]]  # (site, eqn, matmul)
# (site, eqn, the path of the argument leaf its table holds): row lookups (jnp.take's
# is inside its own jit), outside loop and shard_map bodies.
Lookups = list[tuple[tuple[int, ...], Any, str]]


def _elementwise(eqn: Any, ins: list[_Src]) -> _Src:
  """An element-wise op's output reads what its whole operands of its own shape read."""
  shape = eqn.outvars[0].aval.shape
  reads = [p for v, x in zip(eqn.invars, ins)
           if x.whole and getattr(v.aval, "shape", None) == shape for p in x.reads]
  return _Src((), tuple(dict.fromkeys(reads)))


def _walk(jaxpr: Any, sources: list[_Src], found: Found, site: tuple[int, ...] = (),
          lookups: Union[Lookups, None] = None) -> list[_Src]:
  """Adds the matmuls of ``jaxpr`` (nested at ``site``) to ``found``; the sources of its outputs.

  Row lookups of a leaf's values (outside loop and ``shard_map`` bodies) go to ``lookups``.
  """
  env: dict[Any, _Src] = dict(zip(jaxpr.invars, sources))

  def src(v: Any) -> _Src:
    return _NONE if isinstance(v, jex_core.Literal) else env.get(v, _NONE)

  for eqn in jaxpr.eqns:
    ins = [src(v) for v in eqn.invars]
    name = eqn.primitive.name
    outs: list[_Src] = [_NONE] * len(eqn.outvars)
    if name == "dot_general":
      reads = tuple(dict.fromkeys(ins[0].reads + ins[1].reads))
      exact = tuple(x.paths[0] if x.exact and len(x.paths) == 1 else None for x in ins[:2])
      (lc, rc), _ = eqn.params["dimension_numbers"]
      rows = tuple(tuple(int(d) for d in c) if e is not None and x.laid_out else None
                   for e, x, c in zip(exact, ins[:2], (lc, rc)))
      found.append((site + (id(eqn),), eqn, Matmul(
          len(found), _name(eqn), (ins[0].paths, ins[1].paths), gemm_sizes(eqn), reads,
          exact, rows)))  # type: ignore[arg-type]
    elif name == "gather" and lookups is not None:
      table = ins[0]
      if table.exact and len(table.paths) == 1 and fp8_lookup.is_row_lookup(
          tuple(eqn.invars[0].aval.shape), eqn.params):
        lookups.append((site + (id(eqn),), eqn, table.paths[0]))
    elif name in _PASS and eqn.invars:
      spread = name == "broadcast_in_dim" and (
          math.prod(eqn.outvars[0].aval.shape) != math.prod(eqn.invars[0].aval.shape))
      out = ins[0]._replace(whole=False) if spread else ins[0]
      outs = [out if name in _SAME_LAYOUT else out._replace(laid_out=False)] * len(eqn.outvars)
    elif name in _ELEMENTWISE and len(eqn.outvars) == 1:
      outs = [_elementwise(eqn, ins)]
    subs = list(jaxpr_utils.subjaxprs(eqn))
    for k, sub in enumerate(subs):
      sub_ins = _sub_inputs(eqn, sub, k, ins)
      if name in _INEXACT_BODIES:
        sub_ins = [x._replace(exact=False) for x in sub_ins]
      sub_outs = _walk(sub, sub_ins, found, site + (id(eqn),), lookups)
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
  return [(eqn, m) for _, eqn, m in found_in(jaxpr, paths)]


def found_in(jaxpr: Any, paths: Sequence[Union[str, None]],
           lookups: Union[Lookups, None] = None) -> Found:
  found: Found = []
  _walk(jaxpr, [_NONE if p is None else _Src((p,), (p,)) for p in paths], found, (), lookups)
  return found

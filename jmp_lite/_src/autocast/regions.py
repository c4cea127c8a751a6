"""Float32 regions: autocast's float32 computations, recomputed in the backward pass.

The interpreter (:mod:`autocast_interpret`) does not bind an operation that
it computes in float32 at once: it records it as a :class:`Node` of a
:class:`Region`, the connected float32 computation it belongs to (a
LayerNorm's statistics and normalisation, a softmax, a GELU, a loss). The
region is bound when one of its values is needed outside it (a matmul casts
it to half, a loop or an unknown primitive reads it, the function returns
it), in one piece: under :func:`jax.checkpoint` when it holds a float32
value as large as its largest input. The backward pass then saves the
region's inputs (half activations, parameters) and recomputes its float32
intermediates from them, instead of saving those in float32: a float32
region costs the memory of its half inputs.

A node may also stand for a half value that is still held in float32
(``virtual``): the result of an element-wise operation on a half activation
that autocast runs in float32 (``x - mean``, ``x * rsqrt(var)``, a GELU's
``x + 0.044715 * x**3``). It is rounded to the half dtype once, when it
leaves the region, as torch's fused kernels compute in float32 and store
half.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence, Union

import jax
import numpy as np

from jmp_lite._src import jaxpr_utils

_SEQ = itertools.count()


class Region:
  """A connected float32 computation: its nodes in creation (topological) order."""

  __slots__ = ("nodes", "done")

  def __init__(self) -> None:
    self.nodes: list[Node] = []
    self.done = False


class Node:
  """One operation of a region, not yet bound.

  Attributes:
    op: ``op(*args) -> value``, the operation on concrete arguments.
    args: the inputs: nodes, concrete values (arrays, tracers) or constants.
    dtype: the dtype of the value ``op`` computes.
    shape: its shape.
    virtual: ``None``, or the half dtype the value stands for (held in
      ``dtype``, float32, until it leaves the region).
    context: the equation whose source line the operation is bound under.
    region: the region it belongs to.
    value: the concrete value, once the region is bound (``None`` before,
      and for a node no one outside the region read).
    held: a value of a float32 chain (:mod:`autocast_chains`): a float32
      reader reads its float32 value even after another reader bound its
      region (evaluated again from its inputs if the region did not keep it).
  """

  __slots__ = ("op", "args", "dtype", "shape", "virtual", "context", "region", "value",
               "seq", "narrowed", "asked", "held")

  def __init__(self, op: Callable[..., Any], args: Sequence[Any], dtype: np.dtype,
               shape: tuple[int, ...], context: Any, virtual: Union[np.dtype, None]) -> None:
    self.op, self.dtype, self.shape, self.context = op, dtype, tuple(shape), context
    self.virtual = virtual
    self.value: Any = None
    self.narrowed: Union[Node, None] = None
    self.asked = False  # A virtual value the program cast to float32 (returned so).
    self.held = False
    self.seq = next(_SEQ)
    self.args = [_settled(a) for a in args]
    self.region: Region = _join([a.region for a in self.args if isinstance(a, Node)])
    self.region.nodes.append(self)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def __repr__(self) -> str:
    return f"Node({self.dtype}{list(self.shape)}, virtual={self.virtual})"


def _settled(arg: Any) -> Any:
  """A node of a bound region stands for its concrete value from now on."""
  if isinstance(arg, Node) and arg.region.done:
    return concrete(arg)
  return arg


def _join(regions: list[Region]) -> Region:
  """One open region holding the nodes of ``regions`` (a fresh one if there are none)."""
  distinct = list({id(r): r for r in regions}.values())
  if not distinct:
    return Region()
  target = max(distinct, key=lambda r: len(r.nodes))
  for other in distinct:
    if other is not target:
      for n in other.nodes:
        n.region = target
      target.nodes.extend(other.nodes)
      other.nodes = []
  if len(distinct) > 1:
    target.nodes.sort(key=lambda n: n.seq)
  return target


def node(op: Callable[..., Any], args: Sequence[Any], dtype: Any, shape: Sequence[int],
         context: Any = None, virtual: Any = None) -> Node:
  """A new node computing ``op(*args)``, in the region of its node arguments."""
  return Node(op, args, np.dtype(dtype), tuple(shape), context, virtual)


def convert(x: Any, dtype: Any, context: Any = None) -> Node:
  """A node converting ``x`` (a node or a concrete value) to ``dtype``."""
  dtype = np.dtype(dtype)
  return node(lambda v: jax.lax.convert_element_type(v, dtype), [x], dtype, np.shape(x)
              if not isinstance(x, Node) else x.shape, context)


def narrowed(n: Node) -> Node:
  """The node rounding a virtual node to its half dtype (one per node)."""
  if n.narrowed is None:
    n.narrowed = convert(n, n.virtual, n.context)
  return n.narrowed


def concrete(n: Node) -> Any:
  """The concrete value of ``n`` (its region bound already)."""
  if n.value is None:  # Read after its region was bound without it: evaluate it again.
    args = [concrete(a) if isinstance(a, Node) else a for a in n.args]
    with _context(n):
      n.value = n.op(*args)
  return n.value


def _context(n: Node) -> Any:
  return jaxpr_utils.eqn_context(n.context) if n.context is not None else _NULL


class _Null:
  def __enter__(self) -> None:
    return None

  def __exit__(self, *exc: Any) -> None:
    return None


_NULL = _Null()


def _is_leaf(arg: Any) -> bool:
  """A concrete input of a region (constants are closed over instead)."""
  return not isinstance(arg, (Node, np.ndarray, np.generic, int, float, bool))


def bind(region: Region, outputs: Sequence[Node]) -> None:
  """Binds ``region``, computing ``outputs`` (under ``jax.checkpoint`` when it pays).

  Only the nodes the outputs depend on are bound. The region is recomputed in
  the backward pass when one of its float32 values is at least as large as
  its largest input: then saving its inputs costs less than saving it.
  """
  outputs = list({id(o): o for o in outputs}.values())
  needed: set[int] = set()
  stack = list(outputs)
  while stack:
    n = stack.pop()
    if id(n) not in needed:
      needed.add(id(n))
      stack.extend(a for a in n.args if isinstance(a, Node) and a.region is region)
  nodes = [n for n in region.nodes if id(n) in needed]
  # A node's node arguments are in its region: regions join when a node reads two.
  leaves = {id(a): a for n in nodes for a in n.args if _is_leaf(a)}
  leaf_ids = list(leaves)

  def run(*values: Any) -> list[Any]:
    env = dict(zip(leaf_ids, values))
    for n in nodes:
      args = [env[id(a)] if isinstance(a, Node) or _is_leaf(a) else a for a in n.args]
      with _context(n):
        env[id(n)] = n.op(*args)
    return [env[id(o)] for o in outputs]

  region.done = True
  values = list(leaves.values())
  largest = max((math.prod(np.shape(v)) for v in values), default=0)
  wide = any(n.dtype.itemsize >= 4 and n.size >= max(largest, 2) for n in nodes)
  outs = jax.checkpoint(run)(*values) if wide and values else run(*values)
  for o, v in zip(outputs, outs):
    o.value = v

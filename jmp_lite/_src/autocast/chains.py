"""Float32 chains: the element-wise work that exists to feed float32-list operations.

:func:`feeding_float32` reads a jaxpr once, before autocast evaluates it, and
names the promote-list equations that compute in float32 (:func:`reach_back`)
because what they compute only feeds float32-list operations (exp, log,
sums): ``logits / 0.01`` before a ``log_softmax``, ``sigmoid(z)`` before a clip
and a ``log``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from jmp_lite._src.autocast.promote import ELEMENTWISE, HALVES, F32, Decision, finer
from jmp_lite._src import jaxpr_utils

# What a float32 region reaches back through, from a float32-list operation to
# the matmul or convolution (or argument) that produced its input: element-wise
# promote-list operations, selects, max/min reductions and data movement;
# converts pass the request on to their inputs, and nested calls into their
# bodies (the outputs a call's caller reads only in float32).
_CHAIN = (ELEMENTWISE | {"select_n", "clamp", "reduce_max", "reduce_min", "broadcast_in_dim",
                         "reshape", "squeeze", "transpose", "rev", "slice", "dynamic_slice",
                         "gather", "concatenate", "pad", "copy", "stop_gradient"})
# A convert passes the request on to its input without computing in float32 itself.
_FOLLOWED = _CHAIN | {"convert_element_type"}
# Readers whose floating result needs no precision from their input: its value
# is the input's sign, or no derivative flows through it (a metric).
_INDIFFERENT = frozenset({"sign", "stop_gradient"})
# Hazards: operations whose result, at a constant finer than the half dtype
# resolves (an eps, a clip bound that rounds to 1), depends on their other
# operands' float32 value (p + 1e-8, clip(p, 1e-7, 1 - 1e-7)).
_AT_CONSTANT = frozenset({"add", "add_any", "sub", "max", "min", "clamp"})
_NONE: Mapping[int, bool] = types.MappingProxyType({})


def _floating_var(v: Any) -> bool:
  """A floating variable of a jaxpr (not a literal)."""
  return not hasattr(v, "val") and jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))


def _body(eqn: Any) -> Any:
  """The body jaxpr of a nested ``jit`` or call equation."""
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(body, "jaxpr", body)


class Chains(NamedTuple):
  """What :func:`feeding_float32` found in one jaxpr.

  Attributes:
    forced: the ids of the promote-list equations that compute in float32.
    calls: for each nested call equation, the indices of its outputs read
      in float32 (for its body's evaluation).
    inputs: the indices of the jaxpr's inputs read only in float32 (the
      caller's chain goes on before the call).
    needed: the indices of the jaxpr's inputs that a hazard needs in float32,
      whatever else reads them.
    inline: for each nested ``jit`` some of whose outputs a hazard needs in
      float32, the indices of those outputs: it is evaluated in place, so
      that its other readers read them rounded to half.
  """

  forced: frozenset[int]
  calls: dict[int, frozenset[int]]
  inputs: frozenset[int]
  needed: frozenset[int]
  inline: dict[int, frozenset[int]]


def _fine_constants(jaxpr: Any, dtype: np.dtype, constants: Mapping[int, bool]) -> tuple[
    set[Any], set[Any]]:
  """The constant variables of ``jaxpr``, and those finer than ``dtype`` resolves.

  A variable is a constant if the equation that makes it reads only constants
  among its floating operands (literals, ``constants``' inputs, constant
  variables): ``convert_element_type`` of a jitted clip's bound, a broadcast
  of a literal, ``jnp.where(mask, 0.0, 1e-8)``. It is fine if one of them is
  (:func:`promote.finer`), as the evaluator's :attr:`Meta.unfit` follows them.
  """
  const = {jaxpr.invars[i] for i in constants}
  fine = {jaxpr.invars[i] for i, f in constants.items() if f}
  for eqn in jaxpr.eqns:
    floats = [v for v in eqn.invars if jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))]
    if not floats or any(True for _ in jaxpr_utils.subjaxprs(eqn)) or not all(
        hasattr(v, "val") or v in const for v in floats):
      continue
    outs = [v for v in eqn.outvars if _floating_var(v)]
    const.update(outs)
    if any(v in fine if not hasattr(v, "val") else finer(v.val, dtype) for v in floats):
      fine.update(outs)
  return const, fine


def inlinable(eqn: Any) -> bool:
  """A nested jit with nothing but its body: no shardings, layouts or compiler options."""
  p = eqn.params
  return (all(type(x).__name__ == "UnspecifiedValue" for x in
              (*p.get("in_shardings", ()), *p.get("out_shardings", ())))
          and all(x is None for x in (*p.get("in_layouts", ()), *p.get("out_layouts", ())))
          and not p.get("compiler_options_kvs") and not any(p.get("donated_invars", ())))


def _is_fine(v: Any, fine: set[Any], dtype: np.dtype) -> bool:
  return finer(v.val, dtype) if hasattr(v, "val") else v in fine


def feeding_float32(
    jaxpr: Any, rule: Callable[[str], str], dtype: np.dtype,
    taken: frozenset[int] = frozenset(), constants: Mapping[int, bool] = _NONE,
    wanted: frozenset[int] = frozenset(),
) -> Chains:
  """The promote-list equations of ``jaxpr`` that compute in float32 to feed float32 work.

  Walking back from each float32-list operation (``rule(name) ==
  "float32"``: exp, log, pow, rsqrt, sums), through the element-wise chain
  that exists only to feed it, to the half-list operation (a matmul, a
  convolution) or the argument it starts at: ``logits / 0.01`` before a
  ``log_softmax``, ``sigmoid(z)`` before a clip and a ``log``, ``h + b``
  before ``mean(h * h) - mean(h) ** 2``. An equation is in the chain when
  every reader of its result is a float32-list operation or in the chain
  (a residual stream that a LayerNorm reads and the next block too is not).
  Those equations compute in float32 (:func:`reach_back`), in a float32
  region that the backward pass recomputes from its half inputs.

  A hazard needs its operand in float32 whatever else reads it: an addition,
  subtraction, clip, max or min (:data:`_AT_CONSTANT`) with a constant finer
  than ``dtype`` resolves (:func:`promote.finer`: ``clip(p, 1e-7, 1 - 1e-7)``,
  ``p + 1e-8``). The chain that makes that operand computes in float32 back
  to the matmul even where the probabilities are also returned, or their max
  is taken: those readers read the value rounded to half, as they would
  without the hazard, and the evaluator gives a float32 reader the float32
  value even after another reader bound its region.

  A reader that needs no precision neither joins nor breaks a chain: one
  whose results are all integers or booleans (a comparison, an argmax, an
  integer convert), a ``sign`` or a ``stop_gradient``, and any operation
  that only feeds such readers. The accuracy ``mean((p > 0.5) == y)``
  returned beside a clipped BCE reads ``p`` and leaves its float32 chain as
  it was; it reads the value the chain rounds to half where it leaves it.

  A nested ``jit`` or call is no boundary: ``taken`` are the indices of
  ``jaxpr``'s outputs that the caller reads only in float32 (its chain goes
  on outside), ``wanted`` those a hazard there needs in float32, and
  ``constants`` its inputs that are constants at the call (a jitted clip's
  bounds), each with whether it is finer than ``dtype`` resolves.

  Args:
    jaxpr: an open jaxpr.
    rule: the list of a primitive (``AutocastLists.rule``).
    dtype: the half dtype.
    taken: the outputs read only in float32 by the caller.
    constants: the inputs that are constants, and whether each is fine.
    wanted: the outputs a hazard of the caller needs in float32.

  Returns:
    The :class:`Chains`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite._src.autocast.lists import AutocastLists
    >>> def bce(z):  # The probabilities are returned too.
    ...   p = jax.nn.sigmoid(z)
    ...   return -jnp.log(jnp.clip(p, 1e-7, 1 - 1e-7)).mean(), p
    >>> jaxpr = jax.make_jaxpr(bce)(jnp.ones(3)).jaxpr
    >>> found = feeding_float32(jaxpr, AutocastLists().rule, np.dtype(jnp.float16))
    >>> [e.primitive.name for e in jaxpr.eqns if id(e) in found.forced]
    ['logistic']
  """
  readers = jaxpr_utils.consumers(jaxpr)
  outside = {v for i, v in enumerate(jaxpr.outvars) if i in taken and _floating_var(v)}
  returned = {v for v in jaxpr.outvars if _floating_var(v)} - outside
  const, fine = _fine_constants(jaxpr, dtype, constants)
  reads: set[tuple[int, Any]] = set()  # (equation, variable) read in float32.
  indifferent: set[int] = set()  # Equations that need no precision from their inputs.
  # Variables a hazard needs in float32, whatever else reads them.
  needed = {v for i, v in enumerate(jaxpr.outvars) if i in wanted and _floating_var(v)}
  forced: set[int] = set()
  calls: dict[int, frozenset[int]] = {}
  inline: dict[int, frozenset[int]] = {}

  def taken_var(v: Any) -> bool:
    mine = readers.get(v, ())
    return v not in returned and (v in outside or any((id(r), v) in reads for r in mine)) and all(
        (id(r), v) in reads or id(r) in indifferent for r in mine)

  def needs_no_precision(eqn: Any) -> bool:
    floating = [v for v in eqn.outvars if _floating_var(v)]
    return eqn.primitive.name in _INDIFFERENT or all(
        v not in returned and v not in outside and readers.get(v)
        and all(id(r) in indifferent for r in readers[v]) for v in floating)

  for eqn in reversed(jaxpr.eqns):
    name = eqn.primitive.name
    floats = [v for v in eqn.invars if _floating_var(v) and v not in const]
    hazard_reads = any(v in needed for v in eqn.outvars)  # A hazard needs an output.
    if rule(name) == "float32":
      reads.update((id(eqn), v) for v in eqn.invars if not hasattr(v, "val"))
    elif name in ("jit", "closed_call"):
      # Its body's chain ends at those outputs and may go on before the call.
      calls[id(eqn)] = frozenset(i for i, v in enumerate(eqn.outvars) if taken_var(v))
      if hazard_reads and name == "jit" and inlinable(eqn):
        inline[id(eqn)] = frozenset(i for i, v in enumerate(eqn.outvars) if v in needed)
      at_call = {i: _is_fine(v, fine, dtype) for i, v in enumerate(eqn.invars)
                 if hasattr(v, "val") or v in const}
      if not calls[id(eqn)] and id(eqn) not in inline and needs_no_precision(eqn):
        indifferent.add(id(eqn))  # A jitted argmax, say.
      elif calls[id(eqn)] or id(eqn) in inline or any(at_call.values()):  # Or a jitted clip.
        inner = feeding_float32(_body(eqn), rule, dtype, calls[id(eqn)], at_call,
                                inline.get(id(eqn), frozenset()))
        reads.update((id(eqn), v) for i, v in enumerate(eqn.invars)
                     if i in inner.inputs and not hasattr(v, "val"))
        needed.update(v for i, v in enumerate(eqn.invars) if i in inner.needed and v in floats)
    elif name in _FOLLOWED and eqn.outvars and (
        hazard_reads or all(taken_var(v) for v in eqn.outvars)):
      reads.update((id(eqn), v) for v in eqn.invars if not hasattr(v, "val"))
      if name in _CHAIN:
        forced.add(id(eqn))
      if hazard_reads:
        needed.update(floats)
    elif eqn.outvars and needs_no_precision(eqn):
      indifferent.add(id(eqn))
    if (name in _AT_CONSTANT and rule(name) == "promote" and id(eqn) not in indifferent
        and any(_is_fine(v, fine, dtype) for v in eqn.invars)):
      needed.update(floats)
  inputs = frozenset(i for i, v in enumerate(jaxpr.invars) if _floating_var(v) and taken_var(v))
  return Chains(frozenset(forced), {k: v for k, v in calls.items() if v}, inputs,
                frozenset(i for i, v in enumerate(jaxpr.invars) if v in needed), inline)


def reach_back(decision: Decision) -> Decision:
  """A promote decision for an operation that feeds a float32-list one: computed in float32.

  A half result stays half where it leaves the region (it is held in
  float32 as a virtual half value until then), so the values other
  operations read, and the memory the backward pass keeps, do not change;
  the float32-list operation reads the float32 value.
  """
  if decision.compute in HALVES:
    return Decision(F32, decision.virtual or decision.compute, decision.meta)
  return decision

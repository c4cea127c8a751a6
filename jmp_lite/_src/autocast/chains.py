"""Float32 chains: the element-wise work that exists to feed float32-list operations.

:func:`feeding_float32` reads a jaxpr once, before autocast evaluates it, and
names the promote-list equations that compute in float32 (:func:`reach_back`)
because what they compute only feeds float32-list operations (exp, log,
sums): ``logits / 0.01`` before a ``log_softmax``, ``sigmoid(z)`` before a clip
and a ``log``.
"""

from __future__ import annotations

from typing import Any, Callable

from jmp_lite._src.autocast.promote import ELEMENTWISE, HALVES, F32, Decision
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


def _floating_var(v: Any) -> bool:
  """A floating variable of a jaxpr (not a literal)."""
  return not hasattr(v, "val") and jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))


def _body(eqn: Any) -> Any:
  """The body jaxpr of a nested ``jit`` or call equation."""
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return getattr(body, "jaxpr", body)


def feeding_float32(
    jaxpr: Any, rule: Callable[[str], str], taken: frozenset[int] = frozenset()
) -> tuple[frozenset[int], dict[int, frozenset[int]], frozenset[int]]:
  """The ids of ``jaxpr``'s promote-list equations that only feed float32-list ops.

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

  A reader that needs no precision neither joins nor breaks a chain: one
  whose results are all integers or booleans (a comparison, an argmax, an
  integer convert), a ``sign`` or a ``stop_gradient``, and any operation
  that only feeds such readers. The accuracy ``mean((p > 0.5) == y)``
  returned beside a clipped BCE reads ``p`` and leaves its float32 chain as
  it was; it reads the value the chain rounds to half where it leaves it.

  A nested ``jit`` or call is no boundary: ``taken`` are the indices of
  ``jaxpr``'s outputs that the caller reads only in float32 (its chain goes
  on outside). Returns the chain's equation ids; for each nested call
  equation, the indices of its outputs read so here (for its body's
  evaluation); and the indices of ``jaxpr``'s inputs read only in float32
  (for the caller's chain, which goes on before the call).
  """
  readers = jaxpr_utils.consumers(jaxpr)
  outside = {v for i, v in enumerate(jaxpr.outvars) if i in taken and _floating_var(v)}
  returned = {v for v in jaxpr.outvars if _floating_var(v)} - outside
  reads: set[tuple[int, Any]] = set()  # (equation, variable) read in float32.
  indifferent: set[int] = set()  # Equations that need no precision from their inputs.
  forced: set[int] = set()
  calls: dict[int, frozenset[int]] = {}

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
    if rule(name) == "float32":
      reads.update((id(eqn), v) for v in eqn.invars if not hasattr(v, "val"))
    elif name in ("jit", "closed_call"):
      # Its body's chain ends at those outputs and may go on before the call.
      calls[id(eqn)] = frozenset(i for i, v in enumerate(eqn.outvars) if taken_var(v))
      if not calls[id(eqn)] and needs_no_precision(eqn):  # A jitted argmax, say.
        indifferent.add(id(eqn))
      elif calls[id(eqn)]:
        inner = feeding_float32(_body(eqn), rule, calls[id(eqn)])[2]
        reads.update((id(eqn), v) for i, v in enumerate(eqn.invars)
                     if i in inner and not hasattr(v, "val"))
    elif name in _FOLLOWED and eqn.outvars and all(taken_var(v) for v in eqn.outvars):
      reads.update((id(eqn), v) for v in eqn.invars if not hasattr(v, "val"))
      if name in _CHAIN:
        forced.add(id(eqn))
    elif eqn.outvars and needs_no_precision(eqn):
      indifferent.add(id(eqn))
  inputs = frozenset(i for i, v in enumerate(jaxpr.invars) if _floating_var(v) and taken_var(v))
  return frozenset(forced), {k: v for k, v in calls.items() if v}, inputs


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

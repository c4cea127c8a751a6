"""What each leaf of an optimizer's state is, read from its ``init`` program.

:func:`jmp_lite.quantize_state` codes a transformation's *moments* and
nothing else. Which leaves those are comes from the state itself, never
from field names: ``init`` is traced as a jaxpr with the parameters as its
inputs, and each output leaf is

- ``"params"`` when its value depends on the parameters' *values* (data
  flows from an input to it): schedule_free's ``z``, prodigy's ``params0``,
  dog's ``init_params``, a copy or any function of the parameters. Never
  coded: an lr-sized change to a copy of the parameters would round away.
- ``"moment"`` when it is floating, has a parameter's shape and depends on
  the parameters' shapes only (zeros or another constant): Adam's ``mu`` and
  ``nu``, a momentum ``trace``, sm3's ``nu``, a ``MultiSteps`` accumulator.
- ``"count"`` when it is not floating (counts, PRNG keys, flags).
- ``"other"`` for the rest (scalars, factored statistics, hyperparameters).

A moment must also be one in ``update``: traced once at ``init`` with zero
gradients, its new value must reach its old one through element-wise
arithmetic (``b * m + (1 - b) * g``). A leaf that is zeros at ``init`` but
that the update overwrites or rebuilds (L-BFGS's last params, gradient and
line-search memory) is ``"rewritten"``, and never coded: its next value does
not average rounding errors away, and the update subtracts it from a fresh
one (``g - g_prev``).

Data flow is followed into nested ``jit`` and ``custom_jvp`` bodies; any
other higher-order primitive (``scan``, ``while``, ``cond``) that reads a
parameter is taken to pass it to all its outputs, so that a doubt keeps a
leaf as the inner made it. An ``init`` that cannot be traced (one that
reads parameter values in Python) is refused with a ``TypeError``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src import filtering
from jmp_lite._src import jaxpr_utils
from jmp_lite._src import tree_utils

MOMENT, PARAMS, COUNT, OTHER = "moment", "params", "count", "other"
REWRITTEN = "rewritten"  # moment-like at init, but the update does not keep it as an average
KINDS = (MOMENT, PARAMS, COUNT, OTHER, REWRITTEN)

# Higher-order primitives whose one body maps inputs to outputs one for one.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "remat",
                    "checkpoint", "remat2"})

# Element-wise primitives: a moving average's new value reaches its old one through
# these only (``b * m + (1 - b) * g``, a select that keeps it on a skipped step).
_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "select_n",
    "clamp", "integer_pow", "square", "sqrt", "rsqrt", "pow", "exp", "log", "log1p", "expm1",
    "tanh", "logistic", "convert_element_type", "copy", "copy_p", "reduce_precision",
    "stop_gradient", "pvary",
})

_UNTRACEABLE = (
    "quantize_state could not trace {tx}'s init with the parameters as inputs ({error}). It "
    "reads each state leaf's kind (a moment, a copy of the parameters, a count) from that "
    "program, so it cannot wrap this transformation; use the transformation unwrapped.")


def _depends(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
  """For each output of ``jaxpr``: whether data flows to it from an input marked True.

  Into nested ``jit`` and ``custom_jvp`` bodies; any other primitive passes
  every input to every output.
  """

  def step(eqn: Any, ins: list[frozenset[int]], name: str,
           subs: list[Any]) -> list[frozenset[int]]:
    if (name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(ins)
        and len(subs[0].outvars) == len(eqn.outvars)):
      return _walk(subs[0], ins, step)
    return [frozenset().union(*ins)] * len(eqn.outvars)

  marked = [frozenset({0}) if d else frozenset() for d in inputs]
  return [bool(label) for label in _walk(jaxpr, marked, step)]


def _walk(jaxpr: Any, sources: Sequence[frozenset[int]],
          step: Callable[[Any, list[frozenset[int]], str, list[Any]], list[frozenset[int]] | None],
          ) -> list[frozenset[int]]:
  """Labels carried through ``jaxpr``: the label of each of its outputs.

  ``sources[i]`` labels input ``i`` (a set of leaf numbers). Each equation
  with a labelled operand is given to ``step(eqn, operand labels, primitive
  name, sub-jaxprs)``, which returns its outputs' labels (or None: none).
  """
  labels: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, sources))

  def label(v: Any) -> frozenset[int]:
    return labels.get(v, frozenset()) if isinstance(v, jex_core.Var) else frozenset()

  for eqn in jaxpr.eqns:
    ins = [label(v) for v in eqn.invars]
    if any(ins):
      outs = step(eqn, ins, eqn.primitive.name, list(jaxpr_utils.subjaxprs(eqn)))
      labels.update((v, o) for v, o in zip(eqn.outvars, outs or ()) if o)
  return [label(v) for v in jaxpr.outvars]


def _elementwise_from(jaxpr: Any, sources: Sequence[frozenset[int]]) -> list[frozenset[int]]:
  """For each output of ``jaxpr``: the inputs it reaches through element-wise steps only.

  ``sources[i]`` labels input ``i`` (a set of leaf numbers). An output is
  labelled with the union of the labels of the inputs from which a chain of
  element-wise equations leads to it, each step from an operand of the
  step's own shape (no broadcast, reduction, slice or loop in between).
  Nested ``jit``, ``custom_jvp`` and ``cond`` bodies are followed (a
  ``cond``'s outputs take the union over its branches); any other
  higher-order primitive cuts the chain.
  """

  def step(eqn: Any, ins: list[frozenset[int]], name: str,
           subs: list[Any]) -> list[frozenset[int]] | None:
    if name in _ELEMENTWISE and len(eqn.outvars) == 1:
      shape = getattr(eqn.outvars[0].aval, "shape", None)
      return [frozenset().union(*(l for v, l in zip(eqn.invars, ins)
                                  if getattr(v.aval, "shape", None) == shape))]
    if name == "cond":  # operands follow the branch index
      per_branch = [_elementwise_from(b, ins[1:]) for b in subs]
      return [frozenset().union(*o) for o in zip(*per_branch)]
    if (name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(ins)
        and len(subs[0].outvars) == len(eqn.outvars)):
      return _elementwise_from(subs[0], ins)
    return None

  return _walk(jaxpr, sources, step)


class UpdateProgram(NamedTuple):
  """An update's new state as a jaxpr of the state's array leaves (:func:`update_program`).

  Attributes:
    jaxpr: the open jaxpr.
    where: ``where[k]`` is the state leaf of the jaxpr's input ``k``.
    leaves: how many leaves the state has.
  """

  jaxpr: Any
  where: list[int]
  leaves: int

  def labels(self) -> list[frozenset[int]]:
    """Each input labelled with its leaf's number."""
    return [frozenset({i}) for i in self.where]


def update_program(update: Callable[..., Any], state: Any, params: Any) -> UpdateProgram | None:
  """``update(grads, state, params)``'s new state, traced once with zero gradients.

  :func:`averages` and :func:`divisors` read it. When the update needs extra
  arguments, the keywords of optax's value-and-gradient protocol (``value``,
  ``grad``, ``value_fn``) are given stand-ins; ``None`` if it still cannot be
  traced, or if it changes the state's structure.
  """
  traced, spec = filtering.partition(state)
  where = [i for i, x in enumerate(traced) if x is not None]
  zeros = jax.tree.map(jnp.zeros_like, params)

  def value_fn(p: Any, *args: Any, **kwargs: Any) -> jax.Array:
    del args, kwargs
    return sum((jnp.sum(x) for x in jax.tree.leaves(p)), jnp.zeros(()))

  stand_ins: tuple[dict[str, Any], ...] = ({}, {"value": jnp.zeros(()), "grad": zeros, "value_fn": value_fn})
  for extra in stand_ins:
    def new_state(*arrays: Any, extra: dict[str, Any] = extra) -> Any:
      full = list(traced)
      for i, a in zip(where, arrays):
        full[i] = a
      return update(zeros, filtering.combine(full, spec), params, **extra)[1]

    try:
      closed, shapes = jax.make_jaxpr(new_state, return_shape=True)(*[traced[i] for i in where])
    except Exception:  # pylint: disable=broad-exception-caught  # try the next stand-ins
      continue
    if len(jax.tree.leaves(shapes)) != len(traced):  # the update changed the structure
      return None
    return UpdateProgram(closed.jaxpr, where, len(traced))
  return None


def averages(program: UpdateProgram) -> list[bool]:
  """For each leaf of the state: whether the update keeps it as a running value of itself.

  A leaf is a running value (a moving average, a momentum, an accumulator)
  when its new value reaches its old one through element-wise arithmetic
  (see :func:`_elementwise_from`). A leaf the update overwrites (L-BFGS's
  last params and gradient) or rebuilds through a loop or a reduction (a line
  search's memory) is not one.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(3)}
    >>> adam, lbfgs = optax.adam(1e-3), optax.lbfgs()
    >>> averages(update_program(adam.update, adam.init(params), params))  # count, mu, nu
    [True, True, True]
    >>> averages(update_program(lbfgs.update, lbfgs.init(params), params))[1:3]  # last params, grad
    [False, False]
  """
  reached = _elementwise_from(program.jaxpr, program.labels())
  return [i in r for i, r in enumerate(reached)]


# Where a zero would make an update divide by (almost) nothing: each primitive's operands
# in that place (a divisor, what a reciprocal root or a log is taken of).
_ZERO_HAZARDS = {"div": (1,), "rem": (1,), "rsqrt": (0,), "log": (0,), "pow": (0,)}


def _divisor_labels(jaxpr: Any, sources: Sequence[frozenset[int]]) -> frozenset[int]:
  """The labels of ``jaxpr``'s inputs whose data reaches a place of :data:`_ZERO_HAZARDS`.

  Data is followed through every primitive and into nested ``jit``,
  ``custom_jvp`` and ``cond`` bodies; any other higher-order primitive
  (``scan``, ``while``) is taken to divide by each of its operands, so that
  a doubt keeps a leaf from coding 0.
  """
  found: set[int] = set()

  def step(eqn: Any, ins: list[frozenset[int]], name: str,
           subs: list[Any]) -> list[frozenset[int]]:
    if name == "cond":
      found.update(*(_divisor_labels(b, ins[1:]) for b in subs))
    elif name in _CALLS and len(subs) == 1 and len(subs[0].invars) == len(ins):
      found.update(_divisor_labels(subs[0], ins))
    elif subs:
      found.update(*ins)
    else:
      found.update(*(ins[k] for k in _ZERO_HAZARDS.get(name, ()) if k < len(ins)))
    return [frozenset().union(*ins)] * len(eqn.outvars)

  _walk(jaxpr, sources, step)
  return frozenset(found)


def divisors(program: UpdateProgram) -> list[bool]:
  """For each leaf of the state: whether the update divides by it (or a function of it).

  Adam's ``nu`` (under ``sqrt`` in the step's denominator) is one, and so is
  its count (the bias correction divides by ``1 - b**count``); its ``mu``
  (the numerator) is not. A coded leaf that is one must never decode to 0
  from a non-zero value: the update would divide by ``eps``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(3)}
    >>> adam = optax.adam(1e-3)
    >>> divisors(update_program(adam.update, adam.init(params), params))  # count, mu, nu
    [True, False, True]
  """
  hit = _divisor_labels(program.jaxpr, program.labels())
  return [i in hit for i in range(program.leaves)]


def refine(state_kinds: list[str], running: list[bool] | None) -> list[str]:
  """``state_kinds`` with each moment that :func:`averages` found no running value made ``"rewritten"``.

  With ``running`` None (an update that could not be traced) the kinds stay
  as ``init`` showed them.

  Examples:
    >>> refine(["count", "moment", "moment"], [True, True, False])
    ['count', 'moment', 'rewritten']
  """
  if running is None:
    return list(state_kinds)
  return [REWRITTEN if k == MOMENT and not r else k for k, r in zip(state_kinds, running)]


def kinds(init: Callable[[Any], Any], params: Any, n_leaves: int, name: str) -> list[str]:
  """The kind of each leaf of ``init(params)``, in ``jax.tree.leaves`` order.

  Args:
    init: the inner transformation's ``init``.
    params: the parameters ``init`` is called with (non-array leaves, such
      as Equinox's activation functions, are held fixed).
    n_leaves: how many leaves ``init(params)`` has (a check of the trace).
    name: the transformation, for messages.

  Raises:
    TypeError: if ``init`` cannot be traced.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones((2, 3))}
    >>> kinds(optax.adam(1e-3).init, params, 3, "adam")
    ['count', 'moment', 'moment']
    >>> kinds(optax.contrib.schedule_free_sgd(1.0).init, params, 5, "schedule_free")  # z: params
    ['other', 'other', 'count', 'other', 'params']
  """
  traced, spec = filtering.partition(params)
  where = [i for i, x in enumerate(traced) if x is not None]

  def from_arrays(*arrays: Any) -> Any:
    full = list(traced)
    for i, a in zip(where, arrays):
      full[i] = a
    return init(filtering.combine(full, spec))

  try:
    closed, shapes = jax.make_jaxpr(from_arrays, return_shape=True)(*[traced[i] for i in where])
  except jax.errors.JAXTypeError as e:
    raise TypeError(_UNTRACEABLE.format(tx=name, error=type(e).__name__)) from e
  outs = jax.tree.leaves(shapes)
  if len(outs) != n_leaves:  # init returned another structure when traced.
    raise TypeError(_UNTRACEABLE.format(tx=name, error="its state differs when traced"))
  dep = _depends(closed.jaxpr, [True] * len(where))
  param_shapes = {tuple(np.shape(traced[i])) for i in where if tree_utils.is_floating_array(traced[i])}

  def kind(out: Any, depends: bool) -> str:
    if not jaxpr_utils.is_floating(out.dtype):
      return COUNT
    if depends:
      return PARAMS
    return MOMENT if tuple(out.shape) in param_shapes else OTHER

  return [kind(o, d) for o, d in zip(outs, dep)]


def _key_name(key: Any) -> str:
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _owners(names: tuple[str, ...], shape: tuple[int, ...],
            params: list[tuple[tuple[str, ...], str, Any]]) -> list[tuple[str, Any]]:
  """The parameters of ``shape`` whose key paths share the longest suffix with ``names``."""
  best, found = 0, list[tuple[str, Any]]()
  for p_names, p_path, leaf in params:
    if tuple(np.shape(leaf)) != shape:
      continue
    k = 0
    while k < min(len(names), len(p_names)) and names[-1 - k] == p_names[-1 - k]:
      k += 1
    if k and k >= best:
      found = found + [(p_path, leaf)] if k == best else [(p_path, leaf)]
      best = k
  return found


def plan(state: Any, state_kinds: list[str], params: Any, min_size: int,
         keep: Sequence[Callable[[str, Any], bool]],
         keep_state: Sequence[Callable[[str, Any], bool]]) -> list[bool]:
  """Whether to code each leaf of ``state`` (``jax.tree.leaves`` order); warns if none.

  A leaf is coded when it is a moment with at least ``min_size`` elements,
  no ``keep_state`` rule selects its ``/``-joined state path and no ``keep``
  rule selects its parameter (the same-shaped parameters whose key paths end
  like the leaf's, longest shared ending first).
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  by_param = [(tuple(_key_name(k) for k in p), tree_utils.path_str(p), x)
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
  coded, small, kept = [], [], 0
  for (path, leaf), kind in zip(flat, state_kinds):
    if kind != MOMENT or not tree_utils.is_floating_array(leaf):  # A Python float stays one.
      coded.append(False)
      continue
    size = int(np.prod(np.shape(leaf)))
    names = tuple(_key_name(k) for k in path)
    selected = (any(rule(tree_utils.path_str(path), leaf) for rule in keep_state)
                or any(rule(p, x) for rule in keep for p, x in _owners(names, np.shape(leaf), by_param)))
    kept += bool(selected)
    if size < min_size and not selected:
      small.append(size)
    coded.append(size >= min_size and not selected)
  if not any(coded):
    warnings.warn(_nothing_coded(state_kinds, small, kept, min_size), UserWarning, stacklevel=3)
  return coded


def _nothing_coded(state_kinds: list[str], small: list[int], kept: int, min_size: int) -> str:
  """Why :func:`plan` codes nothing, for its warning."""
  moments = state_kinds.count(MOMENT)
  if not moments:
    why = ("its state has no moment: no floating leaf shaped like a parameter whose initial "
           "value is independent of the parameters' values and that the update keeps as a "
           "running value of itself")
    if PARAMS in state_kinds:
      why += f" ({state_kinds.count(PARAMS)} leaves copy or depend on the parameters: never coded)"
    if REWRITTEN in state_kinds:
      why += (f" ({state_kinds.count(REWRITTEN)} leaves are rewritten at each update, not "
              "averaged: L-BFGS's memory of the last params and gradient; never coded)")
  else:
    parts = []
    if small:
      parts.append(f"{len(small)} have fewer than min_size={min_size} elements "
                   f"(the largest has {max(small)})")
    if kept:
      parts.append(f"{kept} are selected by keep or keep_state rules")
    why = f"of its {moments} moment leaves, " + " and ".join(parts)
  return (f"quantize_state codes no leaf of this transformation's state: {why}. The state stays "
          "as the inner transformation made it, in full precision, and saves no memory.")

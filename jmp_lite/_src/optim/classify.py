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

Data flow is followed into nested ``jit`` and ``custom_jvp`` bodies; any
other higher-order primitive (``scan``, ``while``, ``cond``) that reads a
parameter is taken to pass it to all its outputs, so that a doubt keeps a
leaf as the inner made it. An ``init`` that cannot be traced (one that
reads parameter values in Python) is refused with a ``TypeError``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src import filtering
from jmp_lite._src import jaxpr_utils
from jmp_lite._src import tree_utils

MOMENT, PARAMS, COUNT, OTHER = "moment", "params", "count", "other"
KINDS = (MOMENT, PARAMS, COUNT, OTHER)

# Higher-order primitives whose one body maps inputs to outputs one for one.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "remat",
                    "checkpoint", "remat2"})

_UNTRACEABLE = (
    "quantize_state could not trace {tx}'s init with the parameters as inputs ({error}). It "
    "reads each state leaf's kind (a moment, a copy of the parameters, a count) from that "
    "program, so it cannot wrap this transformation; use the transformation unwrapped.")


def _depends(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
  """For each output of ``jaxpr``: whether data flows to it from an input marked True."""
  dep = {v for v, d in zip(jaxpr.invars, inputs) if d}
  for eqn in jaxpr.eqns:
    ins = [isinstance(v, jex_core.Var) and v in dep for v in eqn.invars]
    if not any(ins):
      continue
    subs = list(jaxpr_utils.subjaxprs(eqn))
    if (eqn.primitive.name in _CALLS and len(subs) == 1
        and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars)):
      outs = _depends(subs[0], ins)
    else:  # Any other primitive: every output reads every input.
      outs = [True] * len(eqn.outvars)
    dep.update(v for v, d in zip(eqn.outvars, outs) if d)
  return [isinstance(v, jex_core.Var) and v in dep for v in jaxpr.outvars]


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
           "value is independent of the parameters' values")
    if PARAMS in state_kinds:
      why += f" ({state_kinds.count(PARAMS)} leaves copy or depend on the parameters: never coded)"
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

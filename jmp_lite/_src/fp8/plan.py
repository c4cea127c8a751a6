"""Which matmuls of a traced function run in FP8: keep rules and sizes (issue 30).

Before autocast evaluates a jaxpr with an FP8 recipe, :func:`plan` has it
walked once (:func:`jmp_lite._src.fp8.sources.found_in`): every
``dot_general`` in it (sub-jaxprs included), its position, its name-stack
entry, its sizes, and the argument leaves its operands come from (through a
``scan``'s stacked input to its per-step slice too, so a rule that keeps a
stacked weight keeps every layer of the stack).

The plan lives in a context variable while autocast evaluates the jaxpr
(:func:`active`); autocast's FP8 rule asks :func:`decide` for each matmul.

Decisions are per call site, not per equation: JAX traces a jitted helper
once per input types, so two layers that call ``jax.jit(dense)`` hold the same
``dot_general`` equation. A matmul is named by its *site*, the ids of the
higher-order equations it is nested in (outermost first) and its own;
autocast enters each higher-order equation :func:`within` its site, and keys
its nested-jit cache on :func:`signature`, the decisions under the site.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from typing import Any, Iterator, Mapping, Sequence, Union

from jmp_lite._src import jaxpr_utils
from jmp_lite._src import policy as policy_lib
from jmp_lite._src.fp8 import sources
from jmp_lite._src.fp8.recipe import Float8Recipe
from jmp_lite._src.fp8.sources import Matmul as Matmul
from jmp_lite._src.fp8.sources import matmuls as matmuls


@dataclasses.dataclass(frozen=True)
class Plan:
  """The matmuls of one traced function, by equation, and the choices the recipe makes.

  Attributes:
    matmuls: ``{site: Matmul}``, a site being the ids of the equations that
      nest the matmul (outermost first) and of its own ``dot_general``.
    kept: the indices that keep rules keep in the half dtype.
    which: when set (``fp8_sensitivity``), a traced int32 scalar: the matmul
      numbered ``which`` runs in FP8 and every other in the half dtype. Each
      computes both products and picks one at run time, so that one compiled
      program measures every matmul in turn.
    under: ``{site of a higher-order equation: the kept flags of the matmuls
      nested in it, in program order}`` (see :func:`signature`).
    lookups: ``{site: path}``: the row lookups (``jnp.take(table, i, axis=0)``,
      an embedding; outside loop and ``shard_map`` bodies) whose table holds
      the values of the argument leaf at ``path``, kept by no rule and not
      smaller than ``min_size`` (tokens, rows, features): where ``path`` is
      a params leaf, their cotangents run in FP8 (:mod:`jmp_lite._src.fp8.lookup`).
  """

  matmuls: Mapping[tuple[int, ...], Matmul]
  kept: frozenset[int] = frozenset()
  which: Any = None
  under: Mapping[tuple[int, ...], tuple[bool, ...]] = dataclasses.field(default_factory=dict)
  lookups: Mapping[tuple[int, ...], str] = dataclasses.field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[Union[Plan, None]] = contextvars.ContextVar(
    "jmp_lite_fp8_plan", default=None)
_WHICH: contextvars.ContextVar[Any] = contextvars.ContextVar("jmp_lite_fp8_which", default=None)
# The site of the higher-order equation autocast is evaluating (see the module docstring).
_SITE: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar(
    "jmp_lite_fp8_site", default=())
# What a matmul that is not in the plan does (a custom rule's): None, as configured;
# False, the half dtype (see :func:`unplanned`).
_UNPLANNED: contextvars.ContextVar[Union[bool, None]] = contextvars.ContextVar(
    "jmp_lite_fp8_unplanned", default=None)


def plan(jaxpr: Any, paths: Sequence[Union[str, None]], leaves: Sequence[Any],
         recipe: Float8Recipe) -> Plan:
  """The :class:`Plan` of ``jaxpr`` under ``recipe``'s keep rules (and :func:`choosing`).

  A keep rule that keeps no matmul warns (``UserWarning``), naming the rule
  and the paths the matmuls read, as the policy's keep rules do; so do a
  function with no floating matmul (and no row lookup whose cotangent runs
  in FP8) and a ``min_size`` that no floating matmul reaches, since FP8 was
  asked for and nothing would run in it (:func:`_warn_if_nothing_in_fp8`).
  """
  lookups: sources.Lookups = []
  sites = sources.found_in(jaxpr, paths, lookups)
  found = [(eqn, m) for _, eqn, m in sites]
  kept: set[int] = set()
  keep = tuple(recipe.keep)  # type: ignore[arg-type]  # Normalised to a tuple by the recipe.
  leaf_of = {p: x for p, x in zip(paths, leaves) if p is not None}
  rules = [policy_lib.compile_rule(r) for r in keep]
  fp8_lookups = {site: path for site, eqn, path in lookups
                 if not any(rule(path, leaf_of[path]) for rule in rules)
                 and min(math.prod(eqn.invars[1].aval.shape[:-1]),
                         *eqn.invars[0].aval.shape) >= recipe.min_size}
  _warn_if_nothing_in_fp8([(eqn, m) for eqn, m in found if _floating(eqn)], bool(fp8_lookups),
                          recipe)
  if keep:
    read = list({p: leaf_of[p] for p in [*(p for _, m in found for p in m.reads),
                                         *(path for _, _, path in lookups)] if p in leaf_of}.items())
    for eqn, m in found:
      if any(rule(p, leaf_of[p]) for rule in rules for p in m.reads if p in leaf_of):
        kept.add(m.index)
    policy_lib.warn_unmatched(keep, read, "the Float8Recipe",
                              "argument leaf that a matmul reads", "no matmul in half",
                              "leaves the matmuls read")
  under: dict[tuple[int, ...], list[bool]] = {}
  for site, _, m in sites:
    for k in range(1, len(site)):
      under.setdefault(site[:k], []).append(m.index in kept)
  return Plan({site: m for site, _, m in sites}, frozenset(kept), _WHICH.get(),
              {site: tuple(flags) for site, flags in under.items()}, fp8_lookups)


# What FP8 asked for and nothing in it says: one class (UserWarning), one home.
_NOTHING_IN_FP8 = "fp8 is on, but {why}, so nothing runs in FP8{fix}"
_NO_MATMUL = ("the function runs no floating matmul (dot_general; convolutions run in the "
              "half dtype)", ": pass fp8=False (or None)")
_TOO_SMALL = (
    "none of the {n} matmuls reaches the recipe's min_size={min_size} in all three GEMM sizes "
    "(the largest is {m} x {k} x {nn}, M x K x N)",
    ": every one runs in the half dtype. FP8 pays on an H100 only from about 4096 "
    "(docs/fp8.md, 'From what size FP8 pays'). Pass fp8=jmp.Float8Recipe(min_size=0) to run "
    "them in FP8 anyway, or fp8=False")


def _floating(eqn: Any) -> bool:
  return all(jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v)) for v in eqn.invars[:2])


def _warn_if_nothing_in_fp8(found: list[tuple[Any, Matmul]], lookups: bool,
                            recipe: Float8Recipe) -> None:
  """A ``UserWarning`` when FP8 is on and nothing runs in it.

  Either the function has no floating matmul (and no row lookup whose
  cotangent runs in FP8: ``lookups``), or ``min_size`` leaves every matmul
  in the half dtype.
  """
  if not found:
    if not lookups:
      why, fix = _NO_MATMUL
      warnings.warn(_NOTHING_IN_FP8.format(why=why, fix=fix), UserWarning, stacklevel=4)
    return
  if recipe.min_size == 0 or any(min(m.shape[:3]) >= recipe.min_size for _, m in found):
    return
  m, k, n, _ = max((m.shape for _, m in found), key=lambda s: (min(s[:3]), s[0] * s[1] * s[2]))
  why = _TOO_SMALL[0].format(n=len(found), min_size=recipe.min_size, m=m, k=k, nn=n)
  warnings.warn(_NOTHING_IN_FP8.format(why=why, fix=_TOO_SMALL[1]), UserWarning, stacklevel=4)


@contextlib.contextmanager
def choosing(which: Any) -> Iterator[None]:
  """Plans made while the block runs put only matmul number ``which`` (traced) in FP8.

  ``which`` is an int32 scalar of the trace the plans are made in; a value
  that numbers no matmul (``-1``) leaves every matmul in the half dtype.
  """
  token = _WHICH.set(which)
  try:
    yield
  finally:
    _WHICH.reset(token)


@contextlib.contextmanager
def active(p: Union[Plan, None], site: tuple[int, ...] = (),
           unplanned: Union[bool, None] = None) -> Iterator[None]:
  """Makes ``p`` the plan :func:`decide` reads while the block runs, from ``site`` down.

  ``unplanned=False`` runs the matmuls that are not in the plan (a custom
  rule's, traced anew) in the half dtype.
  """
  tokens = (_ACTIVE.set(p), _SITE.set(site), _UNPLANNED.set(unplanned))
  try:
    yield
  finally:
    for var, token in zip((_ACTIVE, _SITE, _UNPLANNED), tokens):
      var.reset(token)  # type: ignore[attr-defined]


def current() -> tuple[Union[Plan, None], tuple[int, ...], Union[bool, None]]:
  """The active plan, site and ``unplanned``: what a rule run later enters again with :func:`active`."""
  return _ACTIVE.get(), _SITE.get(), _UNPLANNED.get()


@contextlib.contextmanager
def within(eqn: Any) -> Iterator[None]:
  """Autocast evaluates the sub-jaxprs of the higher-order ``eqn`` (at its site)."""
  token = _SITE.set(_SITE.get() + (id(eqn),))
  try:
    yield
  finally:
    _SITE.reset(token)


def signature() -> Any:
  """What the decisions inside the higher-order equation being evaluated (:func:`within`) depend on.

  The nested-jit cache keys on it, so that two call sites of one jitted
  helper share a body only where their matmuls are kept alike.
  """
  p = _ACTIVE.get()
  if p is None:
    return None
  site = _SITE.get()
  return (_UNPLANNED.get(), p.under.get(site),
          tuple(s[len(site):] for s in p.lookups if s[:len(site)] == site))


def keeps_any() -> bool:
  """Whether a keep rule keeps a matmul inside the higher-order equation being evaluated."""
  p = _ACTIVE.get()
  return p is not None and any(p.under.get(_SITE.get(), ()))


def choosing_at_run_time() -> bool:
  """Whether a sensitivity run (:func:`choosing`) is active: matmuls pick at run time."""
  p = _ACTIVE.get()
  return p is not None and p.which is not None


def decide(eqn: Any, recipe: Float8Recipe) -> bool:
  """Whether ``eqn`` (a half-list ``dot_general``) runs in FP8 under ``recipe`` and the active plan.

  FP8 unless a keep rule keeps it, it is smaller than ``recipe.min_size`` in
  one of its three GEMM sizes, or it is not in the plan while a sensitivity
  run chooses (:func:`choosing`); then :func:`run_time_choice` says whether
  the FP8 product is used.
  """
  lhs_free, contracting, rhs_free, _ = sources.gemm_sizes(eqn)
  if min(lhs_free, contracting, rhs_free) < recipe.min_size:
    return False
  p = _ACTIVE.get()
  if p is None:
    return True
  m = p.matmuls.get(_SITE.get() + (id(eqn),))
  if m is None:  # Not in the traced function's jaxpr (a custom rule's): as configured.
    unplanned = _UNPLANNED.get()
    return p.which is None if unplanned is None else unplanned
  return m.index not in p.kept


def exact_sources(eqn: Any) -> tuple[Union[str, None], Union[str, None]]:
  """The argument leaves whose values ``eqn``'s operands hold (see :attr:`Matmul.exact`), or ``None``s.

  Only for a matmul at the top level of the traced function: autocast may
  trace a higher-order equation's body on its own (a nested jit, cached),
  where a value taken outside it would be a constant of another trace.
  """
  m = _top_level(eqn)
  return (None, None) if m is None else m.exact


def _top_level(eqn: Any) -> Union[Matmul, None]:
  """``eqn``'s :class:`Matmul` in the active plan, if it is at the top level (see :func:`exact_sources`)."""
  p = _ACTIVE.get()
  return None if p is None or _SITE.get() else p.matmuls.get((id(eqn),))


def lookup_source(eqn: Any) -> Union[str, None]:
  """The argument path of the table a row lookup ``eqn`` reads, if its cotangent may run in FP8."""
  p = _ACTIVE.get()
  if p is None or p.which is not None:
    return None
  return p.lookups.get(_SITE.get() + (id(eqn),))


def exact_rows(eqn: Any) -> tuple[Union[tuple[int, ...], None], Union[tuple[int, ...], None]]:
  """Where :func:`exact_sources` names a leaf in its own layout, the operand's contracting axes."""
  m = _top_level(eqn)
  return (None, None) if m is None else m.rows


def row_needs(p: Union[Plan, None]) -> list[tuple[str, tuple[int, ...]]]:
  """``(path, axes)`` of every top-level matmul operand that holds a leaf in its layout (rowwise amaxes)."""
  if p is None:
    return []
  return list(dict.fromkeys((path, axes) for site, m in p.matmuls.items() if len(site) == 1
                            for path, axes in zip(m.exact, m.rows)
                            if path is not None and axes is not None))


def run_time_choice(eqn: Any) -> Union[tuple[Any, int], None]:
  """``(which, index)`` when a sensitivity run chooses ``eqn``'s precision at run time."""
  p = _ACTIVE.get()
  m = None if p is None or p.which is None else p.matmuls.get(_SITE.get() + (id(eqn),))
  return None if m is None else (p.which, m.index)  # type: ignore[union-attr]

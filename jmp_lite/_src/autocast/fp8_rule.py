"""Autocast's FP8 rule: half-list matmuls on float8 operands (issue 23).

With ``autocast(fun, dtype, fp8=...)`` the interpreter's config carries a
:class:`jmp_lite.Float8Recipe`; :func:`rule` is registered for ``dot_general`` (see
:mod:`autocast`) and runs each half-list matmul as :func:`fp8_dot.fp8_dot_general`
on the operands the interpreter has already cast to the half dtype, with the
equation's own dimension numbers and precision and the result in the half
dtype (or the ``preferred_element_type`` the user asked for). Without a recipe
it returns ``None`` and the ordinary bind runs.
"""

from __future__ import annotations

from typing import Any, Union

import jax.numpy as jnp

from jmp_lite._src.autocast import interpret as interp
from jmp_lite._src.fp8 import dot as fp8_dot
from jmp_lite._src.fp8 import known as fp8_known
from jmp_lite._src.fp8 import lookup as fp8_lookup
from jmp_lite._src.fp8 import plan as fp8_plan
from jmp_lite._src import jaxpr_utils


def rule(eqn: Any, ins: list[Any], cfg: interp._Config) -> Union[list[Any], None]:
  """``eqn`` (a half-list ``dot_general``) on float8 operands, or ``None`` for the bind.

  The ordinary bind runs when FP8 is off (``cfg.fp8 is None``), when an
  operand is not in the half dtype (an integer operand), or when the
  equation fixes an output sharding (which :func:`fp8_dot.fp8_dot_general` does
  not take).

  Args:
    eqn: the ``dot_general`` equation.
    ins: its operands, cast to ``cfg.dtype`` by the interpreter.
    cfg: the autocast config; ``cfg.fp8`` is a :class:`jmp_lite.Float8Recipe` or
      ``None``.

  Returns:
    ``[product]``, or ``None``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> x = jnp.array([[1.0, 2.0], [3.0, 1000.0]])
    >>> every = jmp.Float8Recipe(min_size=0)  # this 2x2 matmul too
    >>> jmp.autocast(lambda a: a @ a, jnp.bfloat16, fp8=every)(x).tolist()
    [[6.9375, 1952.0], [3072.0, 999424.0]]
  """
  recipe = cfg.fp8
  if recipe is None or eqn.params.get("out_sharding") is not None:
    return None
  if not fp8_plan.decide(eqn, recipe):  # Kept by a rule, too small, or not selected.
    return None
  lhs, rhs = ins
  if interp.value_dtype(lhs) != cfg.dtype or interp.value_dtype(rhs) != cfg.dtype:
    return None
  params = interp.retarget(eqn, cfg.dtype)
  # An operand that holds a weight's values is quantised with the weight's amax,
  # taken before the matmul: under FSDP its float8 cast runs before the gather.
  sources: tuple[Any, Any] = fp8_plan.exact_sources(eqn)
  if recipe.rowwise:  # Per row: the amax over the operand's contracting axes.
    sources = tuple(None if s is None or a is None else (s, a)  # type: ignore[assignment]
                    for s, a in zip(sources, fp8_plan.exact_rows(eqn)))
  out = fp8_dot.fp8_dot_general(
      lhs, rhs, params["dimension_numbers"], recipe=recipe,
      precision=params.get("precision"),
      preferred_element_type=params.get("preferred_element_type"),
      amaxes=(fp8_known.amax_of(sources[0], lhs), fp8_known.amax_of(sources[1], rhs)))
  chosen = fp8_plan.run_time_choice(eqn)
  if chosen is not None:  # fp8_sensitivity: FP8 only if this is the matmul it measures.
    which, index = chosen
    half = jaxpr_utils.bind(eqn, [lhs, rhs], params)[0]
    out = jnp.where(which == index, out, half)
  return [out]


def fp8_lookup_applies(eqn: Any, cfg: interp._Config) -> bool:
  """Whether :func:`lookup_rule` runs ``eqn`` (a ``gather``): see there."""
  if cfg.fp8 is None or len(eqn.invars) != 2:
    return False
  return fp8_known.is_weight(fp8_plan.lookup_source(eqn))


def lookup_rule(eqn: Any, ins: list[Any], cfg: interp._Config) -> list[Any]:
  """A row lookup of a params table (an embedding) whose cotangent runs in FP8.

  Under an FP8 recipe, for a ``gather`` (in its traced dtype: a row lookup
  is exact in any) that the plan lists (:attr:`fp8_plan.Plan.lookups`: an
  argument leaf's values, kept by no rule, not below ``min_size``) where the
  leaf is one of a train step's params (:func:`fp8_known.is_weight`): see
  :mod:`jmp_lite._src.fp8.lookup`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def loss(p, tokens):
    ...   return (jnp.take(p["embed"], tokens, axis=0) * jnp.array([1.0, 0.3])).sum()
    >>> from jmp_lite._src.autocast import autocast as ac
    >>> f = ac.step_autocast(loss, jnp.bfloat16, jmp.Float8Recipe(min_size=0))
    >>> g = jax.grad(f)({"embed": jnp.ones((3, 2))}, jnp.array([2, 0, 2]))
    >>> g["embed"].tolist()  # 0.3 / s = 17203 rounds to e5m2's 16384 (s = 1 / 57344)
    [[1.0, 0.2857142984867096], [0.0, 0.0], [2.0, 0.5714285969734192]]
  """
  table, indices = ins

  def gather(t: Any, i: Any) -> Any:
    return jaxpr_utils.bind(eqn, [t, i], eqn.params)[0]

  return [fp8_lookup.fp8_lookup(table, indices, gather, cfg.fp8)]

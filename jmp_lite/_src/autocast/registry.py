"""Autocast's registries: the handlers of higher-order primitives and the per-op half rules.

The interpreter (:mod:`jmp_lite._src.autocast.interpret`) dispatches to them
without importing the modules that define them (``control``, ``fp8_rule``);
:mod:`jmp_lite._src.autocast.autocast` registers those at import.
"""

from __future__ import annotations

from typing import Any, Callable, Union

from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src.autocast.values import bind_original

Handler = Callable[..., Any]
# cfg is the interpreter's _Config (the half dtype, the lists, the FP8 recipe).
Guarded = Callable[[Any, list[Any], Any, list[Any]], tuple[list[Any], list[Any]]]
HalfRule = Callable[[Any, list[Any], Any], Union[list[Any], None]]

# Higher-order primitive name -> its handler, given the inputs as values and their metas.
HANDLERS: dict[str, Guarded] = {}
# Half-list primitive name -> its rule (see register_half_rule).
HALF_RULES: dict[str, HalfRule] = {}
# Primitive name -> (whether its rule applies, the rule), run before the lists (register_op_rule).
OpRule = Callable[[Any, list[Any], Any], list[Any]]
OP_RULES: dict[str, tuple[Callable[[Any, Any], bool], OpRule]] = {}

_NOT_OWN_MSG = ("a handler for {name!r} needs the name in autocast_lists.OWN_RULES, "
                "so that no AutocastLists list holds it")


def register_handler(name: str, fn: Handler, params: tuple[str, ...], metas: bool = False) -> None:
  """Makes ``fn`` autocast's rule for the higher-order primitive ``name``.

  ``fn(eqn, ins, cfg)`` returns the outputs. With ``metas``, it is called as
  ``fn(eqn, ins, cfg, in_metas)`` and returns ``(outs, out_metas)``: what
  autocast knows of its inputs and outputs (:class:`autocast_promote.Meta`,
  ``None`` for "only the dtype"). ``params`` are the equation params ``fn``
  reads: an equation that lacks one (a JAX release that renamed it) runs as
  traced instead of failing.

  Raises:
    ValueError: if ``name`` is not in :data:`autocast_lists.OWN_RULES`.
  """
  if name not in autocast_lists.OWN_RULES:
    raise ValueError(_NOT_OWN_MSG.format(name=name))

  def guarded(eqn: Any, ins: list[Any], cfg: Any, in_metas: list[Any]) -> Any:
    if not all(k in eqn.params for k in params):
      outs = bind_original(eqn, ins)
    elif metas:
      return fn(eqn, ins, cfg, in_metas)
    else:
      outs = fn(eqn, ins, cfg)
    return outs, [None] * len(outs)

  HANDLERS[name] = guarded


def register_half_rule(name: str, rule: HalfRule) -> None:
  """Runs ``rule(eqn, ins, cfg)`` for each half-list primitive ``name``.

  The interpreter calls it where the primitive would be bound, after casting
  its floating inputs ``ins`` to ``cfg.dtype``; it returns the outputs, or
  ``None`` for the ordinary bind. It is not called where the primitive runs
  in another list or as traced (float64 operands, ``lists`` moved it).
  Nested jits are interpreted once per config and cached: register rules at
  import, before autocast runs. A name has one rule: registering replaces
  the previous one (autocast registers its FP8 rule for ``dot_general``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> seen, previous = [], HALF_RULES.get("dot_general")
    >>> def note(eqn, ins, cfg):
    ...   seen.append((eqn.primitive.name, str(ins[0].dtype)))
    ...   return None  # the ordinary bind
    >>> register_half_rule("dot_general", note)
    >>> out = jmp.autocast(lambda a: a @ a, jnp.bfloat16)(jnp.ones((2, 2)))
    >>> seen, str(out.dtype)
    ([('dot_general', 'bfloat16')], 'bfloat16')
    >>> register_half_rule("dot_general", previous)  # autocast's FP8 rule back
  """
  HALF_RULES[name] = rule


def register_op_rule(name: str, applies: Callable[[Any, Any], bool], rule: OpRule) -> None:
  """Runs ``rule(eqn, ins, cfg)`` for each ``name`` equation where ``applies(eqn, cfg)``, before the lists.

  ``applies`` reads only the equation and the config; where it is false the
  lists decide as usual. ``rule`` gets the operands as traced (not cast) and
  returns the outputs, which autocast then treats as values of their own
  dtypes. Autocast registers one for ``gather``: an embedding lookup whose
  cotangent runs in FP8 (issue 44).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> seen, previous = [], OP_RULES.get("gather")
    >>> def note(eqn, ins, cfg):
    ...   seen.append(str(ins[0].dtype))
    ...   return [ins[0][:1] * 2]
    >>> register_op_rule("gather", lambda eqn, cfg: True, note)
    >>> out = jmp.autocast(lambda t: jnp.take(t, jnp.array([1]), axis=0), jnp.bfloat16)(jnp.ones((2, 2)))
    >>> seen, out.tolist()
    (['float32'], [[2.0, 2.0]])
    >>> register_op_rule("gather", *previous)  # autocast's rule back
  """
  OP_RULES[name] = (applies, rule)

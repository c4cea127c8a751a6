"""Why a value of a jaxpr is float32: where each wide value comes from.

Under a half policy, a matmul that runs in float32 has a cause upstream: one
of its operands is float32 although the params and the batch were cast. The
cause decides the fix, so :func:`precision_lint` names it. :class:`Origins`
follows data flow through a jaxpr in program order (sub-jaxprs are walked with the
labels of their inputs, and give back their outputs')
and labels every float32 (or wider) value with the causes that made it wide:

==========  ================================================================
label       the value is wide because of
==========  ================================================================
``carry``   a ``scan``/``while`` carry whose initial value was made in
            float32 inside the function (Flax's ``initialize_carry``,
            ``jnp.zeros((hidden,))``)
``random``  a random draw made in float32 inside the function
``made``    another float32 value made inside the function
            (``jnp.zeros``/``ones``/``arange``, a one-hot, a constant)
``state``   a model-state leaf (running statistics, never cast)
``param``   a param leaf that a keep rule kept in float32
``batch``   a batch leaf passed in float32 (``batch_keep_full``,
            ``cast_batch=False``)
``upcast``  a half value converted to float32 (``x.astype(jnp.float32)``,
            a layer built with ``dtype=jnp.float32``)
==========  ================================================================

Where a float32 value meets a half one, ``jax.numpy`` converts the half
operand: that convert is the promotion's doing, not a cause, so a converted
operand (and its reshapes) adds its ``upcast`` label only when every wide
operand of the op is such a convert. A convert the program writes
(``x.astype(jnp.float32)``, a layer's cast to its ``dtype``:
:func:`jaxpr_utils.written_convert`) is the cause beside a value made in the
function: a layer pinned to float32 casts its operands whatever made its
input float32 (a position table), so fixing the table alone would change
nothing. Beside a carry, a draw or a kept leaf it is not: a layer built with
``dtype=None`` writes the same convert to follow its float32 input.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from jax.extend import core as jex_core

from jmp_lite._src import jaxpr_utils

Labels = frozenset[str]
NONE: Labels = frozenset()
MADE: Labels = frozenset({"made"})
CARRY: Labels = frozenset({"carry"})
UPCAST: Labels = frozenset({"upcast"})
RANDOM: Labels = frozenset({"random"})
# The order causes are named in: the most specific first.
ORDER = ("carry", "random", "made", "state", "param", "batch", "upcast")
_RANDOM_PRIMITIVES = frozenset({"random_bits", "random_seed", "random_split", "random_fold_in",
                                "random_wrap", "random_unwrap", "threefry2x32"})
# Ops through which a convert's output stays "a converted operand".
_RESHAPES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                       "copy", "copy_p", "convert_element_type"})
_NARROW_ITEMSIZE = 2  # float16, bfloat16 and float8 values carry no label.


def _tracked(v: Any) -> bool:
  """Wide floats, integers and keys carry labels; half, float8 and bool values do not.

  A bool (a comparison's result, Dropout's mask) selects data but carries no
  precision: the float32 uniform behind a mask does not make the masked
  values float32.
  """
  dtype = getattr(getattr(v, "aval", None), "dtype", None)
  if dtype is None:
    return False
  plain = jaxpr_utils.dtype_of(v)
  if plain is None:  # A PRNG key.
    return True
  if plain == np.bool_:
    return False
  return not jaxpr_utils.is_floating(plain) or plain.itemsize > _NARROW_ITEMSIZE


def _data(eqn: Any) -> list[Any]:
  """The operands whose precision ``eqn``'s floating outputs carry: its floating ones.

  An integer operand of an op with floating operands (a gather's or a
  dynamic slice's indices) moves data without carrying precision; with no
  floating operand (random bits made into a uniform, a convert), the others.
  """
  if not any(jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v)) for v in eqn.outvars):
    return list(eqn.invars)
  floats = [v for v in eqn.invars if jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v))]
  return floats or list(eqn.invars)


def _wide_float(v: Any) -> bool:
  dtype = jaxpr_utils.dtype_of(v)
  return jaxpr_utils.is_floating(dtype) and dtype.itemsize > _NARROW_ITEMSIZE  # type: ignore[union-attr]


def _union(labels: Iterable[Labels]) -> Labels:
  return functools.reduce(operator.or_, labels, NONE)


def _open(jaxpr: Any) -> Any:
  return getattr(jaxpr, "jaxpr", jaxpr)


class Origins:
  """The labels of the values of one jaxpr, filled in program order.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> def f(w, x):  # w, x: float16
    ...   h = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), jnp.zeros(4), None, 3)[0]
    ...   return x.astype(jnp.float32) @ w.astype(jnp.float32), h
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4), jnp.float16), jnp.ones(4, jnp.float16)).jaxpr
    >>> [sorted(labels) for labels in output_labels(jaxpr, [NONE, NONE])]
    [['upcast'], ['carry']]
  """

  def __init__(self, jaxpr: Any, inputs: Sequence[Labels]) -> None:
    self._labels: dict[Any, Labels] = {}
    self._casts: set[Any] = set()  # Half values converted by promotion (and their reshapes).
    self._written: set[Any] = set()  # Half values converted as written (and their reshapes).
    for v in jaxpr.constvars:
      self._labels[v] = MADE if _wide_float(v) else NONE
    for v, labels in zip(jaxpr.invars, inputs):
      self._labels[v] = labels if _tracked(v) else NONE

  def of(self, v: Any) -> Labels:
    """The labels of ``v``; a literal has none (a weak scalar never widens)."""
    return self._labels.get(v, NONE) if isinstance(v, jex_core.Var) else NONE

  def cause(self, operands: Sequence[Any]) -> Labels:
    """Why an op on ``operands`` is wide: their labels, promotion converts set aside."""
    wide = [v for v in operands if isinstance(v, jex_core.Var) and _tracked(v)]
    own = [v for v in wide if v not in self._casts and v not in self._written and self.of(v)]
    if any(v in self._written for v in wide) and _union(self.of(v) for v in own) <= MADE:
      return UPCAST  # A layer's cast (or an astype) beside a table made in the function.
    labels = [self.of(v) for v in (own or wide)]
    # A constant made beside a value wide for another reason (Dropout's
    # zeros_like of a float32 input) takes its dtype from it: not a cause.
    return _union([l for l in labels if l != MADE] or labels)

  def step(self, eqn: Any, walk: Callable[[Any, list[Labels]], list[Labels]]) -> None:
    """Labels the outputs of ``eqn``, the next equation in program order.

    ``walk(sub, input_labels)`` labels a sub-jaxpr of ``eqn`` and returns its
    output labels (:func:`output_labels`, or a caller's walk that does more).
    """
    subs = list(jaxpr_utils.subjaxprs(eqn))
    if subs:
      self._set_outputs(eqn, [walk(sub, self._sub_inputs(eqn, sub)) for sub in subs])
    else:
      self._apply(eqn)

  def _apply(self, eqn: Any) -> None:
    """Labels the outputs of ``eqn``, a primitive without sub-jaxprs."""
    name = eqn.primitive.name
    if name in _RANDOM_PRIMITIVES:
      self._set(eqn.outvars, [RANDOM] * len(eqn.outvars))
      return
    labels = self.cause(_data(eqn))
    from_half = any(isinstance(v, jex_core.Var) and not _tracked(v) and
                    jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v)) for v in eqn.invars)
    fresh = UPCAST if from_half else MADE
    self._set(eqn.outvars, [labels or (fresh if _wide_float(v) else NONE) for v in eqn.outvars])
    if name in _RESHAPES and len(eqn.outvars) == 1 and _wide_float(eqn.outvars[0]):
      source, out = eqn.invars[0], eqn.outvars[0]
      if from_half:
        (self._written if jaxpr_utils.written_convert(eqn) else self._casts).add(out)
      elif isinstance(source, jex_core.Var) and source in self._casts:
        self._casts.add(out)
      elif isinstance(source, jex_core.Var) and source in self._written:
        self._written.add(out)

  def _sub_inputs(self, eqn: Any, sub: Any) -> list[Labels]:
    """The labels of ``sub``'s inputs, ``sub`` being one of ``eqn``'s jaxprs.

    A ``scan``/``while`` carry whose initial value was made in the function
    (a literal, ``jnp.zeros``, a random draw) is labelled ``carry``.
    """
    operands, carries = self._operands(eqn, sub)
    labels = [self._operand(v) for v in operands]
    for i in carries:
      if labels[i] & (MADE | RANDOM):
        labels[i] = CARRY
    return labels[-len(sub.invars):] if sub.invars else []

  def _set_outputs(self, eqn: Any, outputs: Sequence[Sequence[Labels]]) -> None:
    """Labels ``eqn``'s outputs from its sub-jaxprs' (those with as many outputs)."""
    n = len(eqn.outvars)
    matching = [out for out in outputs if len(out) == n]
    if not matching:
      self._apply(eqn)
      return
    fallback = self.cause(eqn.invars) or MADE
    labels = [_union(out[i] for out in matching) for i in range(n)]
    self._set(eqn.outvars, [l or (fallback if _wide_float(v) else NONE)
                            for l, v in zip(labels, eqn.outvars)])

  def outputs(self, jaxpr: Any) -> list[Labels]:
    """The labels of ``jaxpr``'s outputs."""
    return [self._operand(v) for v in jaxpr.outvars]

  def _operand(self, v: Any) -> Labels:
    if isinstance(v, jex_core.Var):
      return self.of(v)
    return MADE if _wide_float(v) else NONE  # A float32 literal passed to a sub-jaxpr.

  def _set(self, outvars: Sequence[Any], labels: Sequence[Labels]) -> None:
    for v, l in zip(outvars, labels):
      self._labels[v] = l if _tracked(v) else NONE

  @staticmethod
  def _operands(eqn: Any, sub: Any) -> tuple[list[Any], range]:
    """``eqn``'s operands that end in ``sub``'s inputs, and the carries among them."""
    params, invars = eqn.params, list(eqn.invars)
    if eqn.primitive.name == "scan" and _open(params["jaxpr"]) is sub:
      first = params["num_consts"]
      return invars, range(first, first + params["num_carry"])
    if eqn.primitive.name == "while":
      first = params["cond_nconsts"] + params["body_nconsts"]
      carries = invars[first:]
      if _open(params["cond_jaxpr"]) is sub:
        consts = invars[:params["cond_nconsts"]]
      else:
        consts = invars[params["cond_nconsts"]:first]
      return consts + carries, range(len(consts), len(consts) + len(carries))
    return invars, range(0)


def output_labels(jaxpr: Any, inputs: Sequence[Labels]) -> list[Labels]:
  """The labels of ``jaxpr``'s outputs, given its inputs' (sub-jaxprs followed)."""
  origins = Origins(jaxpr, inputs)
  for eqn in jaxpr.eqns:
    origins.step(eqn, output_labels)
  return origins.outputs(jaxpr)


def input_labels(jaxpr: Any, roles: Sequence[str]) -> list[Labels]:
  """The labels of ``jaxpr``'s inputs: its role (``"param"``, ...) for a wide float one."""
  return [frozenset({role}) if _wide_float(v) else NONE for v, role in zip(jaxpr.invars, roles)]


def ordered(labels: Labels) -> list[str]:
  """``labels`` in :data:`ORDER`."""
  return [l for l in ORDER if l in labels]

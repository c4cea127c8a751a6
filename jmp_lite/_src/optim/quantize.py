"""``quantize_state``: any optax transformation's per-parameter state in 8 or 4 bits.

The wrapper stores the moments of the inner state (Adam's ``mu`` and ``nu``,
lion's ``mu``, a momentum ``trace``, a ``MultiSteps`` accumulator) as
:class:`QuantizedArray` codes with one
scale per block of ``block_size`` elements (codes in
:mod:`jmp_lite._src.optim.codes`, and :mod:`jmp_lite._src.optim.codes4` for
``"int4"``, two codes a byte). Each update runs in float32 inside the
caller's jit::

  state  = decode(codes, scales)              # float32, the inner's own dtypes
  updates, state = inner.update(grads, state, params)
  codes, scales  = encode(state)              # the same leaves, the same codes

What each leaf is (a moment, a copy of the parameters, a count) is read
from the inner ``init`` program (:mod:`jmp_lite._src.optim.classify`), never
from field names. Moments with fewer than ``min_size`` elements or selected
by a ``keep`` or ``keep_state`` rule, and every leaf that is not a moment,
stay as the inner made them.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree_utils
from jmp_lite._src.optim import classify
from jmp_lite._src.optim import codes as codes_lib
from jmp_lite._src.optim import coded
from jmp_lite._src.optim.coded import QuantizedArray
from jmp_lite._src.optim import passes
from jmp_lite._src.optim import position

try:  # optax.tree_map_params's stand-in for the params: no public name; degrade to none.
  from optax.tree_utils._state_utils import _ParamsPlaceholder
except ImportError:  # pragma: no cover - depends on the optax release.
  _ParamsPlaceholder = None  # type: ignore[assignment,misc]  # The fallback: no class.

_FORMAT_MSG = "format must be one of {allowed}, got {value!r}"
# A block shares one float32 scale: blocks past 2**16 save nothing (the scales are then
# 0.006% of the codes) and pad a small leaf to a whole block.
MAX_BLOCK_SIZE = 2**16
_BLOCK_MSG = ("block_size must be a power of two >= 32 and <= 65536 (2**16; e.g. 256), "
              "got {value!r}")
_TX_MSG = ("tx must be an optax GradientTransformation (an object with init and update, "
           "such as optax.adamw(1e-3)), got {value!r}")


class QuantizedState(NamedTuple):
  """The state of :func:`quantize_state`: the inner state, some leaves as :class:`QuantizedArray`.

  Attributes:
    inner: the inner transformation's state, with each coded leaf replaced
      by its :class:`QuantizedArray`.
    step: int32, the updates made: with each coded leaf's number, it seeds
      the stochastic rounding of the codes (:func:`jmp_lite._src.optim.coded.dither`).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> state = jmp.quantize_state(optax.sgd(0.1, momentum=0.9), min_size=0).init(
    ...     {"w": jnp.ones(512)})
    >>> type(state.inner[0].trace["w"]).__name__
    'QuantizedArray'
  """

  inner: optax.OptState
  step: jax.Array


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def _unwrapped(x: Any) -> tuple[Any, Callable[[Any], Any]]:
  """The one array in ``x`` (itself, or in a flax ``Variable``) and how to put one back."""
  leaves, treedef = jax.tree.flatten(x)
  return leaves[0], lambda a: jax.tree.unflatten(treedef, [a])


def _decode(q: QuantizedArray) -> Any:
  codes, wrap = _unwrapped(q.codes)
  return wrap(dataclasses.replace(q, codes=codes, scales=_unwrapped(q.scales)[0]).dequantize())


def dequantize_tree(tree: Any) -> Any:
  """Every :class:`QuantizedArray` in ``tree`` decoded; other leaves as they are."""
  return jax.tree.map(lambda x: _decode(x) if _is_quantized(x) else x, tree,
                      is_leaf=_is_quantized)


def _new_scales(old: Any, new: Any) -> list[jax.Array]:
  """The block scales of ``new``'s leaves where ``old`` holds a :class:`QuantizedArray`."""
  flat_old = jax.tree.leaves(old, is_leaf=_is_quantized)
  return [coded.scales_of(n.astype(o.dtype), o.format, o.block_size)
          for o, n in zip(flat_old, jax.tree.leaves(new)) if _is_quantized(o)]


def _requantize(old: Any, new: Any, count: jax.Array,
                scales: list[jax.Array] | None = None) -> Any:
  """``new``'s leaves coded where ``old`` holds a :class:`QuantizedArray`, with its code.

  The rounding of coded leaf ``i`` (in flattening order) draws from
  ``coded.dither(..., i, count)``; its block scales are ``scales[i]`` when given
  (:func:`_new_scales`).
  """
  flat_old, treedef = jax.tree.flatten(old, is_leaf=_is_quantized)
  flat_new = jax.tree.leaves(new)  # the inner update keeps the state's structure
  out, number = [], 0
  for o, n in zip(flat_old, flat_new):
    if _is_quantized(o):
      q = coded.quantize(n.astype(o.dtype), o.format, o.block_size, number, count,
                         o.never_zero, None if scales is None else scales[number],
                         _unwrapped(o.scales)[0].dtype)
      wrap = _unwrapped(o.codes)[1]  # codes and scales in flax Variables where they were
      n = dataclasses.replace(q, codes=wrap(q.codes), scales=wrap(q.scales))
      number += 1
    out.append(n)
  return jax.tree.unflatten(treedef, out)


def _is_variable(x: Any) -> bool:
  """Whether ``x`` is a flax NNX ``Variable`` (without importing flax)."""
  variable = getattr(sys.modules.get("flax.nnx"), "Variable", None)
  return variable is not None and isinstance(x, variable)


def _codes_in_variables(tree: Any) -> Any:
  """``Variable(QuantizedArray)`` turned into a ``QuantizedArray`` of ``Variable`` codes and scales.

  ``nnx.Optimizer`` wraps each leaf (or ``Variable``) of the state in its own
  ``OptState`` variable and writes the new state back leaf by leaf: codes
  and scales must be leaves of their own there, not halves of one variable.
  """
  def swap(v: Any) -> Any:
    inner, treedef = jax.tree.flatten(v, is_leaf=_is_quantized)
    if len(inner) != 1 or not _is_quantized(inner[0]):
      return v
    q = inner[0]
    return dataclasses.replace(q, codes=jax.tree.unflatten(treedef, [q.codes]),
                               scales=jax.tree.unflatten(treedef, [q.scales]))

  return jax.tree.map(lambda x: swap(x) if _is_variable(x) else x, tree, is_leaf=_is_variable)


def _check_tx(tx: Any) -> None:
  if (isinstance(tx, type) or not callable(getattr(tx, "init", None))
      or not callable(getattr(tx, "update", None))):
    raise TypeError(_TX_MSG.format(value=checks.short_repr(tx)))


def _check_format(fmt: Any) -> str:
  if not isinstance(fmt, str):
    raise TypeError(_FORMAT_MSG.format(allowed=codes_lib.FORMATS, value=fmt))
  if fmt not in codes_lib.FORMATS:
    raise ValueError(_FORMAT_MSG.format(allowed=codes_lib.FORMATS, value=fmt))
  return fmt


def _layout(fmt: str, block_size: int | None, divides: bool) -> tuple[int, Any]:
  """A coded leaf's block and scale dtype: ``block_size`` and float32 if given; else the
  format's default with float32, except ``"int4"``'s momenta (a leaf the update does not
  divide by): blocks of ``codes.INT4_MOMENT_BLOCK`` with bfloat16 scales."""
  if block_size is not None:
    return block_size, jnp.float32
  if fmt == "int4" and not divides:
    return codes_lib.INT4_MOMENT_BLOCK, jnp.bfloat16
  return codes_lib.DEFAULT_BLOCK_SIZE[fmt], jnp.float32


def _formats(fmt: str, coded: list[bool], flat: list[Any], tx: Any, params: Any) -> list[str]:
  """Each state leaf's format: ``fmt``, but ``"int8"`` for an ``"int4"`` leaf that sets a position.

  A leaf whose rounding would move the params by a share of the distance
  they have travelled (madgrad's ``s``, cocob's sums:
  :func:`position.position_leaves`) is coded in 8 bits, with a
  ``UserWarning`` that names it.
  """
  formats = [fmt] * len(flat)
  if fmt != "int4" or not any(coded):
    return formats
  found = position.position_leaves(tx.init, tx.update, params, len(flat))
  moved = [i for i, c in enumerate(coded) if c and found is not None and found[i]]
  if moved:
    names = ", ".join(tree_utils.path_str(flat[i][0]) for i in moved)
    warnings.warn(
        f"quantize_state codes {len(moved)} leaves of this transformation's state in 'int8', "
        f"not 'int4': {names}. Its update sets the params' position from them (a relative "
        f"rounding error in one moves the params by {position.POSITION_GAIN:g}x or more of a "
        "step, measured on the update: dual averaging, parameter-free methods such as madgrad "
        "and cocob), and in 4 bits such methods ended at 6-9x float32's loss. The other "
        "leaves are coded in 'int4'. Pass format='int8' to code all of them in 8 bits, or "
        "keep_state to keep these in full precision.", UserWarning, stacklevel=3)
    for i in moved:
      formats[i] = "int8"
  return formats


def _check_block_size(block_size: Any) -> int:
  try:
    n = checks.integer("block_size", block_size, minimum=32, maximum=MAX_BLOCK_SIZE)
  except (TypeError, ValueError) as e:
    raise type(e)(_BLOCK_MSG.format(value=block_size)) from e
  if n & (n - 1):
    raise ValueError(_BLOCK_MSG.format(value=block_size))
  return n


def quantize_state(
    tx: optax.GradientTransformation,
    format: str = "int8",  # pylint: disable=redefined-builtin
    *,
    block_size: int | None = None,
    min_size: int = 4096,
    keep: policy_lib.KeepRule | Iterable[policy_lib.KeepRule] = (),
    keep_state: policy_lib.KeepRule | Iterable[policy_lib.KeepRule] = (),
) -> optax.GradientTransformationExtraArgs:
  """Stores ``tx``'s per-parameter state in 8 or 4 bits, one scale per block.

  The update decodes the state to float32, runs ``tx.update`` and codes the
  new state, all inside the caller's jit, where XLA fuses the arithmetic
  codes into the update::

    state   = decode(codes, scales)          # per leaf, float32
    updates, state = tx.update(grads, state, params)
    codes, scales  = encode(state)           # max |x| per block of block_size

  Traced (under ``jit``), it runs in passes (one for the scales, one for
  the updates, one for the codes), so that
  XLA keeps no float32 copy of the new state: on an H100 the update's temp
  is under optax's own AdamW update's (``benchmarks.optim_state``). The inner
  update is then traced three times, so a print or callback in it
  runs that many times. Run eagerly, or on a state of under 2**16 coded
  elements (whose float32 copy is at most 256 KiB), it runs once.

  Each block is coded by its values at every update: a block with a
  negative value as ``"int8"`` (companded, ``t |t|`` with ``t = q / 127``,
  of ``x / a``, ``a`` the block's largest ``|x|``) or ``"float8"`` (e3m4 of
  ``15.5 x / a``: 4 mantissa bits, down to 1e-3 of ``a``); a non-negative
  block (a second moment, in either format) as a uint8 code of
  ``sqrt(x / a)``, linear at the top of the block and read as float32 bits
  below, down to 0.008 of the block's largest ``sqrt(v)`` (smaller values
  of a divisor such as ``v`` round up to it). The mode is the sign of the block's scale. Rounding
  is stochastic and unbiased, so moving averages keep following their
  input (see :mod:`jmp_lite._src.optim.codes`). ``"int4"`` codes both kinds
  of block in 4 bits, two codes a byte (:mod:`jmp_lite._src.optim.codes4`):
  a signed block as a sign and ``0, 1/16, 1/8, 1/4, 3/8, 1/2, 3/4, 1`` of
  ``a``, a non-negative one as ``2**-8 .. 1`` of ``a`` (never 0 for a
  non-zero value of a leaf the update divides by).

  Args:
    tx: the optax transformation whose state is stored (adam, adamw, lion,
      sgd with momentum, an ``optax.chain`` of them...). Its ``init`` is
      traced once with the parameters as inputs: a floating leaf shaped like
      a parameter whose value does not depend on the parameters' values (a
      moment) is coded; a leaf that does (schedule_free's ``z``, prodigy's
      ``params0``: a copy of the parameters) never is; an ``init`` that
      cannot be traced is refused. A ``UserWarning`` says so when nothing is
      coded.
    format: ``"int8"``, ``"float8"`` or ``"int4"``. With ``"int4"``, a
      leaf that sets the params' position rather than a step's size (the
      update's relative change for a relative change of the leaf is 2x or
      more, measured on small stand-in params: madgrad's ``s``, cocob's
      sums) is coded in ``"int8"``, with a ``UserWarning`` naming it
      (:mod:`jmp_lite._src.optim.position`).
    block_size: elements per block of every coded leaf, a power of two from
      32 to 2**16, with float32 scales. By default (``None``) 256 for the
      8-bit formats; ``"int4"`` codes a leaf the update divides by (Adam's
      ``nu``; read from the update's jaxpr) in blocks of 256 with float32
      scales and the others (Adam's ``mu``, any momentum) in blocks of 32
      with bfloat16 scales rounded up: 3.08 bytes per parameter with bf16
      masters, against 3.06 for blocks of 128 for both (torchao
      ``AdamW4bit``'s layout), and less drift from float32 AdamW
      (``docs/optimizer_state.md``). Blocks run along a leaf's last axis
      when it is a multiple of the block, else over the flattened leaf.
    min_size: leaves with fewer elements stay as ``tx`` made them.
    keep: rules for parameters whose state stays as ``tx`` made it: a regex
      (``re.search`` on the ``/``-joined parameter path, as
      :class:`Float8Recipe`'s ``keep``) or a callable ``(path: str, leaf) ->
      bool``, or several. A rule applies to the moments of the same shape
      whose state path ends like the parameter's path. Embeddings are the
      usual case.
    keep_state: rules of the same form on the ``/``-joined path of the inner
      *state* leaf (``"acc_grads"`` keeps a ``MultiSteps`` accumulator in
      float32): for what the state cannot show.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`QuantizedState`. ``optax.tree_map_params`` maps its function
    over every array of the state's parameter-shaped parts, so over a
    coded moment's uint8 codes and scales: a function of the array
    alone (``jax.device_put``, reading ``x.sharding``, the identity) works;
    one of the parameter's value (``p * 2``) would compute on codes, and
    with extra parameter trees (a tree of specs) JAX raises its structure
    error.

  Raises:
    TypeError: if ``tx`` is not a transformation, ``format`` not a string,
      ``block_size`` or ``min_size`` not an int, a keep rule neither a
      string nor a callable of two arguments; at ``init``, if ``tx.init``
      cannot be traced.
    ValueError: for an unknown ``format``, a ``block_size`` that is not a
      power of two in [32, 2**16], a negative ``min_size`` or a keep regex
      that does not compile.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> tx = jmp.quantize_state(optax.adamw(1e-3), "int8", min_size=256)
    >>> params = {"w": jnp.ones((4, 256)), "b": jnp.zeros(4)}
    >>> state = tx.init(params)
    >>> adam = state.inner[0]
    >>> adam.mu["w"].codes.dtype, adam.nu["w"].codes.dtype, adam.mu["b"].dtype
    (dtype('uint8'), dtype('uint8'), dtype('float32'))
    >>> updates, state = tx.update({"w": jnp.ones((4, 256)), "b": jnp.ones(4)}, state, params)
    >>> round(float(updates["w"][0, 0]), 5)
    -0.001
  """
  _check_tx(tx)
  fmt = _check_format(format)
  block_size = None if block_size is None else _check_block_size(block_size)
  min_size = checks.integer("min_size", min_size, minimum=0)
  rules = tuple(policy_lib.compile_rule(r) for r in policy_lib.keep_rules(keep))
  keep_state = policy_lib.keep_rules(keep_state)
  state_rules = tuple(policy_lib.compile_rule(r) for r in keep_state)
  inner_tx = optax.with_extra_args_support(tx)

  def init(params: optax.Params) -> QuantizedState:
    if _ParamsPlaceholder is not None and isinstance(params, _ParamsPlaceholder):
      # optax.tree_map_params: where the inner state holds a parameter tree, it maps f
      # over ours, whose coded moments are QuantizedArrays (f sees codes and scales).
      return QuantizedState(inner_tx.init(params), jnp.zeros((), jnp.int32))
    state = inner_tx.init(params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    program = classify.update_program(inner_tx.update, state, params)  # traced once, read twice
    kinds = classify.refine(
        classify.kinds(inner_tx.init, params, len(flat), "the inner transformation"),
        None if program is None else classify.averages(program))
    # A leaf the update divides by never codes 0; an update that cannot be traced: none may.
    divides = [True] * len(flat) if program is None else classify.divisors(program)
    if keep_state:
      policy_lib.warn_unmatched(keep_state, [(tree_utils.path_str(p), x) for p, x in flat
                                             if tree_utils.is_floating_array(x)],
                                "quantize_state's keep_state", "floating leaf of the inner state",
                                "nothing in full precision", "floating state leaves")
    coded = classify.plan(state, kinds, params, min_size, rules, state_rules)
    formats = _formats(fmt, coded, flat, inner_tx, params)
    count = jnp.zeros((), jnp.int32)
    layouts = [_layout(f, block_size, d) for f, d in zip(formats, divides)]
    marked = [  # Placeholders, which _requantize codes in its order (scales: their dtype).
        QuantizedArray(x, jnp.zeros((), dtype), tuple(x.shape), np.dtype(x.dtype), f, block,
                       d) if c else x
        for (_, x), c, d, f, (block, dtype) in zip(flat, coded, divides, formats, layouts)]
    inner = _requantize(jax.tree.unflatten(treedef, marked), state, count)
    return QuantizedState(_codes_in_variables(inner), count)

  def update(updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None,
             **extra_args: Any) -> tuple[optax.Updates, QuantizedState]:
    if not isinstance(state, QuantizedState):
      raise TypeError(f"quantize_state's update needs the QuantizedState its init made, got "
                      f"{checks.type_name(state)}")
    def run(old: Any, updates: Any, params: Any, extra_args: Any) -> Any:
      return inner_tx.update(updates, dequantize_tree(old), params, **extra_args)

    old = state.inner
    elements = sum(int(np.prod(q.shape)) for q in jax.tree.leaves(old, is_leaf=_is_quantized)
                   if _is_quantized(q))
    if not passes.worth_it(elements, (updates, old)):
      updates, inner = run(old, updates, params, extra_args)
      return updates, QuantizedState(_requantize(old, inner, state.step), state.step + 1)
    # In passes, so that XLA keeps no float32 copy of the new state (passes.py).
    updates, inner, scales = passes.run_in_passes(
        run, old, updates, params, extra_args, lambda new: _new_scales(old, new))
    return updates, QuantizedState(_requantize(old, inner, state.step, scales), state.step + 1)

  return optax.GradientTransformationExtraArgs(init, update)

"""``quantize_state``: any optax transformation's per-parameter state in 8 or 4 bits.

The wrapper stores the moments of the inner state (Adam's ``mu`` and ``nu``,
lion's ``mu``, a momentum ``trace``, a ``MultiSteps`` accumulator) as
:class:`QuantizedArray` codes with one
float32 scale per block of ``block_size`` elements (codes in
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
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import checks
from jmp_lite._src import masters
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import tree_utils
from jmp_lite._src.optim import classify
from jmp_lite._src.optim import codes as codes_lib

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


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """One state leaf in 8 or 4 bits: codes, one float32 scale per block, and how to decode them.

  A pytree: ``codes`` and ``scales`` are its children; the rest is static.

  Attributes:
    codes: uint8 codes. The leaf's own shape when its last axis is a
      multiple of ``block_size`` (blocks run along it); otherwise
      ``(blocks, block_size)`` over the flattened, zero-padded leaf. For
      ``"int4"`` two codes share a byte and the last axis is halved: element
      ``j`` of a block in the low nibble of the block's byte ``j``, element
      ``j + block_size / 2`` in its high nibble.
    scales: float32, one per block (``codes.shape[:-1] + (blocks,)`` or
      ``(blocks,)``): the block's largest magnitude, negative for a block
      with a negative value (coded by ``format``'s signed code), positive for
      a block coded with the non-negative code (of the square root).
    shape: the leaf's shape.
    dtype: the leaf's dtype (what decoding returns).
    format: ``"int8"``, ``"float8"`` or ``"int4"``.
    block_size: elements per block.
    never_zero: a non-zero value of a non-negative block never codes 0 (it
      rounds up to the smallest code): set for a leaf the update divides by
      (``classify.divisors``), such as Adam's ``nu``. Otherwise a value under
      the smallest code rounds to it or to 0 without bias, so that a
      decaying momentum reaches 0.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> state = jmp.quantize_state(optax.adam(1e-3), min_size=0).init({"w": jnp.ones((2, 256))})
    >>> nu = state.inner[0].nu["w"]
    >>> nu.codes.dtype, nu.scales.shape, nu.dequantize().shape
    (dtype('uint8'), (2, 1), (2, 256))
    >>> state = jmp.quantize_state(optax.adam(1e-3), "int4", min_size=0).init({"w": jnp.ones((2, 256))})
    >>> mu = state.inner[0].mu["w"]
    >>> mu.codes.shape, mu.scales.shape, mu.dequantize().shape
    ((2, 128), (2, 2), (2, 256))
  """

  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
  format: str = dataclasses.field(metadata=dict(static=True))
  block_size: int = dataclasses.field(metadata=dict(static=True))
  never_zero: bool = dataclasses.field(default=True, metadata=dict(static=True))

  def dequantize(self) -> jax.Array:
    """The leaf in its own dtype and shape."""
    blocks = _blocked_shape(self.shape, self.block_size)
    packed = blocks[:-1] + (blocks[-1] // codes_lib.codes_per_byte(self.format),)
    x = codes_lib.decode(self.codes.reshape(packed), self.scales, self.format)
    if _along_last(self.shape, self.block_size):
      return x.reshape(self.shape).astype(self.dtype)
    return x.reshape(-1)[: int(np.prod(self.shape))].reshape(self.shape).astype(self.dtype)


jax.tree_util.register_dataclass(QuantizedArray)


class QuantizedState(NamedTuple):
  """The state of :func:`quantize_state`: the inner state, some leaves as :class:`QuantizedArray`.

  Attributes:
    inner: the inner transformation's state, with each coded leaf replaced
      by its :class:`QuantizedArray`.
    step: int32, the updates made: with each coded leaf's number, it seeds
      the stochastic rounding of the codes (:func:`dither`).

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


def _along_last(shape: tuple[int, ...], block_size: int) -> bool:
  """Whether blocks run along the last axis (else over the flattened, padded leaf)."""
  return bool(shape) and shape[-1] % block_size == 0


def _blocked_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  if _along_last(shape, block_size):
    return shape[:-1] + (shape[-1] // block_size, block_size)
  size = int(np.prod(shape))
  return (-(-size // block_size), block_size)


def dither(shape: tuple[int, ...], leaf: int, count: jax.Array) -> jax.Array:
  """The ``uint32`` draws of coded leaf number ``leaf`` at update ``count``, one per element.

  Each element's draws are a Weyl sequence: a random phase (the hash of its
  index, seeded by the leaf's number, ``masters.hashed_bits``) plus ``count``
  times 2**32 over the golden ratio. Each draw is uniform over the phases,
  so the rounding is unbiased; along the updates an element's draws are
  spread evenly rather than independently, so a code that rounds up with
  probability ``p`` at each update does so once every ``1 / p`` updates, not
  in random clusters, and a moving average's rounding errors do not add up
  as a random walk.
  """
  phase = masters.hashed_bits(shape, jnp.uint32(leaf) * np.uint32(0x85EBCA6B) + np.uint32(1))
  return phase + jnp.asarray(count).astype(jnp.uint32) * np.uint32(0x9E3779B9)


def quantize(x: jax.Array, fmt: str, block_size: int, leaf: int,
             count: jax.Array, never_zero: bool = True) -> QuantizedArray:
  """``x`` as a :class:`QuantizedArray` (float32 arithmetic, whatever ``x``'s dtype).

  The stochastic rounding draws from :func:`dither` of coded leaf number
  ``leaf`` at update ``count``; ``never_zero`` as :class:`QuantizedArray`'s.
  """
  shape = tuple(x.shape)
  blocks = _blocked_shape(shape, block_size)
  along_last = _along_last(shape, block_size)
  # The codes keep the leaf's shape (its last axis over the codes a byte) when blocked
  # along it, else the blocks' shape.
  per_byte = codes_lib.codes_per_byte(fmt)
  stored = (shape[:-1] + (shape[-1] // per_byte,) if along_last
            else blocks[:-1] + (block_size // per_byte,))
  if _zeros_on_one_device(x):  # init's zero moments, eagerly: what encode gives them
    return QuantizedArray(jnp.zeros(stored, jnp.uint8), jnp.zeros(blocks[:-1], jnp.float32),
                          shape, np.dtype(x.dtype), fmt, block_size, never_zero)
  flat = x.astype(jnp.float32)
  if not along_last:
    flat = jnp.pad(flat.reshape(-1), (0, int(np.prod(blocks)) - flat.size))
  codes, scales = codes_lib.encode(flat.reshape(blocks), fmt, dither(blocks, leaf, count),
                                   never_zero)
  return QuantizedArray(codes.reshape(stored), scales, shape, np.dtype(x.dtype), fmt, block_size,
                        never_zero)


def _zeros_on_one_device(x: jax.Array) -> bool:
  """Whether ``x`` is a concrete array of zeros on one device (a freshly made moment).

  Zeros code to zero codes and zero scales in every format; making those
  directly spares ``init`` an eager dispatch of each op of the encode. Traced
  and sharded arrays take the encode, whose output follows their sharding.
  The test is a reduction on the device, so only a bool leaves it (run
  eagerly also inside an outer trace that closes over ``x``).
  """
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return False
  if len(x.sharding.device_set) != 1:
    return False
  with jax.ensure_compile_time_eval():
    return not bool(jnp.any(x))




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


def _requantize(old: Any, new: Any, count: jax.Array) -> Any:
  """``new``'s leaves coded where ``old`` holds a :class:`QuantizedArray`, with its code.

  The rounding of coded leaf ``i`` (in flattening order) draws from
  ``dither(..., i, count)``.
  """
  flat_old, treedef = jax.tree.flatten(old, is_leaf=_is_quantized)
  flat_new = jax.tree.leaves(new)  # the inner update keeps the state's structure
  out, coded = [], 0
  for o, n in zip(flat_old, flat_new):
    if _is_quantized(o):
      q = quantize(n.astype(o.dtype), o.format, o.block_size, coded, count, o.never_zero)
      wrap = _unwrapped(o.codes)[1]  # codes and scales in flax Variables where they were
      n = dataclasses.replace(q, codes=wrap(q.codes), scales=wrap(q.scales))
      coded += 1
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
  """Stores ``tx``'s per-parameter state in 8 or 4 bits, one float32 scale per block.

  The update decodes the state to float32, runs ``tx.update`` and codes the
  new state, all inside the caller's jit, where XLA fuses the arithmetic
  codes into the update::

    state   = decode(codes, scales)          # per leaf, float32
    updates, state = tx.update(grads, state, params)
    codes, scales  = encode(state)           # max |x| per block of block_size

  Each block is coded by its values at every update: a block with a
  negative value as ``"int8"`` (companded, ``t |t|`` with ``t = q / 127``,
  of ``x / a``, ``a`` the block's largest ``|x|``) or ``"float8"`` (e4m3 of
  ``x * 448 / a``); a non-negative block (a second moment, in either
  format) as a uint8 code of ``sqrt(x / a)``, linear at the top of the block
  and read as float32 bits below, which reaches 1e-8 of the block's largest
  ``sqrt(v)``. The mode is the sign of the block's float32 scale. Rounding
  is stochastic and unbiased, so moving averages keep following their
  input (see :mod:`jmp_lite._src.optim.codes`). ``"int4"`` codes both kinds
  of block in 4 bits, two codes a byte (:mod:`jmp_lite._src.optim.codes4`):
  a signed block as a sign and ``0, 1/16, 1/8, 1/4, 3/8, 1/2, 3/4, 1`` of
  ``a``, a non-negative one as ``2**-8 .. 1`` of ``a`` (never 0 for a
  non-zero value).

  Args:
    tx: the optax transformation whose state is stored (adam, adamw, lion,
      sgd with momentum, an ``optax.chain`` of them...). Its ``init`` is
      traced once with the parameters as inputs: a floating leaf shaped like
      a parameter whose value does not depend on the parameters' values (a
      moment) is coded; a leaf that does (schedule_free's ``z``, prodigy's
      ``params0``: a copy of the parameters) never is; an ``init`` that
      cannot be traced is refused. A ``UserWarning`` says so when nothing is
      coded.
    format: ``"int8"``, ``"float8"`` or ``"int4"``.
    block_size: elements per block, a power of two from 32 to 2**16; by
      default 256 for the 8-bit formats and 128 for ``"int4"`` (whose float32
      scale then costs 1/32 byte per element, the same share of its codes as
      8-bit's). Blocks
      run along a leaf's last axis when it is a multiple of ``block_size``,
      else over the flattened leaf.
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
    coded moment's uint8 codes and float32 scales: a function of the array
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
  block_size = _check_block_size(codes_lib.DEFAULT_BLOCK_SIZE[fmt] if block_size is None
                                 else block_size)
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
    count = jnp.zeros((), jnp.int32)
    marked = [  # Placeholders, which _requantize codes in its order.
        QuantizedArray(x, x, tuple(x.shape), np.dtype(x.dtype), fmt, block_size, d) if c else x
        for (_, x), c, d in zip(flat, coded, divides)]
    inner = _requantize(jax.tree.unflatten(treedef, marked), state, count)
    return QuantizedState(_codes_in_variables(inner), count)

  def update(updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None,
             **extra_args: Any) -> tuple[optax.Updates, QuantizedState]:
    if not isinstance(state, QuantizedState):
      raise TypeError(f"quantize_state's update needs the QuantizedState its init made, got "
                      f"{checks.type_name(state)}")
    inner = dequantize_tree(state.inner)
    updates, inner = inner_tx.update(updates, inner, params, **extra_args)
    return updates, QuantizedState(_requantize(state.inner, inner, state.step), state.step + 1)

  return optax.GradientTransformationExtraArgs(init, update)

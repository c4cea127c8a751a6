"""The train state: step counter, master params, optimizer state, and their checks.

:class:`TrainState` owns its buffers (:meth:`TrainState.create` copies every
leaf once, so a donating step only ever deletes the state's own arrays);
:func:`check_masters` refuses, at trace time, a hand-built state whose masters
do not match its declared ``master_dtype`` and ``rounding``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jmp_lite._src import checks
from jmp_lite._src import filtering
from jmp_lite._src import masters
from jmp_lite._src.fp8 import known as fp8_known
from jmp_lite._src.scaling import transform
from jmp_lite._src import tree_utils


def _own_leaf(x: Any, master_dtype: np.dtype) -> Any:
  """The state's own copy of a params leaf (see :meth:`TrainState.create`)."""
  if isinstance(x, bool):
    return jnp.asarray(x, jnp.bool_)
  if isinstance(x, int):
    return jnp.asarray(x, jnp.int32)
  if isinstance(x, float):
    return jnp.asarray(x, master_dtype)
  if master_dtype == masters.BFLOAT16 and tree_utils.is_floating_array(x):
    return jnp.array(x, dtype=master_dtype, copy=True)
  if tree_utils.is_floating_array(x) and jnp.finfo(x.dtype).bits < 32:
    return jnp.asarray(x, jnp.float32)
  # A fresh, strongly typed buffer: donation only ever consumes the state's own.
  if isinstance(x, jax.Array):
    return _copy_array(x)
  if isinstance(x, (np.ndarray, np.generic)):
    # NumPy arrays are mutable and shared with the caller (an index buffer, a
    # mask reused by a data pipeline): the state holds a jax copy instead.
    return jnp.array(x, copy=True)
  return x


def _own_tree(tree: Any, master_dtype: np.dtype) -> Any:
  """The state's own copy of ``tree``; fields of Equinox modules that are not arrays stay static.

  Outside Equinox modules a Python number becomes an array (and is trained if
  it is a float), as ``jax.jit`` would treat it; inside one, a Python number,
  bool, string or function is the module's static configuration, as under
  ``eqx.filter_jit`` (see ``filtering.py``).
  """

  def own(x: Any) -> Any:
    return _own_leaf(x, master_dtype)

  return filtering.map_outside_modules(
      own, tree, in_module=lambda x: own(x) if filtering.is_traced(x) else x)


def _own_key(key: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(jnp.array(jax.random.key_data(key), copy=True),
                                  impl=jax.random.key_impl(key))


def _copy_array(x: jax.Array) -> jax.Array:
  """A fresh buffer with ``x``'s dtype (and key implementation)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.extended):  # PRNG keys.
    return _own_key(x)
  return jnp.array(x, dtype=x.dtype, copy=True)


def _init_owned(tx: optax.GradientTransformation, params: optax.Params) -> optax.OptState:
  """``tx.init(params)``, copying every leaf the state would share with someone else.

  ``tx.init`` may return arrays that existed before it ran: the params it was
  given (``optax.contrib.prodigy``, ``cocob`` and ``mechanize`` keep them) or
  the caller's (``optax.inject_hyperparams(optax.adam)(learning_rate=lr)``
  holds ``lr`` as given). A donating step would donate those buffers twice,
  or delete the caller's. Such leaves, and the second occurrence of any leaf,
  are copied; the arrays ``tx.init`` made itself (the moments) are kept as
  they are, so no optimizer state is copied twice.
  """
  existing = {id(x) for x in jax.live_arrays()}
  existing.update(id(x) for x in jax.tree.leaves(params))
  opt_state = tx.init(params)
  seen: set[int] = set()

  def own(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic)):
      return jnp.array(x, copy=True)
    if not isinstance(x, jax.Array):
      return x
    if id(x) in existing or id(x) in seen:
      x = _copy_array(x)
    seen.add(id(x))
    return x

  return jax.tree.map(own, opt_state)


def _check_tx(tx: Any) -> None:
  """Refuses a ``tx`` without callable ``init`` and ``update``, in one line.

  An optimizer state (``tx.init(params)``, a tuple of arrays or a ``...State``
  NamedTuple) passed for the transformation is named as such.
  """
  if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
    return
  has_arrays = isinstance(tx, (tuple, list, dict)) and any(
      filtering.is_traced(x) for x in jax.tree.leaves(tx))
  if has_arrays or type(tx).__name__.endswith("State"):
    hint = (" (it looks like an optimizer state: pass the transformation, e.g. "
            "optax.adam(1e-3), not its init(params))")
  elif callable(tx):
    hint = (f": {checks.short_repr(tx)} (call it to get the transformation, e.g. "
            "optax.adam(1e-3))")
  else:
    hint = f": {checks.short_repr(tx)}"
  raise TypeError(
      "tx must be an optax GradientTransformation (an object with callable init "
      f"and update), got an object of type {checks.type_name(tx)}{hint}"
  )


def _replicated_like(key: jax.Array, params: Any) -> jax.Array:
  """``key`` replicated over the mesh of the first mesh-sharded params leaf, if any.

  A key committed to one device next to params on a mesh would make the jitted
  step refuse its arguments ("incompatible devices").
  """
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
      return jax.device_put(key, replicated)
  return key


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Step counter, master params and optimizer state. A pytree.

  ``step``, ``params``, ``opt_state``, ``compensation`` and ``rounding_key``
  are pytree children (``None`` is an empty child); ``tx``, ``master_dtype``
  and ``rounding`` are static. Build it with :meth:`create`. It checkpoints
  with ``orbax.checkpoint.StandardCheckpointer`` and restores into a template
  made by :meth:`create` with the same arguments.

  Attributes:
    step: int32 scalar, the number of steps taken (skipped steps included);
      it saturates at ``2**31 - 1``.
    params: master params. Floating leaves are float32 (or float64), or
      bfloat16 with ``master_dtype=bfloat16``; other leaves (int counters,
      PRNG keys) are kept as they are and never updated.
    opt_state: ``tx``'s state over the float32 view of the floating leaves of
      ``params`` (non-floating leaves are ``None`` holes).
    tx: the optax transformation.
    compensation: with ``rounding="kahan"``, a bfloat16 array per bfloat16
      leaf of ``params`` (``None`` at the other leaves) holding what rounding
      the last update lost; else ``None``.
    rounding_key: with ``rounding="stochastic"``, the PRNG key that step
      ``t`` rounds with, as ``jax.random.fold_in(rounding_key, t)``; it never
      changes. Else ``None``.
    model_state: non-trainable model state (Flax ``batch_stats``, NNX RNG
      counts and other non-param variables), or ``None``. The step passes it
      to ``loss_fn`` and stores what ``loss_fn`` returns for it, except on a
      skipped step; it is never differentiated and has no optimizer state.
    weight_amaxes: with ``TrainState.create(..., weight_amaxes=True)``, the
      params with each weight matrix's amax (``max|w|``, a scalar in the
      master's dtype) in its place and ``None`` at the other leaves; else
      ``None``. A step with ``fp8=`` quantises each weight with it instead of
      reducing the weight first (so under FSDP its float8 cast and gather
      need not wait for an all-reduce), and every step writes the new
      masters' amaxes, all in one computation, when it writes the masters
      (the same on a skipped step, whose masters are unchanged).
      :meth:`replace` with new ``params`` takes them anew.
    master_dtype: ``float32`` (the default) or ``bfloat16``.
    rounding: how updates are written back to bfloat16 masters:
      ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
  """

  step: jax.Array
  params: optax.Params
  opt_state: optax.OptState
  tx: optax.GradientTransformation = dataclasses.field(metadata=dict(static=True))
  compensation: optax.Params | None = None
  rounding_key: jax.Array | None = None
  model_state: Any = None
  weight_amaxes: Any = None
  master_dtype: np.dtype = dataclasses.field(
      default=masters.FLOAT32, metadata=dict(static=True)
  )
  rounding: str = dataclasses.field(default="nearest", metadata=dict(static=True))

  @classmethod
  def create(
      cls,
      *,
      params: optax.Params,
      tx: optax.GradientTransformation,
      master_dtype: DTypeLike = jnp.float32,
      rounding: str = "nearest",
      key: jax.Array | None = None,
      model_state: Any = None,
      weight_amaxes: bool = False,
  ) -> "TrainState":
    """A fresh state: step 0, master params and ``tx.init`` over them.

    The state owns its buffers: every array leaf is copied once, so a donating
    step only ever deletes the state's arrays, never the caller's. That holds
    for ``tx.init``'s output too: a leaf it shares with the params (prodigy's
    initial params) or with the caller (an ``inject_hyperparams`` array) is
    copied. NumPy arrays and scalars of any dtype (an index buffer, a mask)
    become jax arrays of their own, so writing into the caller's NumPy arrays
    afterwards changes neither the state nor its next step. With
    ``master_dtype=jnp.float32`` (the default), floating leaves narrower than
    float32 (bf16, f16, f8) become float32, so the state holds full-precision
    master weights; float32, float64 and complex leaves keep their dtype. With
    ``master_dtype=jnp.bfloat16`` every floating leaf becomes bfloat16 (lean
    masters, 2 bytes per weight); :func:`make_train_step` computes each update
    in float32 and writes it back with ``rounding``. Python numbers become
    strongly typed arrays (a float in the master dtype, int32, bool), and
    weakly typed arrays become strong, so that every step sees the same types.
    Non-floating leaves (int counters, PRNG keys) are kept (copied);
    ``tx.init`` sees ``None`` in their place, and a float32 view of the
    floating ones, so the optimizer state is float32 whatever the masters.

    Args:
      params: a pytree of parameters.
      tx: an optax transformation, usually wrapped in
        :func:`dynamic_loss_scaling` or :func:`static_loss_scaling`
        (outermost).
      master_dtype: ``jnp.float32`` or ``jnp.bfloat16``. float16 is refused:
        its narrow exponent makes small weights and Kahan compensations
        subnormal (see the "Lean master weights" guide, docs/masters.md).
      rounding: ``"nearest"`` (the only choice for float32 masters),
        ``"stochastic"`` (unbiased; needs ``key``) or ``"kahan"`` (a bfloat16
        compensation buffer per floating leaf).
      key: a PRNG key (``jax.random.key(seed)``), required for (and only for)
        ``rounding="stochastic"``. The state keeps its own copy, replicated
        over the params' mesh when they are sharded.
      model_state: optional non-trainable state (see the class docstring),
        owned and normalised like float32 ``params`` (floating leaves in
        float32, whatever ``master_dtype``).
      weight_amaxes: keep each weight matrix's amax in the state (see the
        class docstring): the FP8 step's scales, known before its first
        gather, from this state on.

    Returns:
      A ``TrainState`` with ``step`` 0 (int32).

    Raises:
      TypeError: if ``tx`` is not an optax transformation, ``master_dtype`` is
        not a dtype, ``rounding`` not a string or ``key`` not a PRNG key.
      ValueError: if ``tx`` holds a loss-scaling transformation that is not
        outermost, or more than one; for a ``master_dtype`` other than
        float32 and bfloat16, an unknown ``rounding``, a ``rounding`` other
        than ``"nearest"`` with float32 masters, or a missing or superfluous
        ``key``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jmp_lite as jmp
      >>> state = jmp.TrainState.create(params={"w": jnp.ones(2, jnp.bfloat16)}, tx=optax.sgd(0.1))
      >>> state.params["w"].dtype, state.step.dtype
      (dtype('float32'), dtype('int32'))
      >>> lean = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.adam(1e-3),
      ...                              master_dtype=jnp.bfloat16, rounding="kahan")
      >>> lean.params["w"].dtype, lean.compensation["w"].dtype, lean.opt_state[0].mu["w"].dtype
      (dtype(bfloat16), dtype(bfloat16), dtype('float32'))
    """
    _check_tx(tx)
    master_dtype = masters.check_master_dtype(master_dtype)
    rounding = masters.check_rounding(rounding)
    masters.check_config(master_dtype, rounding)
    if rounding == "stochastic" and key is None:
      raise ValueError(
          "rounding='stochastic' needs a PRNG key: TrainState.create(..., key=jax.random.key(seed))"
      )
    if rounding != "stochastic" and key is not None:
      raise ValueError(f"key is only used with rounding='stochastic', got rounding={rounding!r}")
    params = _own_tree(params, master_dtype)
    compensation = masters.zero_compensation(params) if rounding == "kahan" else None
    rounding_key = None
    if key is not None:
      rounding_key = _replicated_like(_own_key(masters.as_key(key)), params)
    opt_state = _init_owned(tx, trained_part(masters.float32_view(params)))
    transform.check_outermost(tx, opt_state)
    amaxes = fp8_known.tree_amaxes(params) if checks.boolean("weight_amaxes", weight_amaxes) else None
    return cls(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        tx=tx,
        compensation=compensation,
        rounding_key=rounding_key,
        model_state=_own_tree(model_state, masters.FLOAT32),
        weight_amaxes=amaxes,
        master_dtype=master_dtype,
        rounding=rounding,
    )

  def __post_init__(self) -> None:
    # The static leaves (an Equinox module's functions, strings and Python
    # numbers) go to the aux data, once, here: see _flatten_with_keys.
    hollow = {f: filtering.hollow(getattr(self, f)) for f in _HOLLOWED}
    children = tuple(hollow[f][0] if f in hollow else getattr(self, f) for f in _CHILDREN)
    specs = tuple(hollow[f][1] for f in _HOLLOWED)
    self.__dict__["_tree"] = (children, (specs, tuple(getattr(self, f) for f in _META)))
    self.__dict__["_seen"] = _seen(self.__dict__, specs)

  def replace(self, **changes: Any) -> "TrainState":
    """A copy with some fields replaced (``dataclasses.replace``).

    New ``params`` come with their own ``weight_amaxes`` when the state keeps
    them and ``changes`` sets none; set ones unlike the params' are a ``ValueError``.
    """
    if "weight_amaxes" in changes:
      fp8_known.check_amaxes(changes["weight_amaxes"], changes.get("params", self.params))
    elif "params" in changes and self.weight_amaxes is not None:
      changes["weight_amaxes"] = fp8_known.tree_amaxes(changes["params"])
    return dataclasses.replace(self, **changes)


# The pytree children and aux fields, by the fields' ``static`` metadata.
_CHILDREN = tuple(f.name for f in dataclasses.fields(TrainState) if not f.metadata.get("static"))
_META = tuple(f.name for f in dataclasses.fields(TrainState) if f.metadata.get("static"))
_HOLLOWED = ("params", "opt_state", "model_state")


def _flatten(state: TrainState) -> tuple[tuple[Any, ...], Any]:
  """Children: the array fields, with static leaves as ``None`` holes; aux: the rest.

  The static leaves are split off when the state is built, never when it is
  flattened, so a tree map that puts other objects in the traced places (an
  orbax ``SaveArgs``, a sharding, a bool) round-trips unchanged, while
  ``jax.tree.leaves(state)``, checkpoints and ``jax.eval_shape`` see arrays
  only. A static leaf that changes is a new tree structure, so ``jax.jit``
  retraces, as ``eqx.filter_jit`` does. Both halves are computed once, when
  the state is built, so flattening it (every call of a jitted step) is one
  attribute read.
  """
  values = state.__dict__
  seen = values["_seen"]
  if seen is not None and _edited(values, seen):
    state.__post_init__()  # An in-place edit (state.params["w"] = new): hollow again.
  return values["_tree"]


def _seen(values: dict[str, Any], specs: tuple[Any, ...]) -> Any:
  """What the hollowed fields with a static leaf held when their holes were made.

  Their children are copies (the static leaves replaced by holes), so an
  in-place edit of ``state.params`` (``state.params["w"] = new``) would not
  reach them: :func:`_flatten` compares the fields with this record
  (:func:`filtering.snapshot`) and hollows them again when they changed. A
  field without static leaves is its own child, so an edit reaches the step
  as it is, and needs no record.
  """
  if specs == _NO_SPECS:
    return None
  seen = [(f, filtering.snapshot(values[f])) for f, spec in zip(_HOLLOWED, specs)
          if spec is not None]
  return tuple((f, shot) for f, shot in seen if shot is not None) or None


def _edited(values: dict[str, Any], seen: Any) -> bool:
  return any(filtering.edited(values[f], shot) for f, shot in seen)


def _flatten_with_keys(state: TrainState) -> tuple[list[Any], Any]:
  children, aux = _flatten(state)
  return [(jax.tree_util.GetAttrKey(f), c) for f, c in zip(_CHILDREN, children)], aux


_NO_SPECS = (None,) * len(_HOLLOWED)
_FIELDS = _CHILDREN + _META


def _unflatten(aux: Any, children: Any) -> TrainState:
  """The state :func:`_flatten` split; the aux data is kept as it is (the same object)."""
  specs, meta = aux
  state = object.__new__(TrainState)
  values = state.__dict__
  values.update(zip(_FIELDS, (*children, *meta)))
  if specs != _NO_SPECS:
    for f, spec in zip(_HOLLOWED, specs):
      values[f] = filtering.fill(values[f], spec)
  values["_tree"] = (tuple(children), aux)
  values["_seen"] = _seen(values, specs)
  return state


jax.tree_util.register_pytree_with_keys(TrainState, _flatten_with_keys, _unflatten, _flatten)


def trained_part(params: optax.Params) -> optax.Params:
  """The leaves the step differentiates and updates; the others are ``None``."""
  return jax.tree.map(lambda x: x if tree_utils.is_inexact_array(x) else None, params)


def check_masters(state: TrainState) -> None:
  """Refuses masters the state does not declare (runs at trace time, so once per compile).

  float32 masters (the default) must be float32 or float64; bfloat16 masters
  must all be bfloat16, with the compensation or key their rounding needs.
  """
  master_dtype = masters.check_master_dtype(state.master_dtype)
  rounding = masters.check_rounding(state.rounding)
  masters.check_config(master_dtype, rounding)
  lean = master_dtype == masters.BFLOAT16
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    if not tree_utils.is_floating_array(leaf):
      continue
    if lean and leaf.dtype != master_dtype:
      raise TypeError(
          f"state.params must hold bfloat16 master weights (the state's master_dtype), "
          f"but {tree_utils.path_str(path)!r} is {leaf.dtype}; build the state with "
          "TrainState.create(..., master_dtype=jnp.bfloat16), which casts every floating leaf"
      )
    if not lean and jnp.finfo(leaf.dtype).bits < 32:
      raise TypeError(
          f"state.params must hold float32 (or float64) master weights, but "
          f"{tree_utils.path_str(path)!r} is {leaf.dtype}; build the state with "
          "TrainState.create, which upcasts half-precision params (or pass "
          "master_dtype=jnp.bfloat16 to it for lean bfloat16 masters)"
      )
  if rounding != "kahan" and state.compensation is not None:
    raise ValueError(f"state.compensation is only used with rounding='kahan', got {rounding!r}")
  if rounding != "stochastic" and state.rounding_key is not None:
    raise ValueError(f"state.rounding_key is only used with rounding='stochastic', got {rounding!r}")


def step_rounding_key(state: TrainState) -> jax.Array | None:
  """Step ``t``'s key, ``fold_in(rounding_key, t)``; ``None`` unless stochastic."""
  if state.rounding != "stochastic":
    return None
  if state.rounding_key is None:
    raise ValueError(
        "state.rounding_key is missing: rounding='stochastic' needs one; build the "
        "state with TrainState.create(..., key=jax.random.key(seed))"
    )
  return jax.random.fold_in(masters.as_key(state.rounding_key), state.step)


"""A jit-compiled mixed-precision train step over fp32 master params."""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Mapping, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jmp_lite._src import autocast as autocast_lib
from jmp_lite._src import checks
from jmp_lite._src import masters
from jmp_lite._src import policy as policy_lib
from jmp_lite._src import skip
from jmp_lite._src import transform
from jmp_lite._src import tree_utils

_LOSS_MSG = "loss_fn must return a float scalar loss{aux}; got {what}"
_AUX_MSG = "loss_fn was declared with has_aux=True and must return a (loss, aux) pair; got {what}"
_STATE_MSG = (
    "state.model_state is set, so loss_fn(params, model_state, batch) must return "
    "(loss, new_model_state), or (loss, (new_model_state, aux)) with has_aux=True; "
    "{what} was {got}"
)
_NO_AUX_HINT = (
    "; it returned a pair: if the second element is auxiliary output, build the "
    "step with has_aux=True"
)
_STRUCTURE_MSG = (
    "the {what} tree changed structure between calls of the same train step "
    "(the step was first called with one structure and would silently recompile "
    "for another).\n  expected: {expected}\n  received: {received}\n"
    "Pass trees of the first structure, or build a separate step with "
    "make_train_step for the new one."
)
_DELETED_MSG = (
    "{where} was deleted: a donating step (make_train_step(..., donate=True), the "
    "default) consumed the state it was part of. Keep using the state each call "
    "returns (state, metrics = step(state, batch)), or build the step with "
    "donate=False to keep old states alive."
)
_ALIASED_MSG = (
    "{first} and {second} are the same array, and a donating step cannot donate "
    "one buffer twice (or donate a buffer it also reads from the batch). Give "
    "them separate arrays (TrainState.create copies every leaf, so build states "
    "with it), or build the step with donate=False."
)


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
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):  # PRNG keys.
      return _own_key(x)
    return jnp.array(x, dtype=x.dtype, copy=True)
  if tree_utils.is_inexact_array(x):  # NumPy floating: a jax array, as before.
    return jnp.array(x, copy=True)
  return x


def _own_key(key: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(jnp.array(jax.random.key_data(key), copy=True),
                                  impl=jax.random.key_impl(key))


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
  ) -> "TrainState":
    """A fresh state: step 0, master params and ``tx.init`` over them.

    The state owns its buffers: every array leaf is copied once, so a donating
    step only ever deletes the state's arrays, never the caller's. With
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
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
      raise TypeError(f"tx must be an optax transformation, got {tx!r}")
    master_dtype = masters.check_master_dtype(master_dtype)
    rounding = masters.check_rounding(rounding)
    masters.check_config(master_dtype, rounding)
    if rounding == "stochastic" and key is None:
      raise ValueError(
          "rounding='stochastic' needs a PRNG key: TrainState.create(..., key=jax.random.key(seed))"
      )
    if rounding != "stochastic" and key is not None:
      raise ValueError(f"key is only used with rounding='stochastic', got rounding={rounding!r}")
    params = jax.tree.map(lambda x: _own_leaf(x, master_dtype), params)
    compensation = masters.zero_compensation(params) if rounding == "kahan" else None
    rounding_key = None
    if key is not None:
      rounding_key = _replicated_like(_own_key(masters.as_key(key)), params)
    opt_state = tx.init(_trained_part(masters.float32_view(params)))
    transform.check_outermost(tx, opt_state)
    return cls(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        tx=tx,
        compensation=compensation,
        rounding_key=rounding_key,
        model_state=jax.tree.map(lambda x: _own_leaf(x, masters.FLOAT32), model_state),
        master_dtype=master_dtype,
        rounding=rounding,
    )

  def replace(self, **changes: Any) -> "TrainState":
    """A copy with some fields replaced (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(TrainState)


def _trained_part(params: optax.Params) -> optax.Params:
  """The leaves the step differentiates and updates; the others are ``None``."""
  return jax.tree.map(lambda x: x if tree_utils.is_inexact_array(x) else None, params)


def _check_loss(loss: Any, has_aux: bool) -> jax.Array:
  aux = " (as the first element of (loss, aux))" if has_aux else ""
  if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
    hint = _NO_AUX_HINT if isinstance(loss, (tuple, list)) and len(loss) == 2 else ""
    raise TypeError(_LOSS_MSG.format(aux=aux, what=repr(type(loss))) + hint)
  if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(_LOSS_MSG.format(aux=aux, what=f"shape {loss.shape} dtype {loss.dtype}"))
  return loss


def _check_masters(state: TrainState) -> None:
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


def _rounding_key(state: TrainState) -> jax.Array | None:
  """Step ``t``'s key, ``fold_in(rounding_key, t)``; ``None`` unless stochastic."""
  if state.rounding != "stochastic":
    return None
  if state.rounding_key is None:
    raise ValueError(
        "state.rounding_key is missing: rounding='stochastic' needs one; build the "
        "state with TrainState.create(..., key=jax.random.key(seed))"
    )
  return jax.random.fold_in(masters.as_key(state.rounding_key), state.step)


def _split_aux(
    out: Any, has_aux: bool, with_state: bool = False, what: str = "it"
) -> tuple[Any, Any]:
  """``out`` as a pair, with a message that says which pair was expected."""
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    if hasattr(out, "shape") and hasattr(out, "dtype"):
      got = f"an array of shape {out.shape} dtype {out.dtype}"
    elif isinstance(out, (tuple, list)):
      got = f"a {type(out).__name__} of length {len(out)}"
    else:
      got = repr(type(out))
    if with_state:
      raise TypeError(_STATE_MSG.format(what=what, got=got))
    raise TypeError(_AUX_MSG.format(what=got))
  return out[0], out[1]


def _stored_like(new: Any, old: Any) -> Any:
  """``loss_fn``'s new model state in the stored dtypes; its structure must not change."""
  structure: Any = jax.tree.structure(new)  # Any: mypy cannot compare jaxlib's PyTreeDef.
  if structure != jax.tree.structure(old):
    raise TypeError(
        "loss_fn returned a model state of another structure than state.model_state:\n"
        f"  expected: {jax.tree.structure(old)}\n  received: {jax.tree.structure(new)}"
    )
  return jax.tree.map(
      lambda n, o: jnp.asarray(n).astype(o.dtype) if tree_utils.is_inexact_array(o) else n,
      new, old)


def _bind_axis_name(fn: Callable[..., Any], axis_name: str) -> Callable[..., Any]:
  """``fn`` with ``axis_name`` bound over the whole (global) batch.

  Collectives over ``axis_name`` inside the model (``BatchNorm(axis_name=...)``'s
  ``pmean`` of its statistics, which are already means over the global batch
  under ``jit``) run over a single member and are the identity, so a
  data-parallel ``pmap``-style model runs unchanged on a sharded ``jit`` step.
  """

  def bound(params: Any, model_state: Any, batch: Any) -> Any:
    expanded = jax.tree.map(lambda x: jnp.asarray(x)[None], batch)
    out = jax.vmap(lambda b: fn(params, model_state, b), axis_name=axis_name)(expanded)
    return jax.tree.map(lambda x: x[0], out)

  return bound


def _named_leaves(prefix: str, tree: Any) -> list[tuple[str, Any]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(prefix + jax.tree_util.keystr(p), x) for p, x in flat]


def _donation_problem(state: TrainState, batch: Any) -> str | None:
  """Why a donating call failed on its inputs (deleted or aliased arrays), if it did."""
  leaves = _named_leaves("state", state) + _named_leaves("batch", batch)
  seen: dict[int, str] = {}
  for name, x in leaves:
    if not isinstance(x, jax.Array):
      continue
    if x.is_deleted():
      return _DELETED_MSG.format(where=name)
    if id(x) in seen:
      return _ALIASED_MSG.format(first=seen[id(x)], second=name)
    seen[id(x)] = name
  return None


def _is_dynamic(x: Any) -> bool:
  """Leaves ``jax.jit`` traces: arrays and Python numbers. Others are static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """A non-array leaf (an Equinox activation, a string), compared by value if hashable."""

  value: Any

  def _key(self) -> Any:
    try:
      hash(self.value)
    except TypeError:
      return ("id", id(self.value))
    return ("value", type(self.value), self.value)

  def __hash__(self) -> int:
    return hash(self._key())

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Static) and self._key() == other._key()


def _partition(tree: Any) -> tuple[list[Any], tuple[Any, tuple[Any, ...]]]:
  """``(dynamic leaves with None holes, (treedef, static leaves))``, like ``eqx.partition``."""
  leaves, treedef = jax.tree.flatten(tree)
  dynamic = [x if _is_dynamic(x) else None for x in leaves]
  static = tuple(None if _is_dynamic(x) else _Static(x) for x in leaves)
  return dynamic, (treedef, static)


def _combine(dynamic: list[Any], spec: tuple[Any, tuple[Any, ...]]) -> Any:
  treedef, static = spec
  return treedef.unflatten([d if s is None else s.value for d, s in zip(dynamic, static)])


class _FilteredJit:
  """``jax.jit`` for trees with non-array leaves, which become static (like ``eqx.filter_jit``).

  The static leaves are part of the compilation key and come back as the
  very same objects; only the arrays are traced. The first argument's arrays
  are donated if ``donate``.
  """

  def __init__(self, fn: Callable[..., Any], donate: bool):
    self._out_specs: dict[Any, Any] = {}

    def inner(first: list[Any], rest: list[Any], spec: Any) -> list[Any]:
      args = _combine(first, spec[0]), _combine(rest, spec[1])
      out_dynamic, self._out_specs[spec] = _partition(fn(*args))
      return out_dynamic

    self._jitted = jax.jit(inner, static_argnums=2, donate_argnums=(0,) if donate else ())

  def _split(self, first: Any, rest: Any) -> tuple[list[Any], list[Any], Any]:
    (first, first_spec), (rest, rest_spec) = _partition(first), _partition(rest)
    return first, rest, (first_spec, rest_spec)

  def __call__(self, first: Any, rest: Any) -> Any:
    first, rest, spec = self._split(first, rest)
    return _combine(self._jitted(first, rest, spec), self._out_specs[spec])

  def lower(self, first: Any, rest: Any) -> Any:
    return self._jitted.lower(*self._split(first, rest))


class _TrainStep:
  """The jitted step plus the checks that need Python: tree structures, donation.

  The structure check compares tree structures on the Python side (cheap)
  before the call. Deleted or aliased input arrays are diagnosed only when the
  call fails, so they cost nothing otherwise. A state or batch with non-array
  leaves (an Equinox module's activation functions) goes through a filtered
  jit that keeps them static; otherwise the plain ``jax.jit`` runs, with no
  Python work per leaf. Attribute access (``trace``, ``eval_shape``, ...)
  goes to the underlying ``jax.jit`` object.
  """

  def __init__(self, step: Callable[..., Any], donate: bool):
    self._jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
    self._filtered = _FilteredJit(step, donate)
    self._donate = donate
    self._structures: tuple[Any, Any] | None = None
    self._has_static: bool | None = None
    self._block = False
    self.__wrapped__ = self._jitted

  def _target(self, state: Any, batch: Any) -> Any:
    if self._has_static is None:
      self._has_static = not all(_is_dynamic(x) for x in jax.tree.leaves((state, batch)))
    return self._filtered if self._has_static else self._jitted

  def lower(self, state: TrainState, batch: Any) -> Any:
    """``jax.jit(...).lower`` for these arguments (static leaves included)."""
    return self._target(state, batch).lower(state, batch)

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    if not isinstance(state, TrainState):
      raise TypeError(
          f"state must be a jmp_lite.TrainState (see TrainState.create), got {type(state).__name__}"
      )
    structures = (jax.tree.structure(state.params), jax.tree.structure(batch))
    if self._structures is not None:
      for what, expected, received in zip(("params", "batch"), self._structures, structures):
        if expected != received:
          raise ValueError(
              _STRUCTURE_MSG.format(what=what, expected=expected, received=received)
          )
    try:
      out = self._target(state, batch)(state, batch)
    except (RuntimeError, ValueError) as e:
      problem = _donation_problem(state, batch) if self._donate else None
      if problem is None:
        raise
      raise ValueError(problem) from e
    if self._structures is None:
      self._structures = structures
      self._block = _multi_device_cpu((state, batch))
    if self._block:
      jax.block_until_ready(out)
    return out

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") or name in ("_jitted", "_filtered"):
      raise AttributeError(name)
    return getattr(self._jitted, name)


def _multi_device_cpu(tree: Any) -> bool:
  """Whether any array of ``tree`` is spread over several CPU devices.

  XLA:CPU runs every device of a step on one shared thread pool; with many
  steps in flight, their collectives' rendezvous can wait on each other until
  XLA aborts the process ("Termination timeout ... 40 seconds"), with or
  without jmp_lite. Such a step waits for each call to finish, which costs
  little on a CPU and never hangs.
  """
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    devices = getattr(sharding, "device_set", ())
    if len(devices) > 1 and next(iter(devices)).platform == "cpu":
      return True
  return False


def _nonfinite_leaves(grads: optax.Updates, inv_scale: jax.Array, masters: optax.Params) -> Any:
  """Per leaf: True if its gradient has an inf/NaN or its squared norm overflows.

  When no single leaf is non-finite but the global sum of squares overflows,
  the leaves whose squared norm exceeds ``float32 max / number of leaves``
  (at least one must) are marked: they are the largest contributions.
  """
  sums = jax.tree.map(lambda g, p: skip.unscaled_sumsq(g, inv_scale, p), grads, masters)
  leaves = jax.tree.leaves(sums)
  if not leaves:
    return jax.tree.map(lambda _: jnp.zeros((), bool), sums)
  total = functools.reduce(operator.add, leaves)  # sum(leaves), typed as an array.
  share = jnp.finfo(total.dtype).max / len(leaves)
  sum_overflow = ~jnp.isfinite(total) & jnp.all(jnp.isfinite(jnp.stack(leaves)))
  return jax.tree.map(lambda s: ~jnp.isfinite(s) | (sum_overflow & (s > share)), sums)


def make_train_step(
    loss_fn: Callable[..., Any],
    policy: policy_lib.Policy,
    *,
    has_aux: bool = False,
    donate: bool = True,
    track_nonfinite: bool = False,
    cast_batch: bool = True,
    batch_keep_full: tuple[policy_lib.KeepRule, ...] = (),
    extra_args: Callable[[jax.Array, Any, Any], Mapping[str, Any]] | None = None,
    axis_name: str | None = None,
    autocast: bool = False,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
  """Builds ``step(state, batch) -> (state, metrics)``, compiled with ``jax.jit``.

  Each call::

    scale   = loss_scale_of(state.opt_state)          # 1.0 if tx has no scaling
    p_c     = policy.cast_to_compute(state.params)    # half copy, inside the step only
    loss    = loss_fn(p_c, cast floating batch leaves to policy.compute_dtype)
    grads   = d(float32(loss) * scale) / d(master params)   # through the cast
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params  = apply_updates(params, updates, rounding=state.rounding, ...)

  Only ``loss_fn``'s view of the params is in ``policy.compute_dtype``
  (``keep_full`` leaves stay float32): the gradients, the optimizer update and
  the stored params are float32. With bfloat16 masters
  (``TrainState.create(..., master_dtype=jnp.bfloat16, rounding=...)``) the
  "master params" above are their float32 view ``float32(p)`` (with
  ``rounding="kahan"`` the compensation only enters the write-back):
  ``loss_fn``, the gradients and ``tx`` see float32 exactly as with float32
  masters, and only the write-back rounds to bfloat16, as
  :func:`apply_updates` does; step ``t`` rounds stochastically with
  ``jax.random.fold_in(state.rounding_key, t)``.
  ``policy.param_dtype`` and ``output_dtype`` are not used by the step.
  Non-floating leaves of params (int counters, PRNG keys) and of the batch
  (labels) are passed through as they are; param ones are not differentiated
  and come back unchanged.

  Skipped steps: when a gradient is inf or NaN, the global norm of the
  unscaled gradients overflows, or the loss itself is inf or NaN, the
  optimizer update is skipped under ``lax.cond`` and its updates are ``-0.0``,
  so params, the Kahan compensation and the inner optimizer state (Adam's
  count, schedules) are unchanged bit for bit while the scale backs off (a
  skipped step still advances ``state.step``, so the next step rounds with
  fresh random bits). One sum of squares of the unscaled gradients gives
  both the skip decision and ``grad_norm``: with an
  outermost :func:`dynamic_loss_scaling`/:func:`static_loss_scaling` it is the
  transformation's own, otherwise (a plain optax ``tx``) the step guards the
  update the same way, without a scale to adjust or a skip counter. A scaler
  nested inside another transformation is refused (``ValueError``).
  ``state.step`` still increments: it counts calls, skipped ones included.

  The step compiles once per distinct input shapes and shardings, skipped steps
  included. It remembers the tree structure of the params and the batch of its
  first call and refuses another structure with a ``ValueError`` rather than
  recompiling silently. It runs unchanged on sharded inputs (a
  ``jax.sharding.Mesh`` with a ``NamedSharding`` per array of the state and the batch):
  XLA inserts the reductions, and the skip decision covers every shard.

  Model state: when ``state.model_state`` is set (:meth:`TrainState.create`'s
  ``model_state``: Flax ``batch_stats``, NNX non-param variables), the step
  calls ``loss_fn(params, model_state, batch)``, with ``model_state`` cast by
  the policy (keep rules apply), and ``loss_fn`` returns ``(loss,
  new_model_state)``, or ``(loss, (new_model_state, aux))`` with
  ``has_aux``. The new model state is stored in the state's dtypes, except on
  a skipped step, where the old one is kept bit for bit.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a float scalar, or
      ``(loss, aux)`` when ``has_aux``; ``loss_fn(params, model_state,
      batch)`` when the state has a model state (see above).
    policy: the precision policy; its keep rules apply to params.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    donate: donate the state's buffers to the step (default on): the state
      passed in is deleted by the call (never the arrays given to
      :meth:`TrainState.create`, which copies them). Use the returned state,
      or pass ``donate=False`` to keep the old one.
    track_nonfinite: add ``metrics["nonfinite"]``, a bool pytree over params
      marking the leaves whose gradients were inf or NaN (or, when only the
      global norm overflowed, the leaves that contributed most). It costs one
      more reduction per leaf.
    cast_batch: cast the batch's floating leaves to ``policy.compute_dtype``
      (default). ``False`` passes the batch to ``loss_fn`` as it is.
    batch_keep_full: keep rules for the batch (the same grammar as
      :class:`Policy`'s ``keep_full``: a regex on the ``/``-joined key path,
      or a callable ``(path, leaf) -> bool``): the leaves they select stay
      float32. Use them for values a half dtype cannot hold, such as
      regression targets above 65504 in float16.
    extra_args: ``extra_args(loss, aux, batch)`` returning more keyword
      arguments for ``tx.update``, merged over the default ``value=loss``
      (the unscaled float32 loss, optax's name for it, which e.g.
      ``optax.contrib.reduce_on_plateau`` reads).
    axis_name: a name to bind over the whole batch while ``loss_fn`` runs,
      for models written for ``pmap`` whose collectives name the
      data-parallel axis (Flax ``BatchNorm(axis_name="batch")``). Under
      ``jit`` the batch statistics are already the global batch's, so those
      collectives are the identity; the step runs unchanged on a sharded mesh.
    autocast: run ``loss_fn`` under :func:`autocast` with
      ``policy.compute_dtype``. ``loss_fn`` still receives the params and the
      batch cast as above (keep rules included); autocast then runs its
      exp/log/pow/reductions (softmax, norms, losses) in float32 and its
      matmuls and convolutions in the compute dtype. Loss scaling, float32
      masters and the skip are unchanged. Needs a float16 or bfloat16
      compute dtype.

  Returns:
    The jitted step. ``metrics`` holds ``loss`` (float32, unscaled),
    ``grads_finite`` (bool; False means the step was skipped), ``loss_scale``
    (the scale used this step), ``grad_norm`` (global norm of the unscaled
    gradients, float32 or float64 with float64 masters; inf or NaN on a
    skipped step), ``aux`` when ``has_aux`` and ``nonfinite`` when
    ``track_nonfinite``.

  Raises:
    TypeError: if ``loss_fn`` is not callable, ``policy`` is not a
      :class:`Policy` or a flag is not a bool; when the step is called, if
      ``state`` is not a :class:`TrainState`, or (at trace time) if the loss
      is not a float scalar, ``has_aux`` is set and ``loss_fn`` does not
      return a pair, or the params' dtypes are not the state's
      ``master_dtype`` (a hand-built state).
    ValueError: if ``autocast`` is set and ``policy.compute_dtype`` is not
      float16 or bfloat16; when the step is called with params or a batch
      whose tree structure differs from the first call's, with a deleted
      (already donated) or aliased array, with a nested loss-scaling
      transformation, or with a state whose compensation or rounding key does
      not fit its ``rounding``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)
    >>> state = jmp.TrainState.create(params={"w": jnp.zeros((3, 1))}, tx=tx)
    >>> step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.ones((4, 1))}
    >>> state, metrics = step(state, batch)
    >>> metrics["loss"].dtype, bool(metrics["grads_finite"]), int(state.step)
    (dtype('float32'), True, 1)
  """
  if not isinstance(policy, policy_lib.Policy):
    raise TypeError(f"policy must be a jmp_lite.Policy, got {policy!r}")
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  has_aux = checks.boolean("has_aux", has_aux)
  donate = checks.boolean("donate", donate)
  track_nonfinite = checks.boolean("track_nonfinite", track_nonfinite)
  cast_batch = checks.boolean("cast_batch", cast_batch)
  if axis_name is not None and not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a string or None, got {axis_name!r}")
  if checks.boolean("autocast", autocast):
    loss_fn = autocast_lib.autocast(loss_fn, policy.compute_dtype)
  if extra_args is not None and not callable(extra_args):
    raise TypeError(f"extra_args must be a callable (loss, aux, batch) -> dict, got {extra_args!r}")
  batch_policy = policy_lib.Policy(
      policy.param_dtype, policy.compute_dtype, policy.output_dtype, keep_full=batch_keep_full
  )

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    _check_masters(state)
    transform.check_outermost(state.tx, state.opt_state)
    scale = transform.loss_scale_of(state.opt_state)
    if cast_batch:
      batch = batch_policy.cast_to_compute(batch)
    view = masters.float32_view(state.params)  # float32 masters: as they are
    trained = _trained_part(view)
    compute_params = policy.cast_to_compute(view)
    with_state = state.model_state is not None
    model_state = policy.cast_to_compute(state.model_state) if with_state else None

    def call_loss_fn(params: Any, model_state: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
      out = loss_fn(params, model_state, batch) if with_state else loss_fn(params, batch)
      loss, rest = _split_aux(out, has_aux or with_state, with_state)
      if with_state and has_aux:
        new_model_state, aux = _split_aux(rest, True, with_state, what="the second element")
      else:
        new_model_state, aux = (rest, None) if with_state else (None, rest)
      return _check_loss(loss, has_aux or with_state).astype(jnp.float32), new_model_state, aux

    if axis_name is not None:
      call_loss_fn = _bind_axis_name(call_loss_fn, axis_name)

    def scaled_loss(
        trained_c: Any, model_state: Any
    ) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
      # Rebuilt here, so that objects in it (NNX variables, which remember the
      # trace they were made in) belong to this trace and can be mutated.
      model_state = jax.tree.map(lambda x: x, model_state)
      loss, new_model_state, aux = call_loss_fn(
          tree_utils.merge_floating(trained_c, compute_params), model_state, batch)
      return loss * scale, (loss, new_model_state, aux)

    # Gradients with respect to the compute-dtype copy are the same values as
    # with respect to the masters (the cast's transpose is an exact widening),
    # but half the bytes to hold until the skip is decided; the guard widens
    # them to the masters' dtype as it unscales.
    grads, (loss, new_model_state, aux) = jax.grad(scaled_loss, has_aux=True)(
        _trained_part(compute_params), model_state)
    kwargs = {"value": loss, **(extra_args(loss, aux, batch) if extra_args else {})}
    # float32 masters take the update inside the guard (one fused pass, and a
    # skipped step passes them through); bfloat16 masters round on write-back,
    # where an update of -0.0 leaves weight and compensation unchanged.
    lean = state.master_dtype == masters.BFLOAT16
    scaler = transform.scaling_update_of(state.tx)
    opt_state: optax.OptState
    if scaler is not None:
      # The scaler's own state: check_outermost found it at the root.
      scale_state = cast(transform.LossScaleState, state.opt_state)
      guard, opt_state = scaler.guarded(grads, scale_state, trained, apply=not lean, **kwargs)
    else:
      tx = optax.with_extra_args_support(state.tx)
      guard = skip.guarded_update(
          lambda g, s, p: tx.update(g, s, p, **kwargs),
          grads, state.opt_state, trained, inv_scale=None, value=loss, apply=not lean,
      )
      opt_state = guard.state
    if lean:
      new_trained, compensation = masters.apply_updates(
          _trained_part(state.params), cast(optax.Updates, guard.updates),  # apply=False
          rounding=state.rounding,
          key=_rounding_key(state), compensation=state.compensation,
      )
    else:
      new_trained, compensation = cast(optax.Params, guard.params), None  # apply=True
    new_state = state.replace(
        step=optax.safe_increment(state.step),
        params=tree_utils.merge_floating(new_trained, state.params),
        opt_state=opt_state,
        compensation=compensation,
    )
    finite, sumsq = guard.finite, guard.sumsq
    if with_state:
      new_model_state = _stored_like(new_model_state, state.model_state)
      new_state = new_state.replace(model_state=jax.lax.cond(
          finite, lambda: new_model_state, lambda: state.model_state))
    metrics = {"loss": loss, "grads_finite": finite, "loss_scale": scale,
               "grad_norm": jnp.sqrt(sumsq)}
    if has_aux:
      metrics["aux"] = aux
    if track_nonfinite:
      metrics["nonfinite"] = jax.tree.map(
          lambda g: jnp.zeros((), bool) if g is None else g,
          _nonfinite_leaves(grads, 1.0 / scale, trained),
          is_leaf=lambda x: x is None,
      )
    return new_state, metrics

  return _TrainStep(step, donate)

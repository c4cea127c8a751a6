"""jmp-compatible loss-scale objects, ``all_finite``, ``select_tree`` and the scale rule.

These match the public API and numerics of DeepMind's ``jmp`` and fix its known
bugs: ``min_loss_scale`` survives ``jit``, construction works under
``jax.eval_shape`` and ``lower().compile()``, a float16 scale can be adjusted,
growth stops at ``2**126`` (jmp's 2**127 unscales every gradient to 0), and bad
configuration is refused.

:func:`adjust_scale` is the one grow-or-back-off rule of the library:
``DynamicLossScale.adjust`` and the optax transformation both call it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jmp_lite._src import checks
from jmp_lite._src import tree_utils

T = TypeVar("T")


def adjust_scale(
    scale: jax.Array,
    finite: jax.Array,
    grow: jax.Array,
    *,
    growth_factor: Any,
    backed_off: jax.Array,
    floor: jax.Array,
) -> jax.Array:
  """The next loss scale: the one grow-or-back-off rule of the library::

    if finite:
      if grow: scale = scale * growth_factor, unless that overflows to inf
    else:
      scale = max(floor, backed_off)
    scale = min(scale, 2**126)

  ``grow`` (when the growth period is complete) and ``backed_off`` (jmp
  divides by its factor, GradScaler multiplies by its backoff factor) are the
  caller's. Everything is computed in ``scale``'s dtype. ``2**126`` is the
  largest scale whose reciprocal is a normal float32 (see
  :data:`checks.MAX_LOSS_SCALE`); it is above float16's range, so a float16
  scale is bounded by the overflow rule alone.
  """
  grown = scale * jnp.asarray(growth_factor, scale.dtype)
  grown = jnp.where(jnp.isfinite(grown), grown, scale)  # Like GradScaler and jmp.
  backed_off = jnp.maximum(floor.astype(scale.dtype), backed_off.astype(scale.dtype))
  new_scale = jnp.where(finite, jnp.where(grow, grown, scale), backed_off)
  cap = min(checks.MAX_LOSS_SCALE, float(jnp.finfo(scale.dtype).max))
  return jnp.minimum(new_scale, jnp.asarray(cap, scale.dtype))


def _multiply_leaves(tree: T, factor: Any) -> T:
  """Multiplies the floating and complex leaves of ``tree`` by ``factor``.

  A Python-number ``factor`` keeps each leaf's dtype (jmp's weak-typed
  ``x * loss_scale``). An array ``factor`` promotes as jmp's ``x * loss_scale``
  would under standard promotion (an f16 leaf times an f32 scale is f32), but
  explicitly, so that it also runs under ``jax_numpy_dtype_promotion='strict'``;
  float8 leaves, which have no implicit promotion, widen to float32 first.
  """
  if isinstance(factor, (int, float)):
    return tree_utils.map_inexact(lambda x: x * jnp.asarray(factor, x.dtype), tree)
  factor = jnp.asarray(factor)

  def mul(x: jax.Array) -> jax.Array:
    with jax.numpy_dtype_promotion("standard"):
      dtype = jnp.promote_types(tree_utils.wide_dtype(x.dtype) if x.dtype.itemsize == 1
                                else x.dtype, factor.dtype)
    return x.astype(dtype) * factor.astype(dtype)

  return tree_utils.map_inexact(mul, tree)


def all_finite(tree: Any) -> jax.Array:
  """A scalar bool array: True iff every floating or complex leaf of ``tree`` is finite.

  Other leaves are ignored; an empty tree or ``None`` gives True. A complex
  leaf is finite when both its parts are.

  Examples:
    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "n": jnp.int32(1)}))
    True
    >>> bool(all_finite([jnp.array([1.0, jnp.inf])]))
    False
    >>> bool(all_finite({"z": jnp.array([1 + 1j, complex(0, jnp.nan)])}))
    False
    >>> bool(all_finite(None))
    True
  """
  leaves = [x for x in jax.tree.leaves(tree) if tree_utils.is_inexact_array(x)]
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def _shape_and_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  return np.shape(x), jnp.result_type(x)


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
  """Selects ``a`` where ``pred`` is True and ``b`` otherwise, leaf by leaf.

  Like ``jax.lax.select`` (and jmp), nothing is broadcast or promoted: the
  two trees must match leaf for leaf in shape and dtype.

  Args:
    pred: a scalar bool (Python bool or shape-``()`` bool array).
    a: a pytree.
    b: a pytree with the same structure, shapes and dtypes as ``a``.

  Returns:
    ``a`` if ``pred`` else ``b``, computed without Python control flow.

  Raises:
    TypeError: if ``pred`` is not a bool, or two leaves differ in shape or
      dtype (the message names the leaf).
    ValueError: if ``pred`` is not a scalar, or the trees differ in structure.

  Examples:
    >>> import jax.numpy as jnp
    >>> select_tree(jnp.array(False), {"x": 1.0}, {"x": 2.0})["x"]
    Array(2., dtype=float32, weak_type=True)
  """
  pred = jnp.asarray(pred)
  if pred.dtype != jnp.bool_:
    raise TypeError(f"select_tree: pred must be a bool, got dtype {pred.dtype}")
  if pred.shape != ():
    raise ValueError(f"select_tree: pred must be a scalar, got shape {pred.shape}")

  def select(path: tree_utils.KeyPath, x: Any, y: Any) -> jax.Array:
    if _shape_and_dtype(x) != _shape_and_dtype(y):
      (xs, xd), (ys, yd) = _shape_and_dtype(x), _shape_and_dtype(y)
      raise TypeError(
          f"select_tree: leaf {tree_utils.path_str(path)!r} differs between a and b: "
          f"shape {xs} dtype {xd} vs shape {ys} dtype {yd}; the trees must match leaf "
          "for leaf (nothing is broadcast or promoted)"
      )
    return jax.lax.select(pred, jnp.asarray(x), jnp.asarray(y))

  return jax.tree_util.tree_map_with_path(select, a, b)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale that does nothing: scale 1, ``adjust`` returns ``self``.

  A pytree without leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> ls = NoOpLossScale()
    >>> ls.unscale(ls.scale(jnp.float32(3.0)))
    Array(3., dtype=float32)
  """

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: ArrayLike) -> "NoOpLossScale":
    del grads_finite
    return self


def _is_concrete(value: Any) -> bool:
  """A value whose number can be checked now: a Python or NumPy value, or a concrete array.

  Tracers (inside ``jit``, ``grad``, ``vmap``) and the placeholders that
  ``jax.eval_shape`` and pytree utilities pass (``ShapeDtypeStruct``,
  ``None``, sentinels) are not checked.
  """
  if isinstance(value, (bool, int, float, str, bytes, np.generic, np.ndarray)):
    return True
  return isinstance(value, jax.Array) and not checks.is_traced(value)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale. A pytree without leaves (the scale is static).

  A Python number scales each leaf in its own dtype, as jmp's weakly typed
  ``x * loss_scale`` does (an f16 tree stays f16). An array scale (a traced
  value under ``jit`` included) promotes like ``x * loss_scale``.

  Args:
    loss_scale: a finite number in ``[2**-126, 2**126]`` (stored as a Python
      float), or a scalar float array (kept as it is; checked like a number
      unless it is traced).

  Raises:
    TypeError: if ``loss_scale`` is a bool or not a number.
    ValueError: if a concrete ``loss_scale`` is not finite and > 0, or is
      outside ``[2**-126, 2**126]`` (its reciprocal would not be a normal
      float32: above 2**126, XLA flushes it to 0).

  Examples:
    >>> import jax.numpy as jnp
    >>> ls = StaticLossScale(128.0)
    >>> ls.scale(jnp.float32(2.0))
    Array(256., dtype=float32)
    >>> ls.scale(jnp.float16(2.0)).dtype
    dtype('float16')
    >>> ls.adjust(False) is ls
    True
  """

  loss_scale: ArrayLike

  def __post_init__(self) -> None:
    if isinstance(self.loss_scale, jax.Array):  # Kept: an array scale promotes.
      if not checks.is_traced(self.loss_scale):
        checks.loss_scale("loss_scale", self.loss_scale)
    else:
      object.__setattr__(self, "loss_scale", checks.loss_scale("loss_scale", self.loss_scale))

  def scale(self, tree: T) -> T:
    return _multiply_leaves(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    return _multiply_leaves(tree, 1 / self.loss_scale)

  def adjust(self, grads_finite: ArrayLike) -> "StaticLossScale":
    del grads_finite
    return self


def _float_leaf(value: Any, name: str, default_dtype: Any) -> Any:
  """A scale field: Python numbers become strong arrays; arrays are kept.

  Tracers, ``ShapeDtypeStruct``s (``jax.eval_shape``) and other objects pass
  through untouched. An integer scale works in float32 after jmp's warning.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a floating number, got {value!r}")
  dtype = getattr(value, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
    warnings.warn(f"Expected floating type for {name}, got {dtype}; using float32", stacklevel=4)
    return jnp.asarray(value, jnp.float32)
  if isinstance(value, (int, float)):
    return jnp.asarray(value, default_dtype)
  if isinstance(value, (np.generic, np.ndarray)):
    return jnp.asarray(value)
  return value


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows after ``period`` finite steps and backs off on overflow.

  ``loss_scale``, ``counter`` and ``min_loss_scale`` are pytree leaves; ``period``
  and ``factor`` are static. The update rule (``adjust``) is jmp's::

    if grads_finite:
      if counter == period - 1:
        loss_scale = loss_scale * factor   # kept if that would overflow to inf
      counter = (counter + 1) % period
    else:
      loss_scale = max(min_loss_scale, loss_scale / factor)
      counter = 0
    loss_scale = min(loss_scale, 2**126)   # jmp's scale reaches 2**127

  ``2**126`` is the largest scale whose reciprocal ``unscale`` can multiply
  by: ``1 / 2**127`` is a float32 subnormal, which XLA flushes to 0.

  Args:
    loss_scale: initial scale, a float scalar in ``[2**-126, 2**126]`` (Python
      numbers become float32; an integer scale warns, as jmp does, and
      becomes float32).
    counter: consecutive finite steps so far, an int >= 0 (int32).
    period: finite steps between growths, an int >= 1.
    factor: growth and backoff factor, a real number > 1.
    min_loss_scale: floor for the scale, finite, >= 0 and at most ``2**126``
      (in ``loss_scale``'s dtype).

  Every concrete value (Python and NumPy numbers, jax arrays) is validated
  when the object is built; only tracers are taken as given. A pytree rebuild
  (a ``jit`` output, ``jax.tree.map``) and :meth:`adjust` are not
  constructions and validate nothing, as in equinox: checking the output of a
  jitted step would wait for the device on every step.

  Raises:
    TypeError: for a non-number, a bool, or a fractional ``period``.
    ValueError: for an out-of-range value; the message names the argument.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float32(2.0**15), period=2)
    >>> ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
    >>> ls = ls.adjust(jnp.array(True))
    >>> float(ls.loss_scale), int(ls.counter)
    (65536.0, 0)
    >>> float(ls.adjust(jnp.array(False)).loss_scale)
    32768.0
  """

  # ArrayLike: what the constructor takes; __post_init__ stores arrays.
  loss_scale: ArrayLike
  counter: ArrayLike = 0
  period: int = dataclasses.field(default=2000, metadata=dict(static=True))
  factor: float = dataclasses.field(default=2, metadata=dict(static=True))
  min_loss_scale: ArrayLike = 1.0

  def __post_init__(self) -> None:
    if _is_concrete(self.loss_scale):
      checks.loss_scale("loss_scale", self.loss_scale)
    if _is_concrete(self.min_loss_scale):
      value = checks.real_number("min_loss_scale", self.min_loss_scale)
      if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"min_loss_scale must be finite and >= 0, got {self.min_loss_scale!r}")
      if value > checks.MAX_LOSS_SCALE:
        raise ValueError(
            f"min_loss_scale must be at most 2**126 (the largest usable loss scale), "
            f"got {self.min_loss_scale!r}"
        )
    if _is_concrete(self.counter):
      checks.integer("counter", self.counter, minimum=0)
    period = self.period
    if isinstance(period, (float, np.floating)) and float(period).is_integer():
      period = int(period)  # jmp accepts period=5.0.
    object.__setattr__(self, "period", checks.integer("period", period, minimum=1))
    factor = checks.real_number("factor", self.factor)
    if not (np.isfinite(factor) and factor > 1):
      raise ValueError(f"factor must be finite and > 1, got {self.factor!r}")
    object.__setattr__(self, "loss_scale", _float_leaf(self.loss_scale, "loss_scale", jnp.float32))
    scale_dtype = getattr(self.loss_scale, "dtype", jnp.float32)
    object.__setattr__(self, "counter", _counter_leaf(self.counter))
    object.__setattr__(
        self, "min_loss_scale", _float_leaf(self.min_loss_scale, "min_loss_scale", scale_dtype)
    )

  def scale(self, tree: T) -> T:
    return _multiply_leaves(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    return _multiply_leaves(tree, 1 / jnp.asarray(self.loss_scale))

  def adjust(self, grads_finite: ArrayLike) -> "DynamicLossScale":
    """Returns the loss scale for the next step (see the class docstring)."""
    grads_finite = jnp.asarray(grads_finite)
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    new_scale = adjust_scale(
        scale,
        grads_finite,
        counter == self.period - 1,
        growth_factor=self.factor,
        backed_off=scale / jnp.asarray(self.factor, scale.dtype),
        floor=jnp.asarray(self.min_loss_scale),
    )
    new_counter = jnp.where(grads_finite, (counter + 1) % self.period, jnp.zeros_like(counter))
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return _rebuild(DynamicLossScale, dict(fields, loss_scale=new_scale, counter=new_counter))


def _counter_leaf(value: Any) -> Any:
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return jnp.asarray(value, jnp.int32)
  return value


DataclassT = TypeVar("DataclassT")


def _rebuild(cls: type[DataclassT], fields: dict[str, Any]) -> DataclassT:
  """An instance of the frozen dataclass ``cls`` with ``fields``, without ``__init__``."""
  obj = object.__new__(cls)
  for name, value in fields.items():
    object.__setattr__(obj, name, value)
  return obj


def _register_unvalidated(cls: type) -> None:
  """Registers the dataclass ``cls`` as a pytree whose rebuild skips ``__post_init__``.

  Like ``jax.tree_util.register_dataclass``, the fields come from the class
  (those marked ``static`` are metadata, the others children, with
  ``GetAttrKey`` paths), but unflattening does not run ``__init__``: jit
  outputs, tree maps and checkpoint restores are rebuilds, not user input,
  and validating a concrete child would wait for the device.
  """
  fields = dataclasses.fields(cls)
  meta = tuple(f.name for f in fields if f.metadata.get("static", False))
  data = tuple(f.name for f in fields if not f.metadata.get("static", False))

  def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    children = [(jax.tree_util.GetAttrKey(name), getattr(obj, name)) for name in data]
    return children, tuple(getattr(obj, name) for name in meta)

  def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    return [getattr(obj, name) for name in data], tuple(getattr(obj, name) for name in meta)

  def unflatten(aux: tuple[Any, ...], children: Any) -> Any:
    return _rebuild(cls, {**dict(zip(meta, aux)), **dict(zip(data, children))})

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


_register_unvalidated(DynamicLossScale)
jax.tree_util.register_dataclass(NoOpLossScale)
jax.tree_util.register_dataclass(StaticLossScale, data_fields=[], meta_fields=["loss_scale"])

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]

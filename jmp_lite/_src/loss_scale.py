"""jmp-compatible loss-scale objects, ``all_finite`` and ``select_tree``.

These match the public API and numerics of DeepMind's ``jmp`` and fix its known
bugs: ``min_loss_scale`` survives ``jit``, construction works under
``jax.eval_shape`` and ``lower().compile()``, a float16 scale can be adjusted,
and growth never overflows to inf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jmp_lite._src import tree_utils

T = TypeVar("T")


def _scale_leaves(tree: T, factor: jax.Array) -> T:
  """Multiplies floating leaves by ``factor`` in their common promoted dtype.

  The promotion is explicit (as jmp's implicit ``x * loss_scale`` would be), so
  it also works with ``jax_numpy_dtype_promotion='strict'``.
  """

  def mul(x):
    dtype = jnp.promote_types(x.dtype, factor.dtype)
    return x.astype(dtype) * factor.astype(dtype)

  return tree_utils.map_floating(mul, tree)


def all_finite(tree: Any) -> jax.Array:
  """A scalar bool array: True iff every floating leaf of ``tree`` is finite.

  Non-floating leaves are ignored; an empty tree or ``None`` gives True.

  Examples:
    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "n": jnp.int32(1)}))
    True
    >>> bool(all_finite([jnp.array([1.0, jnp.inf])]))
    False
    >>> bool(all_finite(None))
    True
  """
  leaves = [x for x in jax.tree.leaves(tree) if tree_utils.is_floating_array(x)]
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
  """Selects ``a`` where ``pred`` is True and ``b`` otherwise, leaf by leaf.

  Args:
    pred: a scalar bool (Python bool or shape-``()`` bool array).
    a: a pytree.
    b: a pytree with the same structure, shapes and dtypes as ``a``.

  Returns:
    ``a`` if ``pred`` else ``b``, computed without Python control flow.

  Raises:
    TypeError: if ``pred`` is not a bool.
    ValueError: if ``pred`` is not a scalar.

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
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


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


def _check_positive_finite(name: str, value: float) -> None:
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be finite and > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale. A pytree without leaves (the scale is static).

  Args:
    loss_scale: a finite, positive number (stored as a Python float).

  Examples:
    >>> import jax.numpy as jnp
    >>> ls = StaticLossScale(128.0)
    >>> ls.scale(jnp.float32(2.0))
    Array(256., dtype=float32)
    >>> ls.adjust(False) is ls
    True
  """

  loss_scale: float

  def __post_init__(self):
    value = float(self.loss_scale)
    _check_positive_finite("loss_scale", value)
    object.__setattr__(self, "loss_scale", value)

  def scale(self, tree: T) -> T:
    return _scale_leaves(tree, jnp.asarray(self.loss_scale, jnp.float32))

  def unscale(self, tree: T) -> T:
    return _scale_leaves(tree, jnp.asarray(1.0 / self.loss_scale, jnp.float32))

  def adjust(self, grads_finite: ArrayLike) -> "StaticLossScale":
    del grads_finite
    return self


def _as_strong_array(value: Any, dtype) -> Any:
  """Python numbers become strongly typed arrays; anything else is kept.

  Pytree unflattening may pass tracers, ``ShapeDtypeStruct``s or sentinel
  objects, which must pass through ``__init__`` untouched.
  """
  if isinstance(value, (bool, int, float)):
    return jnp.asarray(value, dtype)
  return value


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows after ``period`` finite steps and backs off on overflow.

  ``loss_scale``, ``counter`` and ``min_loss_scale`` are pytree leaves; ``period``
  and ``factor`` are static. The update rule (``adjust``) is::

    if grads_finite:
      if counter == period - 1:
        loss_scale = loss_scale * factor   # kept if that would overflow to inf
        counter = 0
      else:
        counter = counter + 1
    else:
      loss_scale = max(min_loss_scale, loss_scale / factor)
      counter = 0

  Args:
    loss_scale: initial scale, a positive scalar (Python numbers become float32).
    counter: consecutive finite steps so far (int32).
    period: finite steps between growths, >= 1.
    factor: growth and backoff factor, > 1.
    min_loss_scale: floor for the scale.

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

  loss_scale: jax.Array
  counter: jax.Array = 0
  period: int = dataclasses.field(default=2000, metadata=dict(static=True))
  factor: float = dataclasses.field(default=2, metadata=dict(static=True))
  min_loss_scale: jax.Array = 1.0

  def __post_init__(self):
    scale_dtype = getattr(self.loss_scale, "dtype", jnp.float32)
    object.__setattr__(self, "loss_scale", _as_strong_array(self.loss_scale, jnp.float32))
    object.__setattr__(self, "counter", _as_strong_array(self.counter, jnp.int32))
    object.__setattr__(
        self, "min_loss_scale", _as_strong_array(self.min_loss_scale, scale_dtype)
    )
    if isinstance(self.period, (int, np.integer)) and self.period < 1:
      raise ValueError(f"period must be an integer >= 1, got {self.period!r}")
    if isinstance(self.factor, (int, float)) and not self.factor > 1:
      raise ValueError(f"factor must be > 1, got {self.factor!r}")

  def scale(self, tree: T) -> T:
    return _scale_leaves(tree, jnp.asarray(self.loss_scale))

  def unscale(self, tree: T) -> T:
    scale = jnp.asarray(self.loss_scale)
    return _scale_leaves(tree, 1 / scale)

  def adjust(self, grads_finite: ArrayLike) -> "DynamicLossScale":
    """Returns the loss scale for the next step (see the class docstring)."""
    grads_finite = jnp.asarray(grads_finite)
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    dtype = scale.dtype
    factor = jnp.asarray(self.factor, dtype)
    floor = jnp.asarray(self.min_loss_scale).astype(dtype)
    grown = scale * factor
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    at_period = counter == self.period - 1
    finite_scale = jnp.where(at_period, grown, scale)
    backed_off = jnp.maximum(floor, scale / factor)
    new_scale = jnp.where(grads_finite, finite_scale, backed_off)
    zero = jnp.zeros_like(counter)
    new_counter = jnp.where(grads_finite & ~at_period, counter + 1, zero)
    return dataclasses.replace(self, loss_scale=new_scale, counter=new_counter)


jax.tree_util.register_dataclass(
    DynamicLossScale,
    data_fields=["loss_scale", "counter", "min_loss_scale"],
    meta_fields=["period", "factor"],
)
jax.tree_util.register_dataclass(NoOpLossScale, data_fields=[], meta_fields=[])
jax.tree_util.register_dataclass(
    StaticLossScale, data_fields=[], meta_fields=["loss_scale"]
)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]

"""Lean master weights: bfloat16 params, updated in float32 and rounded back.

A bfloat16 weight ``w`` cannot take an update smaller than half its ulp
(``|w| * 2**-8`` to ``|w| * 2**-9``): round-to-nearest gives ``w`` back, and
training stalls. Two roundings keep the accuracy of float32 masters with
bfloat16 storage:

* ``"stochastic"``: round the float32 sum ``w + u`` up or down at random, up
  with probability equal to its distance from the lower neighbour in ulps.
  The expected result is ``w + u`` exactly, so small updates add up on
  average.
* ``"kahan"``: keep a bfloat16 compensation ``c`` per weight holding what the
  last rounding lost, and add it back into the next update.

``"nearest"`` is plain round-to-nearest-even: the baseline that stalls.

This module owns the rounding rules; :class:`jmp_lite.TrainState` stores the
lean params, the key and the compensation, and the train step calls
:func:`apply_updates`.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite._src import tree_utils

ROUNDINGS = ("nearest", "stochastic", "kahan")

FLOAT32 = np.dtype(jnp.float32)
BFLOAT16 = np.dtype(jnp.bfloat16)
MASTER_DTYPES = (FLOAT32, BFLOAT16)

_ROUNDING_MSG = "rounding must be one of {allowed}, got {value!r}"
_MASTER_DTYPE_MSG = (
    "master_dtype must be one of {allowed} (float32 also keeps float64 params "
    "as float64), got {value!r}"
)
_FLOAT16_MSG = (
    "master_dtype=float16 is not supported: float16's precision depends on the "
    "weights' scale. It has 3 more mantissa bits than bfloat16, but its 5-bit "
    "exponent makes every value below 2**-14 (6.1e-05) subnormal, with a fixed "
    "spacing of 2**-24 (6e-08): small weights (LayerScale-style or near-zero "
    "ones) lose their precision, and updates below 3e-08 vanish even with Kahan "
    "compensation, which then stalls (RMS error = the whole drift for weights "
    "~1e-4 with updates of 1e-8, where bfloat16 + Kahan is within 3%; python -m "
    "benchmarks.masters). bfloat16 has float32's exponent range, so it behaves "
    "the same at every scale, and its stochastic rounding is the exact "
    "truncation of a float32 bit pattern. Use master_dtype=jnp.bfloat16 with "
    "rounding='stochastic' or 'kahan'; float16 compute (policy "
    "'mixed_float16') works with either master dtype."
)
_NEEDS_LEAN_MSG = (
    "rounding={rounding!r} needs bfloat16 masters (master_dtype=jnp.bfloat16); "
    "float32 masters are updated exactly as optax.apply_updates does, so only "
    "rounding='nearest' is allowed with them. Allowed roundings: {allowed}"
)
_KEY_MSG = (
    "key must be a JAX PRNG key, such as jax.random.key(0) (or a legacy "
    "jax.random.PRNGKey(0)), got {what}"
)


def check_rounding(rounding: Any) -> str:
  """``rounding`` if it is one of :data:`ROUNDINGS`.

  Raises:
    TypeError: if ``rounding`` is not a string.
    ValueError: if it is not one of the allowed names.
  """
  if not isinstance(rounding, str):
    raise TypeError(_ROUNDING_MSG.format(allowed=ROUNDINGS, value=rounding))
  if rounding not in ROUNDINGS:
    raise ValueError(_ROUNDING_MSG.format(allowed=ROUNDINGS, value=rounding))
  return rounding


def check_master_dtype(master_dtype: Any) -> np.dtype:
  """``master_dtype`` as a NumPy dtype, if it is float32 or bfloat16.

  Raises:
    TypeError: if ``master_dtype`` is not a dtype.
    ValueError: for float16 (with the reason) and for any other dtype.
  """
  allowed = tuple(d.name for d in MASTER_DTYPES)
  if isinstance(master_dtype, (bool, int, float)) or master_dtype is None:
    raise TypeError(_MASTER_DTYPE_MSG.format(allowed=allowed, value=master_dtype))
  try:
    dtype = np.dtype(master_dtype)
  except TypeError as e:
    raise TypeError(_MASTER_DTYPE_MSG.format(allowed=allowed, value=master_dtype)) from e
  if dtype == np.float16:
    raise ValueError(_FLOAT16_MSG)
  if dtype not in MASTER_DTYPES:
    raise ValueError(_MASTER_DTYPE_MSG.format(allowed=allowed, value=master_dtype))
  return dtype


def check_config(master_dtype: np.dtype, rounding: str) -> None:
  """Refuses a rounding other than ``"nearest"`` with float32 masters (``ValueError``)."""
  if master_dtype != BFLOAT16 and rounding != "nearest":
    raise ValueError(_NEEDS_LEAN_MSG.format(rounding=rounding, allowed=ROUNDINGS))


def as_key(key: Any) -> jax.Array:
  """``key`` as a typed PRNG key scalar; a legacy ``uint32[2]`` key is wrapped.

  Raises:
    TypeError: for anything that is not a single PRNG key.
  """
  dtype = getattr(key, "dtype", None)
  shape = getattr(key, "shape", None)
  if dtype is None or isinstance(key, (bool, int, float)):
    raise TypeError(_KEY_MSG.format(what=repr(key)))
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise TypeError(_KEY_MSG.format(what=f"an array of {shape} keys"))
    return key
  if dtype == np.uint32 and shape == (2,):
    return jax.random.wrap_key_data(key)
  raise TypeError(_KEY_MSG.format(what=f"an array of shape {shape} dtype {dtype}"))


def is_lean(x: Any) -> bool:
  """True for a bfloat16 array: the leaves the roundings apply to."""
  return tree_utils.is_floating_array(x) and np.dtype(x.dtype) == BFLOAT16


# ------------------------------------------------------------ stochastic rounding


def _mix32(x: jax.Array) -> jax.Array:
  """A bijective 32-bit integer hash (Chris Wellons' ``lowbias32``)."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> 16)


def hashed_bits(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
  """Uniform ``uint32`` values, one per element of ``shape``: ``mix32(flat_index ^ seed)``.

  For a uniformly random ``seed`` (from ``jax.random.bits``, or itself a
  hash of a step and a leaf number), ``flat_index ^ seed`` is uniform for
  every element, and ``mix32`` is a bijection: each element's bits are
  exactly uniform and independent from one seed to the next, whatever the
  hash's quality. The hash decorrelates neighbouring elements that share a
  seed. It is a few integer ops per element, fused into the update: XLA:CPU's
  threefry costs more than the whole train step. The one counter-based hash
  of the library: stochastic rounding to bfloat16 here and of the 8-bit
  optimizer state (:mod:`jmp_lite._src.optim.codes`) both draw from it.
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    index = index + iota * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return _mix32(index ^ seed)


def _low_bits(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
  """Uniform ``uint32`` values in ``[0, 2**16)``: :func:`hashed_bits`' top 16 bits."""
  return hashed_bits(shape, seed) >> 16


def stochastic_round(x: jax.Array, seed: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to bfloat16, up or down with probabilities that make it unbiased.

  bfloat16 is the top 16 bits of float32. Adding 16 uniform random bits to the
  float32 bit pattern and dropping the low 16 bits rounds up exactly when the
  random bits reach past the discarded fraction::

    bits    = bitcast_u32(x)
    rounded = bitcast_bf16((bits + uniform[0, 2**16)) >> 16)

  so ``E[rounded] == x`` for every finite ``x`` (binade boundaries, subnormals
  and negative numbers included: the bit pattern is linear in the magnitude
  within each binade). Values that are already bfloat16 come back unchanged,
  ``-0.0`` included. A finite ``x`` never becomes inf: past bfloat16's
  largest value it is truncated towards zero instead. inf and NaN stay inf
  and NaN.

  Args:
    x: a float32 array.
    seed: a ``uint32`` scalar; use a fresh uniformly random one per call.

  Returns:
    A bfloat16 array of ``x``'s shape.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)

  def to_bf16(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type((b >> 16).astype(jnp.uint16), jnp.bfloat16)

  rounded = to_bf16(bits + _low_bits(x.shape, seed))
  truncated = to_bf16(bits)
  finite = jnp.where(jnp.isinf(rounded), truncated, rounded)
  return jnp.where(jnp.isfinite(x), finite, x.astype(jnp.bfloat16))


# ------------------------------------------------------------ Kahan-compensated update


def kahan_add(p: jax.Array, c: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(p', c')`` with ``p' + c' ≈ p + c + u``, all in float32 arithmetic.

  ::

    y  = c + u                      # the update plus what was lost last time
    p' = round_nearest(p + y)
    c' = round_nearest(y - (p' - p))   # p' - p is exact: both are bfloat16
    where u == 0: p', c' = p, c     # a zero (or skipped, -0.0) update changes nothing

  The last line makes a skipped step exact: re-rounding ``p + c`` alone could
  move ``p`` when ``|c|`` is half an ulp.
  """
  p32, c32, u32 = (a.astype(jnp.float32) for a in (p, c, u))
  y = c32 + u32
  new_p = (p32 + y).astype(p.dtype)
  new_c = (y - (new_p.astype(jnp.float32) - p32)).astype(c.dtype)
  keep = u32 == 0
  return jnp.where(keep, p, new_p), jnp.where(keep, c, new_c)


# ------------------------------------------------------------ trees


def _flatten(tree: Any) -> tuple[list[Any], Any]:
  return jax.tree.flatten(tree, is_leaf=lambda x: x is None)


def _paths(tree: Any) -> list[str]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
  return [tree_utils.path_str(p) for p, _ in flat]


def _flatten_like(treedef: Any, tree: Any, name: str) -> list[Any]:
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{name} must have the tree structure of params.\n  params: {treedef}\n"
        f"  {name}: {jax.tree.structure(tree, is_leaf=lambda x: x is None)}"
    ) from e


def check_compensation(params: Any, compensation: Any) -> list[Any]:
  """The compensation leaves lined up with ``params``' leaves, checked.

  ``compensation`` must have ``params``' tree structure (a ``None`` counts as
  a leaf). Where a param is bfloat16, its compensation must be a bfloat16
  array of the same shape; elsewhere it is not read.

  Raises:
    ValueError: for another structure, or a leaf of another shape or dtype.
  """
  flat_p, treedef = _flatten(params)
  flat_c = _flatten_like(treedef, compensation, "compensation")
  for path, p, c in zip(_paths(params), flat_p, flat_c):
    if not is_lean(p):
      continue
    if not (hasattr(c, "shape") and hasattr(c, "dtype")) or c.shape != p.shape or c.dtype != p.dtype:
      what = f"{c.dtype}{list(c.shape)}" if hasattr(c, "dtype") else repr(type(c))
      raise ValueError(
          f"compensation at {path!r} must be a bfloat16 array of the param's shape "
          f"{list(p.shape)}, got {what}; start from jax.tree.map(jnp.zeros_like, params)"
      )
  return flat_c


def zero_compensation(params: Any) -> Any:
  """bfloat16 zeros for each bfloat16 leaf (on its sharding), ``None`` elsewhere."""

  # zeros_like keeps the sharding, and the committedness: params placed on a
  # mesh get buffers on the same shards, uncommitted params uncommitted ones
  # (so that the first step sees the same signature as the next ones).
  return jax.tree.map(lambda p: jnp.zeros_like(p) if is_lean(p) else None, params)


def float32_view(params: Any) -> Any:
  """The float32 values the model and the optimizer see: bfloat16 leaves upcast.

  Other leaves come back as they are, so float32 masters pass through
  unchanged. With Kahan compensation the visible weight is the stored
  bfloat16 one, as in Kahan summation: the compensation only carries the
  rounding error into the next write-back.
  """
  return jax.tree.map(lambda p: p.astype(jnp.float32) if is_lean(p) else p, params)


def apply_updates(
    params: optax.Params,
    updates: optax.Updates,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    compensation: optax.Params | None = None,
) -> tuple[optax.Params, optax.Params | None]:
  """``optax.apply_updates`` for bfloat16 params, with a choice of rounding.

  For every bfloat16 leaf ``p`` the sum is formed in float32 and rounded back::

    nearest:     p' = bf16(f32(p) + f32(u))
    stochastic:  p' = stochastic_round(f32(p) + f32(u))     # unbiased
    kahan:       y  = f32(c) + f32(u)
                 p' = bf16(f32(p) + y);  c' = bf16(y - (f32(p') - f32(p)))
                 (p', c') = (p, c) where u == 0

  Leaves of other dtypes (float32, float64, complex) are updated as
  ``optax.apply_updates`` does; ``None`` leaves stay ``None``. A zero update,
  such as the ``-0.0`` of a step skipped by :func:`dynamic_loss_scaling`,
  leaves every leaf, and the compensation, unchanged bit for bit, whichever
  the rounding.

  Stochastic rounding draws one ``uint32`` seed per bfloat16 leaf from ``key``
  (``jax.random.bits``) and hashes it with each element's index into 16
  uniform bits: exactly uniform per element for any seed drawn from the key,
  and the same bits whatever the arrays' sharding. Like every JAX random
  function it consumes ``key``: pass a fresh one each step, e.g.
  ``jax.random.fold_in(key, step)``.

  Args:
    params: the params; the bfloat16 leaves are the lean masters.
    updates: updates with ``params``' structure (float32 from the optimizer).
    rounding: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
    key: a PRNG key, required for (and only for) ``"stochastic"``.
    compensation: required for (and only for) ``"kahan"``: a tree with
      ``params``' structure holding a bfloat16 array of the param's shape at
      each bfloat16 param; start from ``jax.tree.map(jnp.zeros_like, params)``.
      Other leaves are not read and come back as they are.

  Returns:
    ``(new_params, new_compensation)``, the same pair for every rounding:
    ``new_compensation`` is ``None`` unless ``rounding="kahan"``.

  Raises:
    TypeError: if ``rounding`` is not a string or ``key`` is not a PRNG key,
      or if a float16/float8 leaf would be rounded stochastically or with
      Kahan compensation (only bfloat16 is supported).
    ValueError: for an unknown ``rounding``, a missing or superfluous ``key``
      or ``compensation``, or ``updates``/``compensation`` whose structure,
      shapes or dtypes do not match ``params``.

  Examples:
    An update of 1e-3 is below half an ulp of 1.0 in bfloat16 (2**-8):

    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> params = {"w": jnp.ones(4096, jnp.bfloat16)}
    >>> updates = {"w": jnp.full(4096, 1e-3)}
    >>> p, _ = jmp.apply_updates(params, updates)                # round to nearest
    >>> float(p["w"].astype(jnp.float32).mean())                 # the update is lost
    1.0
    >>> p, _ = jmp.apply_updates(params, updates, rounding="stochastic", key=jax.random.key(0))
    >>> round(float(p["w"].astype(jnp.float32).mean()), 3)       # kept on average
    1.001
    >>> comp = jax.tree.map(jnp.zeros_like, params)
    >>> p, comp = jmp.apply_updates(params, updates, rounding="kahan", compensation=comp)
    >>> float(p["w"][0]), float(comp["w"][0])                    # kept in the compensation
    (1.0, 0.00099945068359375)
  """
  rounding = check_rounding(rounding)
  if rounding == "stochastic":
    if key is None:
      raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed)")
    key = as_key(key)
  elif key is not None:
    raise ValueError(f"key is only used with rounding='stochastic', got rounding={rounding!r}")
  if rounding == "kahan":
    if compensation is None:
      raise ValueError(
          "rounding='kahan' needs compensation=...: start from "
          "jax.tree.map(jnp.zeros_like, params) and pass back the one this function returns"
      )
  elif compensation is not None:
    raise ValueError(
        f"compensation is only used with rounding='kahan', got rounding={rounding!r}"
    )

  flat_p, treedef = _flatten(params)
  flat_u = _flatten_like(treedef, updates, "updates")
  kahan = rounding == "kahan"
  flat_c = check_compensation(params, compensation) if kahan else [None] * len(flat_p)
  if rounding != "nearest":
    for path, p in zip(_paths(params), flat_p):
      if tree_utils.is_floating_array(p) and jnp.finfo(p.dtype).bits < 32 and not is_lean(p):
        raise TypeError(
            f"rounding={rounding!r} supports bfloat16 params only, but {path!r} is "
            f"{p.dtype}; use rounding='nearest' for it, or bfloat16"
        )
  lean = [i for i, p in enumerate(flat_p) if is_lean(p)]
  seeds: dict[int, jax.Array] = {}
  if rounding == "stochastic" and lean:
    drawn = jax.random.bits(cast(jax.Array, key), (len(lean),), jnp.uint32)
    seeds = {i: drawn[n] for n, i in enumerate(lean)}

  new_p, new_c = list(flat_p), list(flat_c)
  for i, (p, u, c) in enumerate(zip(flat_p, flat_u, flat_c)):
    if p is None:
      continue
    if not is_lean(p):
      new_p[i] = jnp.asarray(p + u).astype(jnp.asarray(p).dtype)
    elif kahan:
      new_p[i], new_c[i] = kahan_add(p, c, u)
    else:
      total = p.astype(jnp.float32) + jnp.asarray(u).astype(jnp.float32)
      new_p[i] = total.astype(p.dtype) if rounding == "nearest" else stochastic_round(total, seeds[i])
  return treedef.unflatten(new_p), (treedef.unflatten(new_c) if kahan else None)

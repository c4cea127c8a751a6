"""Autocast: per-operation mixed precision for any JAX function, as a function transform.

``autocast(fun, dtype)`` traces ``fun`` to a jaxpr and evaluates that jaxpr
again, choosing each operation's precision from three public lists (the
half list, the float32 list and the promote list), as ``torch.autocast``
does per ATen op. Sub-jaxprs (``jit``, ``scan``, ``while``, ``cond``,
``checkpoint``, ``custom_jvp``/``custom_vjp``, ``shard_map``) are evaluated the
same way: a nested jit is re-bound with its evaluated jaxpr, the others
through JAX's public APIs (``jax.lax.scan``, ``jax.custom_vjp``, ...).

This module wires the parts together: the lists (:mod:`autocast_lists`), the
interpreter (:mod:`autocast_interpret`) and the handlers it dispatches
higher-order primitives to (:mod:`autocast_control`), registered here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, ParamSpec, TypeVar, Union

import jax
import numpy as np
from jax.typing import DTypeLike

from jmp_lite._src.autocast import control as autocast_control
from jmp_lite._src.autocast import fp8_rule as autocast_fp8
from jmp_lite._src.autocast import interpret as interp
from jmp_lite._src.autocast import lists as autocast_lists
from jmp_lite._src import filtering
from jmp_lite._src.fp8 import recipe as fp8_lib
from jmp_lite._src.fp8 import known as fp8_known
from jmp_lite._src.fp8 import plan as fp8_plan
from jmp_lite._src import tree_utils

T = TypeVar("T")
P = ParamSpec("P")

_DTYPE_MSG = "dtype must be jnp.float16 or jnp.bfloat16, got {value!r}"


def _register() -> None:
  """Gives the interpreter its handlers for higher-order primitives."""
  for name, (fn, params) in autocast_control.HANDLERS.items():
    interp.register_handler(name, fn, params, name in autocast_control.META_HANDLERS)
  interp.register_half_rule("dot_general", autocast_fp8.rule)
  interp.register_op_rule("gather", autocast_fp8.fp8_lookup_applies, autocast_fp8.lookup_rule)


_register()


class AutocastCall(NamedTuple):
  """What a function made by :func:`autocast` runs (its ``_jmp_autocast``), for the diagnostics."""

  fun: Callable[..., Any]
  dtype: np.dtype
  lists: autocast_lists.AutocastLists
  fp8: Union[fp8_lib.Float8Recipe, None]
  params_first: bool = False  # FP8 keep rules see argument 0's paths unprefixed (the step).

  def apply(self) -> Callable[..., Any]:
    """The autocast function this record describes, made anew."""
    cfg = interp._Config(self.dtype, self.lists, self.fp8)
    return _wrap(self.fun, cfg, self.params_first)


def check_dtype(dtype: Any) -> np.dtype:
  """``dtype`` as float16 or bfloat16, or autocast's error."""
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(_DTYPE_MSG.format(value=dtype)) from e
  if isinstance(dtype, bool) or dt not in interp.HALVES:
    raise ValueError(_DTYPE_MSG.format(value=dtype))
  return dt


def _as_float32(x: Any) -> Any:
  """A half leaf's type in float32 (``fun`` is traced as the float32 program); others as they are."""
  if interp.value_dtype(x) in interp.HALVES:
    return jax.typeof(x).update(dtype=interp.F32, weak_type=False)
  return x


def _trace(fun: Callable[[Any], Any], traced: Any, float32_program: bool = False) -> Any:
  """``fun``'s jaxpr with its arguments as given, or (if that fails) as the float32 program.

  A function whose half arguments meet float32 values it makes
  (``jax.random.normal`` noise) in an op that needs equal dtypes (Equinox's
  ``Conv2d``) does not trace with half params; it runs in float32, so it is
  traced with its half arguments as float32, and evaluated on the half ones.

  With ``float32_program`` (the step, whose params and batch the policy cast
  to half), the float32 program is traced first: its constants keep their
  float32 values (``var + 1e-8`` is not ``var + 0.0``, ``-1e9`` is not
  ``-inf``) for autocast's constant rule to see.
  """
  if float32_program and any(interp.value_dtype(x) in interp.HALVES
                             for x in jax.tree.leaves(traced)):
    try:
      return jax.make_jaxpr(fun)(jax.tree.map(_as_float32, traced))
    except TypeError:  # A program that only traces in half (it checks its dtypes).
      pass
  try:
    return jax.make_jaxpr(fun)(traced)
  except TypeError as error:
    if not any(interp.value_dtype(x) in interp.HALVES for x in jax.tree.leaves(traced)):
      raise
    try:
      return jax.make_jaxpr(fun)(jax.tree.map(_as_float32, traced))
    except Exception:  # Not a float32 program either: the error of the call as made.
      raise error from None


def autocast(
    fun: Callable[P, T],
    dtype: DTypeLike,
    *,
    lists: Union[autocast_lists.AutocastLists, None] = None,
    fp8: Union[bool, fp8_lib.Float8Recipe, None] = None,
) -> Callable[P, T]:
  """Runs ``fun`` with per-operation mixed precision, as ``torch.autocast`` does.

  Returns a function with ``fun``'s signature (positional and keyword
  arguments, any pytrees in and out). Each call traces ``fun`` to a jaxpr on
  its arguments (``jax.make_jaxpr``; if that fails with a ``TypeError``, as
  the float32 program: half arguments traced as float32) and evaluates that
  jaxpr again, op by op:

  * **half list** (matmuls and convolutions): floating inputs are cast to
    ``dtype``; the result is ``dtype``.
  * **float32 list** (exp, log, pow, rsqrt, sums and products, the scatters
    that sum: ``jax.ops.segment_sum``, ``x.at[i].add``, ...): half inputs are
    cast to float32; the result is float32. Softmax, logsumexp,
    the statistics of norms and variances, and cross-entropies are built from
    these and so run in float32.
  * **promote list** (everything else that computes in its inputs' dtype): a
    half *activation* (a half value as large as the result) keeps the result
    half unless a *strong* float32 operand is there (float32 data or a
    per-example statistic as large as the result, a raw sum, a value widened
    from another activation). Broadcast float32 biases, scales and
    statistics, constants, and values widened from the activation itself
    (a GELU's ``x**3``) do not widen it: the op computes in float32 if it
    reads one and rounds its result to ``dtype`` once, when it leaves its
    float32 region. So bias adds with float32 params, ``jax.nn``
    activations and LayerNorm/GroupNorm/RMSNorm/BatchNorm return the input's
    half dtype. Without an activation, the widest floating dtype among the
    inputs (constants do not count unless their value does not fit).
  * ``convert_element_type`` from float32 to float16 or bfloat16 of a
    statistic (``jnp.sum``/``jnp.mean``/``jnp.var`` of a half array
    accumulate in float32 and then narrow) or of a value autocast widened is
    **kept wide**: the sum of 100000 float16 ones is 100000.0, not inf, as
    torch's is. Of float32 data or a constant it is done as written, and so
    is every other convert; a widening convert of a half activation holds it
    exactly in float32 (returned so when the function returns it).
  * A constant that the half dtype changes (``1e-8`` becomes 0, ``-1e9``
    ``-inf``, ``1 - 1e-7`` 1), a literal or an array computed from
    literals (``jnp.where(mask, 0.0, -1e9)``), keeps the operation it meets
    in float32; and the element-wise chain that only feeds float32-list ops
    (``logits / 0.01`` before a ``log_softmax``) runs in float32 from the
    matmul that produced it, as does the chain a hazard reads (``p`` in
    ``clip(p, 1e-7, 1 - 1e-7)``, whatever else reads ``p``).
  * ``x * x`` (a ``mul`` of a value by itself) follows ``square``'s list.
  * Integer, bool and PRNG-key values are never touched; float64, float8 and
    complex values are never cast.
  * Anything else (callbacks, Pallas kernels, linear algebra, other scatters,
    primitives autocast does not know) runs in the dtypes of the traced
    program: inputs that autocast changed are cast back first.

  What runs in float32 is bound by connected regions, each under
  ``jax.checkpoint`` when it holds a float32 value as large as its largest
  input: the backward pass keeps the regions' half inputs and recomputes
  their float32 intermediates.

  ``jit``, ``closed_call``, ``scan``, ``while``/``fori_loop``, ``cond``/
  ``switch``, ``checkpoint``, ``custom_jvp``, ``custom_vjp`` and ``shard_map``
  bodies are evaluated the same way: a nested jit is re-bound with its
  evaluated jaxpr, the others through ``jax.lax.scan``/``while_loop``/
  ``switch``, ``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp`` and
  ``jax.shard_map``. A loop carry takes the widest dtype it has across
  iterations, and a ``cond`` output the widest across branches. Custom
  derivative rules are kept (``jax.grad`` of ``jax.nn.relu`` at 0 is still 0)
  and run under autocast too. Effects and sharding constraints are kept.

  The result composes with ``jax.grad`` (the backward pass runs in the
  precision chosen for each forward op; gradients with respect to float32
  inputs are float32), ``jax.vmap`` and ``jax.jit``. Outputs come back in the
  dtypes autocast computed them in (a loss from ``jnp.mean`` is float32, a
  model's logits half).

  Arguments: every leaf that is a ``jax.Array`` or NumPy array is traced;
  other leaves (Python numbers, functions, strings; an Equinox module's
  activation function) are static, as in ``eqx.filter_jit``.

  FP8: with ``fp8=True`` (the default :class:`Float8Recipe`) or a recipe,
  every ``dot_general`` of the half list runs on float8 operands with
  per-tensor current scaling (see the FP8 guide): both operands in
  ``recipe.forward`` (``float8_e4m3fn``), each with the scale of its own
  ``max|x|``, and in the backward pass the cotangent in ``recipe.backward``
  (``float8_e5m2``), so that both backward GEMMs are FP8 too. The product is
  ``dtype``. Convolutions and every other operation follow the lists as
  above. On GPUs with FP8 tensor cores XLA rewrites the quantise-dequantise
  pattern into FP8 GEMMs; other backends emulate it (slower than ``dtype``).

  Cost: each call traces ``fun`` once (under ``jax.jit``, once per
  compilation) and evaluates its jaxpr once; loops and conds are traced once
  more to settle their dtypes. A nested ``jax.jit`` function is evaluated once
  per input signature and cached.

  Args:
    fun: the function to run, e.g. a loss or ``model.apply``.
    dtype: the half dtype, ``jnp.float16`` or ``jnp.bfloat16``.
    lists: the op lists (default :class:`AutocastLists` ``()``).
    fp8: ``None``/``False`` (off), ``True`` (the default
      :class:`Float8Recipe`) or a :class:`Float8Recipe`: run the half-list
      matmuls in FP8 (by default those whose three GEMM sizes are all
      >= 4096, ``Float8Recipe.min_size``; smaller ones stay in ``dtype``).

  Returns:
    The autocast function.

  Raises:
    TypeError: if ``fun`` is not callable, ``dtype`` is not a dtype,
      ``lists`` is not an :class:`AutocastLists`, or ``fp8`` is not a bool,
      ``None`` or a :class:`Float8Recipe`.
    ValueError: if ``dtype`` is not float16 or bfloat16 (with ``fp8`` too:
      the float8 operands are dequantised to ``dtype``).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def loss(w, x):
    ...   logits = x @ w  # a matmul: float16
    ...   return jnp.mean(jnp.exp(logits)), logits
    >>> w, x = jnp.full((4, 4), 3.0, jnp.float16), jnp.ones((2, 4), jnp.float16)
    >>> loss(w, x)[0]  # exp(12) overflows float16
    Array(inf, dtype=float16)
    >>> mean, logits = jmp.autocast(loss, jnp.float16)(w, x)
    >>> mean.dtype, logits.dtype, round(float(mean))
    (dtype('float32'), dtype('float16'), 162755)
    >>> every = jmp.Float8Recipe(min_size=0)  # this 2x4x4 matmul too (fp8=True: >= 4096)
    >>> fp8_mean, fp8_logits = jmp.autocast(loss, jnp.float16, fp8=every)(w, x)
    >>> fp8_logits.dtype, round(float(fp8_mean))
    (dtype('float16'), 162755)
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}")
  lists = autocast_lists.AutocastLists() if lists is None else lists
  if not isinstance(lists, autocast_lists.AutocastLists):
    raise TypeError(f"lists must be a jmp_lite.AutocastLists, got {lists!r}")
  cfg = interp._Config(check_dtype(dtype), lists, fp8_lib.as_recipe(fp8))
  return _wrap(fun, cfg, params_first=False)


def step_autocast(fun: Callable[P, T], dtype: DTypeLike,
                  fp8: Union[fp8_lib.Float8Recipe, None]) -> Callable[P, T]:
  """:func:`autocast` as ``make_train_step`` applies it to ``loss_fn(params, ...)``.

  The same transform, with two differences. The paths that FP8 keep rules
  see: the first argument's leaves (the params) are named by their paths
  within it (``Dense_0/kernel``), as the policy's keep rules see them. And
  ``fun`` is traced as the float32 program the user wrote (the params and
  batch the policy cast to half traced as float32), then evaluated on the
  half values: a weight is in half where a matmul reads it, as torch casts
  it at the op, while every constant keeps the float32 value it was written
  with.
  """
  cfg = interp._Config(check_dtype(dtype), autocast_lists.AutocastLists(), fp8)
  return _wrap(fun, cfg, params_first=True)


def leaf_paths(args: tuple[Any, ...], kwargs: dict[str, Any], params_first: bool) -> list[str]:
  """The path of each traced leaf of ``(args, kwargs)``, as FP8 keep rules see it.

  Positional argument ``i``'s leaves begin with ``i/``, keyword argument
  ``name``'s with ``name/``; with ``params_first``, argument 0's leaves have
  no prefix.

  Examples:
    >>> import jax.numpy as jnp
    >>> leaf_paths(({"w": jnp.ones(1), "act": "relu"}, jnp.ones(2)), {"b": jnp.ones(1)}, False)
    ['0/w', '1', 'b']
    >>> leaf_paths(({"w": jnp.ones(1)}, {"x": jnp.ones(2)}), {}, True)
    ['w', '1/x']
  """
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    if not filtering.is_traced(leaf):
      continue
    where, *rest = path[1:]
    head = "" if (params_first and path[0].idx == 0 and where.idx == 0) else (
        str(where.idx) if path[0].idx == 0 else str(where.key))
    found.append("/".join(p for p in (head, tree_utils.path_str(tuple(rest))) if p))
  return found


def _wrap(fun: Callable[P, T], cfg: interp._Config, params_first: bool) -> Callable[P, T]:
  """``fun`` traced and evaluated under ``cfg`` on each call (see :func:`autocast`)."""

  @functools.wraps(fun)
  def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
    traced, spec = filtering.partition((args, kwargs))  # Static leaves: closed over.
    out: dict[str, Any] = {}

    def traced_fun(traced: list[Any]) -> list[Any]:
      a, k = filtering.combine(traced, spec)
      out_traced, out["spec"] = filtering.partition(fun(*a, **k))
      out["tree"] = jax.tree.structure(out_traced)
      return out_traced

    closed = _trace(traced_fun, traced, float32_program=params_first)
    leaves = jax.tree.leaves(traced)
    plan, amaxes = None, None
    if cfg.fp8 is not None:  # Which matmuls run in FP8: keep rules, sizes.
      paths = leaf_paths(args, kwargs, params_first)
      plan = fp8_plan.plan(closed.jaxpr, paths, leaves, cfg.fp8)
      if params_first:  # The weights' amaxes, before their gathers (issue 44).
        # The params' leaves only: the batch's rows are scaled where they are
        # (per device under FSDP, fp8_groups.groups_of), not by one global amax.
        n = sum(1 for leaf in jax.tree.leaves(args[0]) if filtering.is_traced(leaf)) if args else 0
        amaxes = fp8_known.given_amaxes()  # A train step's, from its state.
        if amaxes is None:
          amaxes = fp8_known.weight_amaxes(paths[:n], leaves[:n])
        if cfg.fp8.rowwise:  # Per row: over each weight operand's contracting axes.
          amaxes = {**amaxes, **fp8_known.row_amaxes(
              fp8_plan.row_needs(plan), dict(zip(paths[:n], leaves[:n])))}
    with fp8_plan.active(plan), fp8_known.known(amaxes):
      outs = interp.eval_closed(closed, leaves, cfg)
    return filtering.combine(jax.tree.unflatten(out["tree"], outs), out["spec"])

  wrapped._jmp_autocast = AutocastCall(  # type: ignore[attr-defined]
      fun, cfg.dtype, cfg.lists, cfg.fp8, params_first)
  return wrapped

"""Which matmul does FP8 hurt? One run per matmul, each alone in FP8 (issue 30).

:func:`fp8_sensitivity` runs a function and its gradient under autocast with
every matmul in the half dtype, then once per matmul with that matmul alone in
FP8, and reports what each costs: the relative error it adds to the output
and to the gradient of the weight it reads. The worst rows are the layers to
keep in half, and the report writes the keep rule that does it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_lite._src.autocast import autocast as autocast_lib
from jmp_lite._src import filtering
from jmp_lite._src.fp8 import plan as fp8_plan
from jmp_lite._src import jaxpr_utils
from jmp_lite._src import tree_utils
from jmp_lite._src.fp8.recipe import Float8Recipe


@dataclasses.dataclass(frozen=True)
class Float8SensitivityRow:
  """One matmul: where it is, its size, and the error FP8 adds when it alone runs in FP8.

  Attributes:
    index: its position among the function's matmuls (program order).
    name: its name-stack entry (``Dense_1``), or ``""``.
    paths: the argument leaves its operands come from (``0/params/Dense_1/kernel``).
    weight: the path whose gradient ``grad_error`` measures (one of ``paths``:
      a leaf of the first argument if it reads one), or ``None``.
    shape: ``(lhs free, contracting, rhs free, batch)`` sizes: an ``M x K x N`` GEMM, ``batch`` times.
    output_error: relative error (Frobenius, against the all-half run) of the output.
    grad_error: the same for the gradient of ``weight``, or ``None``.
  """

  index: int
  name: str
  paths: tuple[str, ...]
  weight: Union[str, None]
  shape: tuple[int, int, int, int]
  output_error: float
  grad_error: Union[float, None]

  @property
  def label(self) -> str:
    """The weight's path within its argument (``params/Dense_1/kernel``), or ``#index name``."""
    return _within_arg(self.weight) if self.weight else f"#{self.index} {self.name}".rstrip()

  @property
  def worst(self) -> float:
    """The larger of the two errors: what the rows are sorted by."""
    return max(self.output_error, self.grad_error or 0.0)


@dataclasses.dataclass(frozen=True)
class Float8Sensitivity:
  """What :func:`fp8_sensitivity` returns: one row per matmul, worst first.

  Attributes:
    rows: the :class:`Float8SensitivityRow` s, sorted by their larger error.
    dtype: the half dtype the other matmuls ran in.
    recipe: the FP8 recipe of the measured matmul.
  """

  rows: tuple[Float8SensitivityRow, ...]
  dtype: np.dtype
  recipe: Float8Recipe

  def keep_rule(self, k: int) -> str:
    """A regex keep rule that keeps the worst ``k`` matmuls (that read an argument) in half.

    The paths lose their argument position (``0/``), so the rule works in
    ``jmp.autocast(fn, ..., fp8=Float8Recipe(keep=rule))`` and in
    ``make_train_step(..., fp8=Float8Recipe(keep=rule))`` alike. A stacked
    (scanned) weight is kept whole.

    Raises:
      ValueError: ``k`` is not an int >= 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"k must be an int >= 1, got {k!r}")
    names = list(dict.fromkeys(_within_arg(r.weight) for r in self.rows if r.weight))[:k]
    return "(?:^|/)(?:" + "|".join(re.escape(n) for n in names) + ")$" if names else "(?!)"

  def __str__(self) -> str:
    head = (f"FP8 sensitivity ({np.dtype(self.recipe.forward).name} x "
            f"{np.dtype(self.recipe.backward).name}, {self.recipe.scaling}; the others in "
            f"{self.dtype.name}), worst first:")
    lines = [head, f"{'matmul':<{_WIDTH}} {'M x K x N':>18} {'output err':>10} {'grad err':>9}"]
    for r in self.rows:
      m, k, n, b = r.shape
      size = f"{m}x{k}x{n}" + (f" (x{b})" if b > 1 else "")
      grad = "-" if r.grad_error is None else f"{r.grad_error:.2e}"
      label = r.label if len(r.label) <= _WIDTH else "..." + r.label[3 - _WIDTH:]
      lines.append(f"{label:<{_WIDTH}} {size:>18} {r.output_error:>10.2e} {grad:>9}")
    return "\n".join(lines)


_WIDTH = 52  # The matmul column of the printed table; longer labels keep their end.


def _within_arg(path: str) -> str:
  """``0/params/Dense_1/kernel`` -> ``params/Dense_1/kernel``."""
  head, _, rest = path.partition("/")
  return rest if head.isdigit() and rest else path


def _rel(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
  num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b))
  den = sum(float(np.sum(y ** 2)) for y in b)
  return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def _matmuls(fn: Callable[..., Any], traced: list[Any], spec: Any,
             paths: list[str]) -> list[fp8_plan.Matmul]:
  """The floating matmuls of ``fn``, numbered as autocast's plan numbers them."""

  def traced_fun(leaves: list[Any]) -> Any:
    return filtering.partition(fn(*filtering.combine(leaves, spec)))[0]

  jaxpr = jax.make_jaxpr(traced_fun)(traced).jaxpr
  return [m for eqn, m in fp8_plan.matmuls(jaxpr, paths)
          if all(jaxpr_utils.is_floating(jaxpr_utils.dtype_of(v)) for v in eqn.invars[:2])]


def _weight(m: fp8_plan.Matmul) -> Union[str, None]:
  """The path whose gradient a row reports: the first argument's (the params) if read."""
  first = [p for p in m.paths if p.split("/", 1)[0] == "0"]
  return (first or list(m.paths) or [None])[0]  # type: ignore[list-item]


Runner = Callable[[int], tuple[Any, Any]]


def _runner(fn: Callable[..., Any], args: tuple[Any, ...], dtype: np.dtype,
            recipe: Float8Recipe) -> tuple[Runner, list[int]]:
  """``run(which)``: the output leaves and the gradient of every floating argument leaf.

  One program, compiled once: every matmul computes its FP8 and its half
  product, and the traced ``which`` picks the FP8 one for matmul ``which``
  only (``-1``: none).
  """
  traced, spec = filtering.partition(args)
  floating = [i for i, x in enumerate(traced) if tree_utils.is_floating_array(x)]
  f = autocast_lib.autocast(fn, dtype, fp8=recipe)

  def call(values: list[Any]) -> list[Any]:
    leaves = list(traced)
    for i, v in zip(floating, values):
      leaves[i] = v
    out = f(*filtering.combine(leaves, spec))
    return [x for x in jax.tree.leaves(out) if tree_utils.is_floating_array(x)]

  @jax.jit
  def outputs_and_grads(values: list[Any], which: jax.Array) -> tuple[Any, Any]:
    with fp8_plan.choosing(which):  # Read by autocast's plan as it traces.
      out, vjp = jax.vjp(call, values)
      # A scalar output (a loss) is differentiated as it is; others along fixed
      # random directions, the same in every run.
      keys = jax.random.split(jax.random.key(0), len(out))
      cts = [jnp.ones_like(o) if o.shape == () else
             jax.random.normal(k, o.shape).astype(o.dtype) for k, o in zip(keys, out)]
      return out, vjp(cts)[0]

  values = [traced[i] for i in floating]

  def run(which: int) -> tuple[Any, Any]:
    out, grads = outputs_and_grads(values, jnp.int32(which))
    return [np.asarray(x, np.float64) for x in out], [np.asarray(x, np.float64) for x in grads]

  return run, floating


def fp8_sensitivity(fn: Callable[..., Any], *args: Any, dtype: DTypeLike = jnp.bfloat16,
                    recipe: Union[Float8Recipe, None] = None) -> Float8Sensitivity:
  """Ranks ``fn``'s matmuls by the error FP8 adds to each: the layer FP8 hurts comes first.

  ``fn(*args)`` and its gradient (with respect to every floating leaf of
  ``args``; a non-scalar output is differentiated along fixed random
  directions) run once under :func:`autocast` with every matmul in
  ``dtype``, then once per matmul with that matmul alone in FP8 (``recipe``'s
  formats and scaling; its keep rules and ``min_size`` are not applied, so
  that every matmul gets a row). Each row gives the matmul's argument paths
  (as FP8 keep rules see them under :func:`autocast`: ``0/params/Dense_1/kernel``)
  or its position and name, its sizes, and the relative error the FP8 run
  adds to the output and to the gradient of the weight it reads. It compiles
  once: every matmul computes both its half and its FP8 product and a run-time
  index picks which one is used, so a run costs about twice the matmul work
  of ``fn`` and its gradient.

  Args:
    fn: the function, e.g. a loss ``loss_fn(params, batch)`` or ``model.apply``.
    *args: its arguments (any pytrees; non-array leaves are static).
    dtype: the half dtype, ``jnp.bfloat16`` (default) or ``jnp.float16``.
    recipe: the :class:`Float8Recipe` of the measured matmul (default ``Float8Recipe()``).

  Returns:
    A :class:`Float8Sensitivity`: print it for a table; ``.keep_rule(k)``
    keeps its worst ``k`` matmuls in half.

  Raises:
    TypeError: ``fn`` is not callable or ``recipe`` is not a :class:`Float8Recipe`.
    ValueError: ``dtype`` is not float16 or bfloat16, or ``fn`` has no matmul.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> def loss(p, x):
    ...   return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> p = {"w1": jax.random.normal(k1, (32, 64)), "w2": jax.random.normal(k2, (64, 16))}
    >>> x = jax.random.normal(k3, (128, 32)).at[:, 3].multiply(1e5)  # hostile to w1's matmul
    >>> report = jmp.fp8_sensitivity(loss, p, x)
    >>> [r.weight for r in report.rows], report.keep_rule(1)
    (['0/w1', '0/w2'], '(?:^|/)(?:w1)$')
  """
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  recipe = Float8Recipe() if recipe is None else recipe
  if not isinstance(recipe, Float8Recipe):
    raise TypeError(f"recipe must be a jmp_lite.Float8Recipe or None, got {recipe!r}")
  dtype = autocast_lib.check_dtype(dtype)
  recipe = dataclasses.replace(recipe, keep=(), min_size=0)
  traced, spec = filtering.partition(args)
  positions = [i for i, x in enumerate(traced) if x is not None]
  paths = dict(zip(positions, autocast_lib.leaf_paths(args, {}, False)))
  found = _matmuls(fn, traced, spec, [paths[i] for i in positions])
  if not found:
    raise ValueError("fn has no floating matmul (dot_general) for FP8 to run")
  run, floating = _runner(fn, args, dtype, recipe)
  grad_index = {paths[i]: k for k, i in enumerate(floating)}
  ref_out, ref_grads = run(-1)
  rows = []
  for m in found:
    out, grads = run(m.index)
    weight = _weight(m)
    g = grad_index.get(weight) if weight else None
    rows.append(Float8SensitivityRow(
        m.index, m.name, m.paths, weight, m.shape, _rel(out, ref_out),
        None if g is None else _rel([grads[g]], [ref_grads[g]])))
  rows.sort(key=lambda r: -r.worst)
  return Float8Sensitivity(tuple(rows), dtype, recipe)

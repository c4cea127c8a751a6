"""Precision policies and pytree casting (a drop-in for ``jmp``'s policy layer)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import warnings
from typing import Any, Callable, Iterable, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jmp_lite._src import tree_utils

T = TypeVar("T")

KeepRule = Union[str, Callable[[str, Any], bool]]

# Names that ``get_policy`` understands for a dtype, and the canonical short
# name that ``str(policy)`` writes for each dtype.
DTYPE_NAMES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
}
SHORT_NAMES = {
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.float64): "f64",
}
_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
_KERAS_NAMES = {
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
}
_ALLOWED_DTYPES_MSG = (
    "allowed dtype names: " + ", ".join(sorted([*DTYPE_NAMES, "half"]))
    + ", or a full floating dtype name such as float8_e4m3fn"
)
_ALLOWED_KEYS_MSG = "allowed keys: " + ", ".join(sorted(_KEYS))
_GRAMMAR_MSG = (
    "a policy is a dtype name (e.g. 'bf16'), a Keras name "
    f"({', '.join(sorted(_KERAS_NAMES))}), or comma-separated key=value pairs "
    "(e.g. 'p=f32,c=bf16,o=f32')"
)


def half_dtype() -> jnp.dtype:
  """The half-precision dtype for the default backend: bf16 on TPU, f16 elsewhere.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> half_dtype() == (jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)
    True
  """
  return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def _is_jax_float(d: np.dtype) -> bool:
  """A real floating dtype that JAX has arrays of (float128 is not one)."""
  return bool(jnp.issubdtype(d, jnp.floating)) and d.itemsize <= 8


def normalize_dtype(dtype: DTypeLike, what: str) -> np.dtype:
  """``dtype`` as a numpy dtype, or a ``TypeError`` naming ``what``."""
  if dtype is None:  # jnp.dtype(None) is float64.
    raise TypeError(f"{what} must be a floating dtype (e.g. float32, bfloat16, float16), got None")
  try:
    d = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{what} must be a floating dtype, got {dtype!r}") from e
  if not _is_jax_float(d):
    raise TypeError(
        f"{what} must be a floating dtype (e.g. float32, bfloat16, float16), "
        f"got {dtype!r}"
    )
  return d


def compile_rule(rule: KeepRule) -> Callable[[str, Any], bool]:
  """A keep rule as a predicate ``(path, leaf) -> bool``, or a clear error.

  Raises:
    ValueError: a string that is not a valid regular expression.
    TypeError: a rule that is neither a string nor a callable.
  """
  if isinstance(rule, str):
    try:
      pattern = re.compile(rule)
    except re.error as e:
      raise ValueError(f"keep rule {rule!r} is not a valid regular expression: {e}") from e
    return lambda path, leaf: pattern.search(path) is not None
  if callable(rule):
    _check_arity(rule)
    return rule
  raise TypeError(
      f"a keep rule must be a regex string or a callable (path, leaf) -> bool, got {rule!r}"
  )


def _check_arity(rule: Callable[..., Any]) -> None:
  """A ``TypeError`` naming ``(path: str, leaf) -> bool`` if ``rule`` cannot take two arguments."""
  try:
    signature = inspect.signature(rule)
  except (TypeError, ValueError):  # A builtin without a signature: checked when it is called.
    return
  try:
    signature.bind("path", None)
  except TypeError as e:
    raise TypeError(f"a keep rule callable must take (path: str, leaf) -> bool, two arguments; "
                    f"{getattr(rule, '__name__', rule)!r} has the signature {signature}") from e


def keep_rules(rules: KeepRule | Iterable[KeepRule]) -> tuple[KeepRule, ...]:
  """One rule or several as a tuple, each validated (see :func:`compile_rule`).

  Examples:
    >>> keep_rules("norm"), keep_rules(["a", "b"])
    (('norm',), ('a', 'b'))
  """
  if isinstance(rules, str) or callable(rules):
    rules = (rules,)
  try:
    rules = tuple(rules)
  except TypeError:
    compile_rule(rules)  # type: ignore[arg-type]  # Raises the rule's own TypeError.
    raise
  for rule in rules:
    compile_rule(rule)  # Validates eagerly.
  return rules


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
  """Which dtype parameters, computation and outputs use.

  ``Policy`` is a frozen, hashable dataclass, so it can be a static argument to
  ``jax.jit``. Dtypes are normalised with ``jnp.dtype``, so ``np.float16``,
  ``jnp.float16`` and ``"float16"`` give equal policies.

  Casting rules: only floating arrays (``jax.Array``, ``np.ndarray`` and numpy
  floating scalars) are cast. Integer, bool and PRNG-key leaves, Python
  objects and ``None`` are returned unchanged (the same object).

  Keep rules: ``keep_full`` holds rules that select leaves to stay in float32
  under every cast of this policy (normalisation scales, for example). A rule is
  a regular expression, matched with ``re.search`` against the leaf's
  ``/``-joined key path (``"params/LayerNorm_0/scale"``), or a callable
  ``(path, leaf) -> bool``. Keep rules are not part of ``str(policy)``.

  Args:
    param_dtype: dtype of the stored parameters.
    compute_dtype: dtype that parameters and inputs are cast to for compute.
    output_dtype: dtype that outputs are cast to.
    keep_full: rules for leaves kept in float32 (see above).

  Examples:
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> policy = jmp.get_policy("p=f32,c=bf16,o=f32").with_keep_full("norm")
    >>> params = {"dense": jnp.ones(2), "norm": jnp.ones(2), "step": jnp.int32(3)}
    >>> cast = policy.cast_to_compute(params)
    >>> cast["dense"].dtype, cast["norm"].dtype, cast["step"].dtype
    (dtype(bfloat16), dtype('float32'), dtype('int32'))
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  keep_full: tuple[KeepRule, ...] = ()

  # Written out (init=False) so that it takes any DTypeLike and stores np.dtype.
  def __init__(
      self,
      param_dtype: DTypeLike,
      compute_dtype: DTypeLike,
      output_dtype: DTypeLike,
      keep_full: KeepRule | Iterable[KeepRule] = (),
  ) -> None:
    for name, value in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype),
                        ("output_dtype", output_dtype)):
      object.__setattr__(self, name, normalize_dtype(value, name))
    object.__setattr__(self, "keep_full", keep_rules(keep_full))

  def _cast(self, tree: T, dtype: np.dtype) -> T:
    if not self.keep_full:
      return tree_utils.cast_floating(tree, dtype)
    rules = [compile_rule(r) for r in self.keep_full]
    full = np.dtype(jnp.float32)

    def cast(path: tree_utils.KeyPath, x: Any) -> Any:
      if not tree_utils.is_floating_array(x):
        return x
      name = tree_utils.path_str(path)
      target = full if any(rule(name, x) for rule in rules) else dtype
      return x if x.dtype == target else x.astype(target)

    return jax.tree_util.tree_map_with_path(cast, tree)

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``param_dtype``."""
    return self._cast(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return self._cast(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return self._cast(tree, self.output_dtype)

  def with_param_dtype(self, param_dtype: DTypeLike) -> "Policy":
    """A copy of this policy with another ``param_dtype``."""
    return type(self)(param_dtype, self.compute_dtype, self.output_dtype, self.keep_full)

  def with_compute_dtype(self, compute_dtype: DTypeLike) -> "Policy":
    """A copy of this policy with another ``compute_dtype``."""
    return type(self)(self.param_dtype, compute_dtype, self.output_dtype, self.keep_full)

  def with_output_dtype(self, output_dtype: DTypeLike) -> "Policy":
    """A copy of this policy with another ``output_dtype``."""
    return type(self)(self.param_dtype, self.compute_dtype, output_dtype, self.keep_full)

  def with_keep_full(self, *rules: KeepRule) -> "Policy":
    """A copy of this policy that also keeps leaves matching ``rules`` in float32."""
    return dataclasses.replace(self, keep_full=self.keep_full + rules)

  def __str__(self) -> str:
    return ",".join(
        f"{key}={SHORT_NAMES.get(d, d.name)}"
        for key, d in (
            ("p", self.param_dtype),
            ("c", self.compute_dtype),
            ("o", self.output_dtype),
        )
    )


_UNMATCHED_MSG = (
    "keep rule {rule} of {where} selects no {what}, so it keeps "
    "{keeps}.{hint} The {candidates} are, e.g.: {paths}"
)
_SNAKE_CASE_HINT = (
    " NNX (and Equinox) names are snake_case attribute names (e.g. 'batch_norm' or "
    "'bn' rather than 'BatchNorm'); Flax linen names are 'BatchNorm_0'."
)


def _rule_name(rule: KeepRule) -> str:
  if isinstance(rule, str):
    return repr(rule)
  name = getattr(rule, "__qualname__", None)
  return name if isinstance(name, str) else repr(rule)[:60]


def warn_unmatched_keep_rules(rules: tuple[KeepRule, ...], trees: dict[str, Any], where: str) -> None:
  """Warns (``UserWarning``) for each keep rule that selects no floating leaf of ``trees``.

  A rule that matches nothing is almost always a misspelt or mis-cased name
  (``"BatchNorm"`` on NNX's ``batch_norm``): without the warning, the leaves
  it was meant for are silently cast. Rules see each leaf's path inside its
  own tree, as the casts do.

  Args:
    rules: the keep rules.
    trees: the trees the rules apply to, by name (``{"params": ..., ...}``).
    where: what the rules belong to, for the message (``"the policy"``).
  """
  leaves = [(tree_utils.path_str(p), x)
            for tree in trees.values() if tree is not None
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if tree_utils.is_floating_array(x)]
  warn_unmatched(rules, leaves, where, "floating leaf of " + " or ".join(trees),
                 "nothing in float32", "floating leaves")


def warn_unmatched(rules: Iterable[KeepRule], leaves: list[tuple[str, Any]], where: str,
                   what: str, keeps: str, candidates: str) -> None:
  """Warns for each rule that selects none of ``leaves`` (``(path, leaf)`` pairs).

  Args:
    rules: the keep rules.
    leaves: the candidates, as ``(path, leaf)``.
    where: what the rules belong to, for the message.
    what: what a rule selects none of, for the message (singular).
    keeps: what an unmatched rule keeps, for the message.
    candidates: what the candidates are, for the message (plural).
  """
  for rule in rules:
    compiled = compile_rule(rule)
    if any(compiled(name, x) for name, x in leaves):
      continue
    hint = ""
    if isinstance(rule, str) and rule != rule.lower():
      near = [n for n, _ in leaves if re.search(rule, n.replace("_", ""), re.IGNORECASE)][:3]
      hint = (f" It matches {near} ignoring case and underscores." if near else "")
      hint += _SNAKE_CASE_HINT
    paths = ", ".join(repr(n) for n, _ in leaves[:5]) or "none"
    warnings.warn(_UNMATCHED_MSG.format(
        rule=_rule_name(rule), where=where, what=what, hint=hint, keeps=keeps,
        candidates=candidates, paths=paths + (", ..." if len(leaves) > 5 else "")),
        UserWarning, stacklevel=3)


def _suggestion(name: str, whole: bool) -> str:
  """``"; did you mean ...?"`` from the closest valid names, or ``""``."""
  candidates = [*DTYPE_NAMES, "half"] + (list(_KERAS_NAMES) if whole else [])
  close = difflib.get_close_matches(name.strip().lower(), candidates, n=3, cutoff=0.6)
  return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _parse_dtype(name: str, context: str) -> np.dtype:
  key = name.strip().lower()
  if key == "half":
    return half_dtype()
  if key in DTYPE_NAMES:
    return np.dtype(DTYPE_NAMES[key])
  # Any other floating dtype JAX supports, by its full name, e.g.
  # "float8_e4m3fn". Numpy's type codes ("f8" is float64, "e", "d"), dtypes JAX
  # has no arrays of (float128) and anything numpy's parser chokes on are not
  # accepted.
  if re.fullmatch(r"[a-z][a-z0-9_]*", key):
    try:
      # numpy warns for deprecated aliases ("a" is bytes); any such name is
      # refused below, so the warning is noise to the user.
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = jnp.dtype(key)
    except (TypeError, ValueError, SyntaxError):
      d = None
    if d is not None and d.name == key and _is_jax_float(d):
      return d
  whole = context.strip() == name.strip()
  raise ValueError(
      f"Unknown dtype {name!r} in policy {context!r}{_suggestion(name, whole)}; "
      f"{_ALLOWED_DTYPES_MSG}" + (f"; {_GRAMMAR_MSG}" if whole else "")
  )


def get_policy(name: str) -> Policy:
  """Parses a policy string.

  Grammar: a bare dtype name (all three dtypes equal), a Keras name
  (``"mixed_float16"``, ``"mixed_bfloat16"``), or comma-separated ``key=value``
  pairs with keys ``p``/``params``, ``c``/``compute``, ``o``/``output``. An
  unspecified ``params`` defaults to f32, ``compute`` follows params and
  ``output`` follows compute. Names are case-insensitive.

  Args:
    name: the policy string.

  Returns:
    The parsed ``Policy``.

  Raises:
    ValueError: for a malformed string. The message quotes the offending part.
    TypeError: if ``name`` is not a string.

  Examples:
    >>> import jmp_lite as jmp
    >>> str(jmp.get_policy("c=bf16"))
    'p=f32,c=bf16,o=bf16'
    >>> jmp.get_policy("mixed_float16") == jmp.get_policy("p=f32,c=f16,o=f32")
    True
  """
  if not isinstance(name, str):
    raise TypeError(f"get_policy expects a string, got {name!r}; {_GRAMMAR_MSG}")
  text = _KERAS_NAMES.get(name.strip().lower(), name)
  if not text.strip():
    raise ValueError(f"empty policy string {name!r}; {_GRAMMAR_MSG}")
  if "=" not in text:
    d = _parse_dtype(text, name)
    return Policy(d, d, d)
  given = {}
  for part in text.split(","):
    pieces = part.split("=")
    if len(pieces) != 2:
      raise ValueError(
          f"malformed part {part!r} in policy {name!r}: expected exactly one "
          f"'key=value'; {_GRAMMAR_MSG}"
      )
    key, value = (p.strip() for p in pieces)
    field = _KEYS.get(key.lower())
    if field is None:
      raise ValueError(f"unknown key {key!r} in policy {name!r}; {_ALLOWED_KEYS_MSG}")
    if field in given:
      raise ValueError(f"key {key!r} is given twice in policy {name!r}")
    if not value:
      raise ValueError(f"empty value for key {key!r} in policy {name!r}; {_ALLOWED_DTYPES_MSG}")
    given[field] = _parse_dtype(value, name)
  param = given.get("param_dtype", np.dtype(jnp.float32))
  compute = given.get("compute_dtype", param)
  output = given.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> cast_to_full({"w": jnp.ones(2, jnp.bfloat16), "n": 3})["w"].dtype
    dtype('float32')
  """
  return tree_utils.cast_floating(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to :func:`half_dtype`.

  Examples:
    >>> import jax.numpy as jnp
    >>> cast_to_half(jnp.ones(2)).dtype == half_dtype()
    True
  """
  return tree_utils.cast_floating(tree, half_dtype())

"""Every public function of ``jax.nn`` and ``optax.losses`` differentiates under autocast.

A corpus, not a list of the functions we thought of: the functions are found
with ``dir()`` and ``inspect`` (:func:`public_functions`), so a function a new
release adds is tested (or fails here, naming it) without an edit. Each is
applied to a matmul's output (``x @ w``) with its other arguments made from
its signature (:data:`SIGNATURES`, keyed by the names of its required
parameters, not by the function), its outputs reduced to a scalar inside the
function that autocast runs, and ``jax.grad`` with respect to ``w`` is taken
in bfloat16, float16 and FP8 (every matmul, ``min_size=0``). Each gradient is
finite and matches float32's within the tolerances of ``test_hazards.py``;
FP8's matches float32's with the matmul's operands rounded to e4m3 as FP8
rounds them (a forward error of 4% moves relu's kink for the activations
near 0, which no tolerance on the gradient would stand), within the
tolerance of ``test_autocast_fp8.py`` for its e5m2 cotangent.

The gradients run eagerly: the per-operation compilations are shared by the
whole corpus, where one ``jit`` per function and mode compiled 260 programs.

Until ``59de479`` was fixed, ``softplus``, ``log_sigmoid``, ``mish`` and every
loss built on them (sigmoid cross-entropy, focal, GAN losses) crashed here:
autocast re-bound their ``custom_jvp`` with a float32 JVP while the primal
stayed half.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp

F16, BF16 = jnp.float16, jnp.bfloat16
MODULES = (jax.nn, optax.losses)
# The tolerances of test_hazards.py (relative, here on the gradient's norm). FP8's
# (against float32 on e4m3 operands) is the e5m2 cotangent's: 2 mantissa bits,
# about 7% RMS per element; test_autocast_fp8.py allows 9% where the weight
# gradient contracts 64 rows, this one contracts 8 (ctc_loss measured 9.7%).
TOL = {"bfloat16": 0.05, "float16": 0.02, "fp8": 0.12}
FP8 = jmp.Float8Recipe(min_size=0)
# Functions evaluated at their second input (see _INPUTS), each with why: at the first, a
# kink lies within rounding of the point, and any precision under float32 may cross it
# (test_each_moved_function_has_a_kink_within_rounding_at_the_first_input keeps it true).
AT_SECOND_INPUT = {
    "optax.losses.triplet_margin_loss": "one of its 8 hinges, max(d(a, p) - d(a, n) + 1, 0), "
                                        "is 0.0009 from its kink, a tenth of a bfloat16 ulp of "
                                        "the distances; FP8 crossed it (27% off float32)",
}

# The public functions left out, each with why: none is a function of a float
# array that a gradient flows through.
EXCLUDED = {
    "jax.nn.one_hot": "takes integer indices: nothing to differentiate",
    "jax.nn.get_scaled_dot_general_config": "returns a configuration object, not an array",
    "jax.nn.scaled_dot_general": "a block-scaled (mxfp8/nvfp4) matmul: the matmul itself, "
                                 "of operands already quantised",
    "jax.nn.scaled_matmul": "a block-scaled matmul of quantised operands and their scales",
}

B, D, N = 8, 16, 24  # x: (B, D), w: (D, N), the matmul's output h: (B, N).


def public_functions() -> dict[str, Callable[..., Any]]:
  """Every public function of :data:`MODULES` by its dotted name (no classes, modules, constants)."""
  out = {}
  for mod in MODULES:
    for name in dir(mod):
      obj = getattr(mod, name)
      if name.startswith("_") or inspect.isclass(obj) or inspect.ismodule(obj) or not callable(obj):
        continue
      out[f"{mod.__name__}.{name}"] = obj
  return out


def _required(fn: Callable[..., Any]) -> tuple[str, ...]:
  params = inspect.signature(fn).parameters.values()
  return tuple(p.name for p in params if p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


# -- the other arguments, made from the signature ----------------------------------

_RNG = np.random.default_rng(42)
_ONE_HOT = jnp.asarray(np.eye(N, dtype=np.float32)[_RNG.integers(0, N, B)])  # Probabilities, binary.
_CLASSES = jnp.asarray(_RNG.integers(0, N, B), jnp.int32)
_LOG_TARGETS = jax.nn.log_softmax(jnp.asarray(_RNG.normal(size=(B, N)), jnp.float32))
_LABELS = (_CLASSES, _ONE_HOT)  # Integer classes, else a one-hot float array.
_CTC_LABELS = jnp.asarray(1 + _RNG.integers(0, N - 1, (2, 2)), jnp.int32)  # 0 is the blank.


def _thirds(h: jax.Array) -> list[jax.Array]:
  return jnp.split(h, 3, axis=-1)


def _attention(fn: Callable[..., Any], h: jax.Array, labels: Any) -> Any:
  q, k, v = (t.reshape(2, 4, 1, N // 3) for t in _thirds(h))  # (batch, length, heads, dim).
  return fn(q, k, v)


def _ctc(fn: Callable[..., Any], h: jax.Array, labels: Any) -> Any:
  logits = h.reshape(2, B // 2, N)  # (batch, time, classes).
  return fn(logits, jnp.zeros((2, B // 2)), _CTC_LABELS, jnp.zeros((2, 2)))


# Required parameters -> how to call: fn(h, ...) with `labels` one of _LABELS.
SIGNATURES: dict[tuple[str, ...], Callable[..., Any]] = {
    ("x",): lambda fn, h, labels: fn(h),
    ("a",): lambda fn, h, labels: fn(h),
    ("query", "key", "value"): _attention,
    ("predictions",): lambda fn, h, labels: fn(h, _ONE_HOT),
    ("predictions", "targets"): lambda fn, h, labels: fn(h, _ONE_HOT),
    ("predictor_outputs", "targets"): lambda fn, h, labels: fn(h, _ONE_HOT),
    ("log_predictions", "targets"): lambda fn, h, labels: fn(h, _ONE_HOT),
    ("log_predictions", "log_targets"): lambda fn, h, labels: fn(h, _LOG_TARGETS),
    ("logits", "labels"): lambda fn, h, labels: fn(h, labels),
    ("scores", "labels"): lambda fn, h, labels: fn(h, labels),
    ("embeddings", "labels"): lambda fn, h, labels: fn(h, labels),
    ("labels", "alpha"): lambda fn, h, labels: fn(h, 0.1),
    ("anchors", "positives", "negatives"): lambda fn, h, labels: fn(*_thirds(h)),
    ("logits", "logit_paddings", "labels", "label_paddings"): _ctc,
    # A loss factory: the loss it makes, with the max function its docs use.
    ("max_fun",): lambda fn, h, labels: fn(jax.nn.logsumexp)(h, labels),
}
# Inputs tried in order: the matmul's output, else a positive one (log1mexp's domain).
_INPUTS = (lambda h: h, lambda h: h * h + 0.5)


def _scalar(out: Any) -> jax.Array:
  """The sum of the means of a function's floating outputs."""
  leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  return sum(jnp.mean(x.astype(jnp.float32)) for x in leaves)


def _x() -> jax.Array:
  return jnp.asarray(np.random.default_rng(0).normal(size=(B, D)), jnp.float32)


def _w() -> jax.Array:
  return jnp.asarray(np.random.default_rng(1).normal(size=(D, N)) / np.sqrt(D), jnp.float32)


def _e4m3(a: jax.Array) -> jax.Array:
  """``a`` rounded as FP8 rounds a forward operand (tensorwise scale); its gradient is 1."""
  s = jnp.max(jnp.abs(a)) / float(jnp.finfo(jnp.float8_e4m3fn).max)
  q = (a / s).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
  return a + jax.lax.stop_gradient(q - a)


Loss = Callable[[jax.Array, jax.Array], jax.Array]


def case(name: str) -> tuple[Loss, Loss, np.ndarray]:
  """``loss(w, x)`` (``name`` applied to ``x @ w``, reduced to a scalar), FP8's float32
  reference (the matmul on e4m3 operands), and float32's gradient.

  The labels and the input map are the first of their candidates for which
  float32 accepts them and its loss and gradient are finite.
  """
  fn = public_functions()[name]
  call = SIGNATURES[_required(fn)]
  x, w = _x(), _w()
  for labels in _LABELS:
    for inp in _INPUTS[1:] if name in AT_SECOND_INPUT else _INPUTS:
      def make(matmul: Callable[..., Any], labels: Any = labels, inp: Any = inp) -> Loss:
        return lambda w, x: _scalar(call(fn, inp(matmul(x, w)), labels))
      loss = make(lambda x, w: x @ w)
      try:
        value, grad = jax.value_and_grad(loss)(w, x)
      except (TypeError, ValueError):  # The labels' kind is not this function's.
        break
      if np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad))):
        return loss, make(lambda x, w: _e4m3(x) @ _e4m3(w)), np.asarray(grad)
  raise AssertionError(f"{name}: no labels and input give a finite float32 loss")


def _modes(loss: Loss) -> dict[str, Loss]:
  return {"bfloat16": jmp.autocast(loss, BF16), "float16": jmp.autocast(loss, F16),
          "fp8": jmp.autocast(loss, BF16, fp8=FP8)}


TESTED = sorted(set(public_functions()) - set(EXCLUDED))


def test_exclusions_are_few_and_each_names_a_public_function() -> None:
  found = public_functions()
  assert len(EXCLUDED) <= 5, sorted(EXCLUDED)
  for name in EXCLUDED:
    assert name in found, f"{name} is no longer a public function: drop it from EXCLUDED"
  assert len(TESTED) >= 60, len(TESTED)  # Both modules were found, every function kept.


def test_every_signature_has_a_call() -> None:
  missing = {n: _required(public_functions()[n]) for n in TESTED
             if _required(public_functions()[n]) not in SIGNATURES}
  assert not missing, f"add these signatures to SIGNATURES: {missing}"


# Deprecated functions (optax's convex_kl_divergence) are public still, and tested.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", TESTED)
def test_grad_runs_in_every_mode_and_matches_float32(name: str) -> None:
  loss, fp8_ref, want32 = case(name)
  x, w = _x(), _w()
  for mode, f in _modes(loss).items():
    want = np.asarray(jax.grad(fp8_ref)(w, x)) if mode == "fp8" else want32
    got = np.asarray(jax.grad(f)(w, x))
    assert got.dtype == np.float32, (name, mode, got.dtype)
    err = float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), 1e-3)
    assert np.all(np.isfinite(got)), (name, mode)
    assert err <= TOL[mode], (name, mode, err)


def test_each_moved_function_has_a_kink_within_rounding_at_the_first_input() -> None:
  assert set(AT_SECOND_INPUT) == {"optax.losses.triplet_margin_loss"}, "add its check here"
  anchors, positives, negatives = _thirds(_e4m3(_x()) @ _e4m3(_w()))
  d = lambda a, b: jnp.sqrt(jnp.sum((a - b) ** 2, axis=-1) + 1e-6)
  hinge = d(anchors, positives) - d(anchors, negatives) + 1.0
  ulp = 2.0**-7 * jnp.maximum(d(anchors, positives), d(anchors, negatives))  # bfloat16's, at d
  assert float(jnp.min(jnp.abs(hinge) / ulp)) < 0.25, np.asarray(hinge)

"""Half-precision hazards: idioms that are finite in float32 and break under a naive cast.

Each idiom is a loss ``loss(params, batch)`` whose logits come from a matmul
(``batch["x"] @ params["w"]``), followed by one of the idioms model zoos are
full of: an eps that rounds to 0, a mask sentinel past the half range, a clip
bound that rounds to 1, a square or a sum past 65504, an ``exp`` without the
max subtracted, a temperature that overflows. Each test checks, in order:

1. the idiom is finite in float32 and broken (non-finite, or far off) when its
   params and batch are simply cast to float16, so that the corpus stays honest;
2. under ``jmp.autocast(loss, dtype)`` on the float32 arguments, for float16
   and bfloat16, the loss is finite and within 2% / 5% of float32;
3. in ``make_train_step(..., autocast=True)`` (``mixed_float16`` with dynamic
   loss scaling, ``mixed_bfloat16``) no step of three is skipped, and the
   first loss is within the same tolerance;
4. for an idiom whose hazard is a constant, ``precision_lint`` under the
   half policy without autocast names that constant.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp

F16, BF16 = jnp.float16, jnp.bfloat16
TOL = {F16: 0.02, BF16: 0.05}


class Idiom(NamedTuple):
  loss: Callable[[Any, Any], jax.Array]
  make: Callable[[np.random.Generator], tuple[Any, Any]]
  constant: Union[str, None]  # The literal lint must name (its repr), if the hazard is one.


def _xw(rng: np.random.Generator, b: int, d: int, k: int, scale: float = 1.0,
        zero_row: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
  x = rng.normal(size=(b, d)).astype(np.float32)
  if zero_row:
    x[0] = 0.0  # A padding row: its activations are exactly 0.
  w = (rng.normal(size=(d, k)) * scale / np.sqrt(d)).astype(np.float32)
  return {"w": jnp.asarray(w)}, {"x": jnp.asarray(x)}


def _logits(params: Any, batch: Any) -> jax.Array:
  return batch["x"] @ params["w"]


# -- eps that rounds to 0 ----------------------------------------------------

def bert_layernorm(params, batch):
  h = _logits(params, batch)
  mu = jnp.mean(h, -1, keepdims=True)
  var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
  y = (h - mu) / jnp.sqrt(var + 1e-12)
  return jnp.mean((y - batch["t"]) ** 2 * batch["real"])  # Padding is not in the loss.


def rmsnorm(params, batch):
  h = _logits(params, batch)
  y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-8)
  return jnp.mean((y - batch["t"]) ** 2)


def _norm_data(rng):
  params, batch = _xw(rng, 8, 16, 32, zero_row=True)
  batch["t"] = jnp.asarray(rng.normal(size=(8, 32)).astype(np.float32))
  batch["real"] = jnp.ones((8, 1)).at[0].set(0.0)
  return params, batch


def cosine_eps(params, batch):
  a = _logits(params, batch)
  b = batch["t"]  # Row 0 is zero: the eps is the whole denominator.
  num = jnp.sum(a * b, -1)
  den = jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-8)
  return jnp.mean(1.0 - num / den)


def _cos_data(rng):
  params, batch = _xw(rng, 8, 16, 32)
  batch["t"] = batch["x"].at[0].set(0.0) @ jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
  return params, batch


def dice(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch) + batch["offset"])
  t = batch["t"]
  inter = jnp.sum(p * t, -1)
  return jnp.mean(1.0 - (2.0 * inter + 1e-8) / (jnp.sum(p, -1) + jnp.sum(t, -1) + 1e-8))


def _seg_data(rng):
  params, batch = _xw(rng, 8, 16, 32, scale=4.0)
  batch["offset"] = jnp.zeros((8, 1)).at[0].set(-40.0)  # An empty prediction...
  t = (rng.uniform(size=(8, 32)) < 0.3).astype(np.float32)
  t[0] = 0.0  # ...of an empty mask: 1e-8 / 1e-8.
  batch["t"] = jnp.asarray(t)
  return params, batch


def kl_eps(params, batch):
  p = jax.nn.softmax(batch["t"] * 40.0, -1)
  q = jax.nn.softmax(_logits(params, batch), -1)
  return jnp.mean(jnp.sum(p * jnp.log((p + 1e-10) / (q + 1e-10)), -1))


def log_eps(params, batch):
  p = jax.nn.softmax(_logits(params, batch), -1)
  return -jnp.mean(jnp.sum(batch["t"] * jnp.log(p + 1e-8), -1))


def focal(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch))
  pt = jnp.where(batch["t"] > 0, p, 1.0 - p)
  return -jnp.mean((1.0 - pt) ** 2 * jnp.log(pt + 1e-8))


def _cls_data(rng, scale=12.0):
  params, batch = _xw(rng, 8, 16, 10, scale=scale)
  z = np.asarray(batch["x"] @ params["w"])
  t = np.zeros_like(z)
  t[np.arange(8), np.argmin(z, -1)] = 1.0  # Confidently wrong: tiny probabilities.
  batch["t"] = jnp.asarray(t)
  return params, batch


# -- clip bounds that round to 1 ---------------------------------------------

def clipped_bce(params, batch):
  p = jnp.clip(jax.nn.sigmoid(_logits(params, batch)), 1e-7, 1.0 - 1e-7)
  t = batch["t"]
  return -jnp.mean(t * jnp.log(p) + (1.0 - t) * jnp.log(1.0 - p))


def _bce_data(rng):
  params, batch = _xw(rng, 8, 16, 10, scale=3.0)
  z = np.asarray(batch["x"] @ params["w"])
  batch["t"] = jnp.asarray((z < 0).astype(np.float32))  # Wrong, confidently, where |z| is big.
  batch["x"] = batch["x"] * 8.0
  return params, batch


# -- mask sentinels past the half range --------------------------------------

def _attn(params, batch, bias):
  s = _logits(params, batch)
  p = jax.nn.softmax(s + bias, -1)
  return jnp.mean(jnp.sum(p * batch["t"], -1))


def hf_additive_mask(params, batch):
  return _attn(params, batch, (1.0 - batch["mask"]) * -1e9)


def where_bias(params, batch):
  return _attn(params, batch, jnp.where(batch["mask"] > 0, 0.0, -1e9))


def causal_left_pad(params, batch):
  t = batch["mask"].shape[-1]
  ones = jnp.ones((t, t), batch["mask"].dtype)  # Built from constants, in the program's dtype.
  causal = jnp.tril(ones)[: batch["mask"].shape[0]]
  keep = causal * batch["mask"]
  return _attn(params, batch, (1.0 - keep) * -1e9)


def where_temperature(params, batch):
  s = jnp.where(batch["mask"] > 0, _logits(params, batch), -1e30) / 0.1
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(s, -1) * batch["t"], -1))


def _mask_data(rng):
  params, batch = _xw(rng, 8, 16, 8, scale=2.0)
  mask = (rng.uniform(size=(8, 8)) < 0.7).astype(np.float32)
  mask[:, 0] = 0.0  # Left padding...
  mask[0] = 0.0  # ...and a row with nothing left.
  mask[1:, 1] = 1.0
  batch["mask"] = jnp.asarray(mask)
  t = np.zeros((8, 8), np.float32)
  t[1:, 1] = 1.0  # A kept position; none in the empty row.
  batch["t"] = jnp.asarray(t)
  return params, batch


# -- squares and sums past 65504, exp without the max, temperatures -----------

def variance_300(params, batch):
  h = _logits(params, batch) + params["b"]
  var = jnp.mean(h * h, -1) - jnp.mean(h, -1) ** 2
  return jnp.mean(var)


def _var_data(rng):
  params, batch = _xw(rng, 8, 16, 64, scale=4.0)
  params["b"] = jnp.full((64,), 300.0)
  return params, batch


def big_sum(params, batch):
  return jnp.sum(jax.nn.relu(_logits(params, batch))) / 1000.0


def _sum_data(rng):
  params, batch = _xw(rng, 256, 16, 512, scale=2.0)  # 131072 elements, their sum ~ 1e5
  return params, batch


def exp_no_max(params, batch):
  z = _logits(params, batch)
  e = jnp.exp(z)
  p = e / jnp.sum(e, -1, keepdims=True)
  return jnp.mean(jnp.sum(p * batch["t"], -1))


def _exp_data(rng):
  params, batch = _xw(rng, 8, 16, 10, scale=1.0)
  batch["x"] = batch["x"] + 0.0
  params["w"] = params["w"] + 3.0  # logits near 12: exp(12) > 65504
  batch["x"] = jnp.abs(batch["x"]) * 0.3
  batch["t"] = jnp.asarray(rng.normal(size=(8, 10)).astype(np.float32))
  return params, batch


def log_softmax_temperature(params, batch):
  logp = jax.nn.log_softmax(_logits(params, batch) / 0.01, -1)
  return -jnp.mean(jnp.sum(logp * batch["t"], -1)) / 1000.0


def _temp_data(rng):
  params, batch = _xw(rng, 8, 16, 10, scale=800.0)  # logits ~ 800: / 0.01 > 65504
  t = np.zeros((8, 10), np.float32)
  t[:, 0] = 1.0
  batch["t"] = jnp.asarray(t)
  return params, batch


def info_nce(params, batch):
  a = _logits(params, batch)
  a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
  sim = a @ a.T / 0.05
  e = jnp.exp(sim)
  return -jnp.mean(jnp.log(jnp.diagonal(e) / jnp.sum(e, -1)))


def _nce_data(rng):
  return _xw(rng, 8, 16, 32)


IDIOMS = {
    "bert_layernorm_1e-12": Idiom(bert_layernorm, _norm_data, "1e-12"),
    "rmsnorm_1e-8": Idiom(rmsnorm, _norm_data, "1e-08"),
    "cosine_eps_1e-8": Idiom(cosine_eps, _cos_data, "1e-08"),
    "dice_1e-8": Idiom(dice, _seg_data, "1e-08"),
    "kl_eps_1e-10": Idiom(kl_eps, _cls_data, "1e-10"),
    "log_eps_1e-8": Idiom(log_eps, _cls_data, "1e-08"),
    "focal_1e-8": Idiom(focal, _cls_data, "1e-08"),
    "clipped_bce": Idiom(clipped_bce, _bce_data, "0.9999999"),
    "hf_additive_mask": Idiom(hf_additive_mask, _mask_data, "-1e+09"),
    "where_bias": Idiom(where_bias, _mask_data, "-1e+09"),
    "causal_left_pad": Idiom(causal_left_pad, _mask_data, "-1e+09"),
    "where_temperature": Idiom(where_temperature, _mask_data, "-1e+30"),
    "variance_300": Idiom(variance_300, _var_data, None),
    "big_sum": Idiom(big_sum, _sum_data, None),
    "exp_no_max": Idiom(exp_no_max, _exp_data, None),
    "log_softmax_temperature": Idiom(log_softmax_temperature, _temp_data, None),
    "info_nce": Idiom(info_nce, _nce_data, None),
}


def _data(name: str) -> tuple[Any, Any]:
  return IDIOMS[name].make(np.random.default_rng(sum(map(ord, name))))


def _close(got: Any, want: float, dtype: Any) -> bool:
  got = float(got)
  return bool(np.isfinite(got)) and abs(got - want) <= TOL[dtype] * max(abs(want), 1e-3)


def _naive(loss: Callable[..., Any], params: Any, batch: Any, dtype: Any) -> Any:
  cast = lambda t: jax.tree.map(lambda x: x.astype(dtype), t)
  with np.errstate(over="ignore"):  # jnp warns as it rounds -1e9 to float16's -inf.
    return loss(cast(params), cast(batch))


def report(name: str) -> dict[str, Any]:
  """Every check's value for one idiom (the tests assert on it; run as a script to print)."""
  idiom = IDIOMS[name]
  params, batch = _data(name)
  want = float(jax.jit(idiom.loss)(params, batch))
  out: dict[str, Any] = {"float32": want, "naive_f16": float(_naive(idiom.loss, params, batch, F16))}
  for dtype in (F16, BF16):
    tag = np.dtype(dtype).name
    out[f"autocast_{tag}"] = float(jax.jit(jmp.autocast(idiom.loss, dtype))(params, batch))
    policy = jmp.get_policy("mixed_float16" if dtype == F16 else "mixed_bfloat16")
    tx = optax.sgd(1e-4)
    if dtype == F16:
      # A zero (padding) row's rsqrt(0 + 1e-8) = 1e4 scales its cotangent:
      # 2**15 would overflow it in float16 whatever the precision of the rest.
      tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**4)
    state = jmp.TrainState.create(params=params, tx=tx)
    step = jmp.make_train_step(idiom.loss, policy, autocast=True)
    losses, finite = [], []
    for _ in range(3):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
      finite.append(bool(metrics["grads_finite"]))
    out[f"step_{tag}"] = losses
    out[f"step_finite_{tag}"] = finite
  return out


@pytest.mark.parametrize("name", sorted(IDIOMS))
def test_idiom(name: str) -> None:
  idiom = IDIOMS[name]
  r = report(name)
  want = r["float32"]
  assert np.isfinite(want)
  assert not _close(r["naive_f16"], want, F16), r  # The corpus is honest: half breaks it.
  for dtype in (F16, BF16):
    tag = np.dtype(dtype).name
    assert _close(r[f"autocast_{tag}"], want, dtype), (tag, r)
    assert all(r[f"step_finite_{tag}"]), (tag, r)  # No step skipped.
    assert _close(r[f"step_{tag}"][0], want, dtype), (tag, r)
    assert all(np.isfinite(r[f"step_{tag}"])), (tag, r)


@pytest.mark.parametrize("name", sorted(n for n, i in IDIOMS.items() if i.constant))
def test_lint_names_the_constant_under_the_half_policy(name: str) -> None:
  idiom = IDIOMS[name]
  params, batch = _data(name)
  for policy, dtype in (("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")):
    value = np.float32(float(idiom.constant))
    changes = not jmp._src.autocast.promote.fits(value, np.dtype(getattr(jnp, dtype)))
    with np.errstate(over="ignore"):  # jnp warns as it rounds -1e9 to float16's -inf.
      findings = jmp.precision_lint(idiom.loss, params, batch, policy=policy)
    found = [f for f in findings
             if f.op == "constant" and f.reason.startswith(f"{idiom.constant} is ")]
    assert bool(found) == changes, (policy, findings)
    for f in found:
      assert f.source and "test_hazards.py" in f.source and f"in {dtype}: " in f.reason
    # Under autocast the constant keeps float32: nothing to name.
    assert not [f for f in jmp.precision_lint(idiom.loss, params, batch, policy=policy,
                                              autocast=True) if f.op == "constant"]


def test_lint_message_names_value_result_and_line() -> None:
  def loss(params, x):
    h = x @ params["w"]
    return jnp.mean(h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-8))
  params, batch = _xw(np.random.default_rng(0), 4, 8, 8)
  line = loss.__code__.co_firstlineno + 2
  (f,) = [f for f in jmp.precision_lint(loss, params, batch["x"], policy="mixed_float16")
          if f.op == "constant"]
  assert f.reason.startswith(f"1e-08 is 0.0 in float16: ... + 1e-08 (test_hazards.py:{line})")
  assert not [f for f in jmp.precision_lint(loss, params, batch["x"], policy="float32")
              if f.op == "constant"]


def test_vmap_of_autocast_and_autocast_of_vmap_may_choose_different_dtypes() -> None:
  # docs/autocast.md: the promote rule decides by size, and vmap changes the sizes.
  f = lambda x, w, pos: jnp.tanh(x @ w + pos)
  rng = np.random.default_rng(1)
  x, w, pos = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8), (8, 8), (8,)))
  inside = jax.vmap(jmp.autocast(f, F16), in_axes=(0, None, None))(x, w, pos)
  outside = jmp.autocast(jax.vmap(f, in_axes=(0, None, None)), F16)(x, w, pos)
  assert inside.dtype == jnp.float32 and outside.dtype == F16  # pos: data inside, a bias outside
  np.testing.assert_allclose(np.asarray(inside), np.asarray(outside, np.float32), atol=4e-3)


def test_constants_that_change_value_keep_float32_wherever_they_sit() -> None:
  h = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8)) * 30, jnp.float32)
  eye, mask = jnp.eye(8), jnp.arange(8) < 3
  rows = jnp.broadcast_to(mask, (4, 8)).at[0].set(False)  # A fully masked row.
  cases = {  # Each: float32 in the float32 program, broken if its constant is rounded first.
      "scalar": lambda w, h: jnp.log(jnp.abs(h @ w) * 0 + 1e-8),
      "where branch": lambda w, h: jax.nn.softmax((h @ w) + jnp.where(rows, 0.0, -1e9), -1),
      "built from constants": lambda w, h: jax.nn.softmax(  # Row 0 is fully masked.
          (h @ w) + (1.0 - jnp.tril(jnp.ones((4, 8)), -1)) * -1e9, -1),
      "clip bound that rounds to 1": lambda w, h: jnp.log(1.0 - jnp.clip(
          jax.nn.sigmoid(h @ w), 1e-7, 1.0 - 1e-7)),
  }
  for dtype in (F16, BF16):
    for name, fn in cases.items():
      want = fn(eye, h)
      got = jmp.autocast(fn, dtype)(eye, h)
      assert np.all(np.isfinite(np.asarray(got, np.float32))), (name, dtype)
      np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=TOL[dtype], atol=1e-3,
                                 err_msg=f"{name} {dtype}")
  # float32's own extremes in a select still saturate: the result stays half, the row finite.
  sat = lambda w, h: jnp.where(mask, h @ w, jnp.finfo(jnp.float32).min)
  assert jmp.autocast(sat, F16)(eye, h).dtype == F16


if __name__ == "__main__":
  import sys
  for n in sys.argv[1:] or sorted(IDIOMS):
    try:
      print(n, report(n))
    except Exception as e:  # noqa: BLE001
      print(n, "ERROR", type(e).__name__, str(e)[:300])


# -- a metric beside the loss reads its values without changing their precision --------

METRICS = {
    "accuracy": lambda p, t: jnp.mean((p > 0.5) == t),
    "argmax": lambda p, t: jnp.mean(jnp.argmax(p, -1) == jnp.argmax(t, -1)),
    "stop_gradient": lambda p, t: jax.lax.stop_gradient(p),
    "integer_count": lambda p, t: jnp.sum((p * 2.0).astype(jnp.int32)),
}


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_a_metric_returned_as_aux_leaves_the_clipped_bce_in_float32(metric: str) -> None:
  # The clipped BCE keeps sigmoid(z) in float32 because it only feeds float32 ops;
  # a metric that reads p (a comparison, an argmax, a stop_gradient, an integer)
  # needs no precision and made the sigmoid half: +5.8% in bf16, +4.8% in f16.
  def loss(params, batch):
    p = jnp.clip(jax.nn.sigmoid(_logits(params, batch)), 1e-7, 1.0 - 1e-7)
    t = batch["t"]
    return -jnp.mean(t * jnp.log(p) + (1.0 - t) * jnp.log(1.0 - p)), METRICS[metric](p, t)

  params, batch = _data("clipped_bce")
  want = float(loss(params, batch)[0])
  for dtype in (F16, BF16):
    losses, finite = _three_steps(loss, params, batch, dtype)
    assert all(finite), (metric, dtype)  # No step skipped.
    assert _close(float(jax.jit(jmp.autocast(loss, dtype))(params, batch)[0]), want, dtype)
    assert _close(losses[-1], want, dtype), (metric, dtype, losses)


def _three_steps(loss: Callable[..., Any], params: Any, batch: Any,
                 dtype: Any) -> tuple[list[float], list[bool]]:
  """The losses and ``grads_finite`` of three autocast steps of ``loss`` (with aux) in ``dtype``."""
  policy = jmp.get_policy("mixed_float16" if dtype == F16 else "mixed_bfloat16")
  tx = jmp.dynamic_loss_scaling(optax.sgd(1e-4), init_scale=2.0**4) if dtype == F16 else (
      optax.sgd(1e-4))
  state = jmp.TrainState.create(params=params, tx=tx)
  step = jmp.make_train_step(loss, policy, autocast=True, has_aux=True)
  losses, finite = [], []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    finite.append(bool(metrics["grads_finite"]))
  return losses, finite


# -- a value a hazard needs in float32 stays float32 for it, whatever else reads it ----

def _clipped_bce_of(p, t):
  p = jnp.clip(p, 1e-7, 1.0 - 1e-7)
  return -jnp.mean(t * jnp.log(p) + (1.0 - t) * jnp.log(1.0 - p))


def _accuracy_after_the_loss(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch))
  loss = _clipped_bce_of(p, batch["t"])
  return loss, jnp.mean((p > 0.5) == batch["t"])


def _accuracy_before_the_loss(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch))
  accuracy = jnp.mean((p > 0.5) == batch["t"])  # Binds the sigmoid's region first.
  return _clipped_bce_of(p, batch["t"]), accuracy


def _probabilities_as_aux(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch))
  return _clipped_bce_of(p, batch["t"]), {"probs": p}


def _their_max_as_aux(params, batch):
  p = jax.nn.sigmoid(_logits(params, batch))
  return _clipped_bce_of(p, batch["t"]), jnp.max(p)


OTHER_READERS = {
    "accuracy_after_the_loss": _accuracy_after_the_loss,
    "accuracy_before_the_loss": _accuracy_before_the_loss,
    "probabilities_as_aux": _probabilities_as_aux,
    "their_max_as_aux": _their_max_as_aux,
}


@pytest.mark.parametrize("reader", sorted(OTHER_READERS))
def test_the_clipped_bce_keeps_its_sigmoid_float32_whatever_else_reads_it(reader: str) -> None:
  # The clip's bound 1 - 1e-7 is finer than half resolves, so the clip needs
  # sigmoid(z) in float32; another reader (a metric computed first, the
  # probabilities or their max returned) made the sigmoid half: +3.6% (bf16),
  # +4.7% (f16), every f16 step skipped. The other readers get the half value.
  loss = OTHER_READERS[reader]
  params, batch = _data("clipped_bce")
  want, want_aux = loss(params, batch)
  want = float(want)
  for dtype in (F16, BF16):
    for run in (jmp.autocast(loss, dtype), jax.jit(jmp.autocast(loss, dtype))):
      got, aux = run(params, batch)
      assert _close(got, want, dtype), (reader, dtype, float(got), want)
      for a, w in zip(jax.tree.leaves(aux), jax.tree.leaves(want_aux)):
        assert a.dtype in (dtype, jnp.float32), (reader, dtype, a.dtype)
        np.testing.assert_allclose(np.asarray(a, np.float32), w, atol=TOL[dtype])  # Half logits.
      if reader == "probabilities_as_aux":  # Its other reader (the caller) gets its cast.
        assert aux["probs"].dtype == dtype
    losses, finite = _three_steps(loss, params, batch, dtype)
    assert all(finite), (reader, dtype)  # No step skipped.
    assert _close(losses[0], want, dtype), (reader, dtype, losses)
    # Without autocast, lint names the bound that rounds to 1, whatever reads the sigmoid.
    policy = jmp.get_policy("mixed_float16" if dtype == F16 else "mixed_bfloat16")
    found = [f for f in jmp.precision_lint(loss, params, batch, policy=policy)
             if f.op == "constant" and f.reason.startswith("0.9999999 is 1.0 in ")]
    assert found, (reader, dtype)


def test_the_focal_loss_keeps_its_sigmoid_float32_when_the_probabilities_are_returned() -> None:
  # log(pt + 1e-8) of pt = where(t, p, 1 - p): the eps is finer than half holds
  # 1 - p, so the chain to the sigmoid, through jnp.where's jit, stays float32.
  # Returning p made it half: +24% (f16), +33% (bf16).
  def loss(params, batch):
    p = jax.nn.sigmoid(_logits(params, batch))
    pt = jnp.where(batch["t"] > 0, p, 1.0 - p)
    return -jnp.mean((1.0 - pt) ** 2 * jnp.log(pt + 1e-8)), p

  params, batch = _data("focal_1e-8")
  want = float(loss(params, batch)[0])
  for dtype in (F16, BF16):
    for run in (jmp.autocast(loss, dtype), jax.jit(jmp.autocast(loss, dtype))):
      got, p = run(params, batch)
      assert _close(got, want, dtype) and p.dtype == dtype, (dtype, float(got), want, p.dtype)

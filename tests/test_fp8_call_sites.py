"""FP8 decisions per call site (issue 36 items 1-4).

A jitted helper shared by several layers is one jaxpr, so one ``dot_general``
equation for every layer that calls it: keep rules, the nested-jit cache and
``fp8_sensitivity`` must still decide per call site, as for the same helper
without ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal


def _dense(x, w):
  return jnp.tanh(x @ w)


_DENSE_JIT = jax.jit(_dense)


def _two_layers(dense):
  # w1 and w2 share a traced equation; w1 and w3 also share the input types
  # that key autocast's nested-jit cache.
  def f(params, x):
    return dense(dense(x, params["w1"]), params["w2"]) + dense(x, params["w3"])
  return f


def _problem():
  k = jax.random.split(jax.random.key(0), 4)
  params = {w: jax.random.normal(k[i], (16, 16)) * 0.3 for i, w in enumerate(("w1", "w2", "w3"))}
  return params, jax.random.normal(k[3], (8, 16)) * 3.0


def test_a_jitted_helper_follows_each_call_sites_keep_rule():
  params, x = _problem()
  half = jax.jit(jmp.autocast(_two_layers(_dense), jnp.bfloat16))(params, x)
  # One after the other: a body cached for one recipe must not serve the next.
  for keep in [("w1",), ("w3",), ("w2",), ()]:
    recipe = jmp.Float8Recipe(keep=keep, min_size=0)
    plain = jmp.autocast(_two_layers(_dense), jnp.bfloat16, fp8=recipe)
    jitted = jmp.autocast(_two_layers(_DENSE_JIT), jnp.bfloat16, fp8=recipe)
    expected = jax.jit(plain)(params, x)
    assert_bitwise_equal(jax.jit(jitted)(params, x), expected)
    assert not np.array_equal(np.asarray(expected), np.asarray(half))
    if keep == ("w3",):  # Eager too: the nested jit is evaluated and cached the same way.
      assert_bitwise_equal(jitted(params, x), plain(params, x))


def _loss(dense, power=1):
  def loss(params, x):
    return jnp.sum(_two_layers(dense)(params, x) ** power)
  return loss


def test_sensitivity_of_a_jitted_helper_is_the_table_without_the_jit():
  # Issue 36 item 2: run first it failed ("No constant handler for type:
  # DynamicJaxprTracer"); after an FP8 autocast call every row read 0.00.
  params, x = _problem()
  recipe = jmp.Float8Recipe(min_size=0)
  plain = jmp.fp8_sensitivity(_loss(_dense), params, x, recipe=recipe)
  first = jmp.fp8_sensitivity(_loss(_DENSE_JIT), params, x, recipe=recipe)
  jmp.autocast(_loss(_DENSE_JIT), jnp.bfloat16, fp8=recipe)(params, x)  # The user's own run.
  after = jmp.fp8_sensitivity(_loss(_DENSE_JIT), params, x, recipe=recipe)
  table = lambda report: [(r.weight, r.output_error, r.grad_error) for r in report.rows]
  assert table(first) == table(plain) and table(after) == table(plain)
  assert [r.weight for r in plain.rows] and all(r.output_error > 0 and r.grad_error > 0
                                               for r in plain.rows)


def test_a_float32_chain_goes_on_through_a_jitted_helper():
  # Issue 34's float32 regions reach back from the squared sum into the helper's
  # tanh, across the jit as without it: the forward pass is the same bit for bit.
  # The backward pass is one region without the jit and three with it, which XLA
  # fuses differently (float32 roundings apart, within a bfloat16 step after the
  # cast), so the sensitivity tables agree to a tolerance, not bit for bit.
  params, x = _problem()
  recipe = jmp.Float8Recipe(min_size=0)
  for fp8 in (None, recipe):
    plain = jax.jit(jmp.autocast(_loss(_dense, 2), jnp.bfloat16, fp8=fp8))(params, x)
    jitted = jax.jit(jmp.autocast(_loss(_DENSE_JIT, 2), jnp.bfloat16, fp8=fp8))(params, x)
    assert_bitwise_equal(jitted, plain)
  plain = jmp.fp8_sensitivity(_loss(_dense, 2), params, x, recipe=recipe)
  jitted = jmp.fp8_sensitivity(_loss(_DENSE_JIT, 2), params, x, recipe=recipe)
  assert [r.weight for r in jitted.rows] == [r.weight for r in plain.rows]
  for a, b in zip(jitted.rows, plain.rows):
    np.testing.assert_allclose([a.output_error, a.grad_error], [b.output_error, b.grad_error],
                               rtol=0.05)


BF16, E4M3 = "bfloat16", "float8_e4m3fn"


def _counts(fn, *args):
  report = jmp.precision_report(fn, *args)
  found = {d: report.count("matmul", d) for d in (BF16, E4M3)}
  return {d: n for d, n in found.items() if n}


_WEIGHTS = {
    "weight-norm": lambda p: p["w"] / jnp.linalg.norm(p["w"], axis=0, keepdims=True),
    "pruned": lambda p: p["w"] * p["mask"],
    "lora": lambda p: p["w"] + p["a"] @ p["b"],
    "scaled-cast": lambda p: (2.0 * p["w"]).astype(jnp.bfloat16).T.T,
}


@pytest.mark.parametrize("name", list(_WEIGHTS))
def test_a_keep_rule_follows_element_wise_ops_on_its_leaf(name):
  # Issue 36 item 4: w / norm(w), w * mask and w + a @ b were not kept.
  k = jax.random.split(jax.random.key(1), 5)
  params = {"w": jax.random.normal(k[0], (16, 16)), "head": jax.random.normal(k[1], (16, 4)),
            "mask": (jax.random.uniform(k[2], (16, 16)) > 0.5).astype(jnp.float32),
            "a": jax.random.normal(k[3], (16, 2)), "b": jax.random.normal(k[4], (2, 16))}
  x = jax.random.normal(jax.random.key(2), (8, 16))

  def f(params, x):
    h = jnp.tanh(x @ _WEIGHTS[name](params))
    return (h + params["w"][0]) @ params["head"]  # A bias from w: not w itself.

  keep = jmp.autocast(f, jnp.bfloat16, fp8=jmp.Float8Recipe(keep=("0/w$",), min_size=0))
  lora = 1 if name == "lora" else 0
  assert _counts(keep, params, x) == {BF16: 1, E4M3: 1 + lora}
  every = jmp.autocast(f, jnp.bfloat16, fp8=jmp.Float8Recipe(min_size=0))
  assert _counts(every, params, x) == {E4M3: 2 + lora}


def test_a_broadcast_bias_or_scale_does_not_keep_the_next_layer():
  # Element-wise ops follow a weight, not a bias or norm scale spread over the activations.
  k = jax.random.split(jax.random.key(3), 3)
  params = {"w1": jax.random.normal(k[0], (16, 16)), "w2": jax.random.normal(k[1], (16, 4)),
            "bias": jnp.ones(16), "scale": jnp.full((16,), 2.0)}
  x = jax.random.normal(k[2], (8, 16))

  def f(params, x):
    h = (x @ params["w1"] + params["bias"]) * params["scale"]
    return h @ params["w2"]

  recipe = jmp.Float8Recipe(keep=("0/bias$", "0/scale$"), min_size=0)
  with pytest.warns(UserWarning, match="keeps no matmul|no matmul"):
    assert _counts(jmp.autocast(f, jnp.bfloat16, fp8=recipe), params, x) == {E4M3: 2}


@jax.custom_jvp
def _jvp_dense(x, w):
  return jnp.tanh(x @ w)


@_jvp_dense.defjvp
def _jvp_dense_rule(primals, tangents):
  (x, w), (tx, tw) = primals, tangents
  y = jnp.tanh(x @ w)
  return y, (1.0 - y * y) * (tx @ w + x @ tw)


@jax.custom_vjp
def _vjp_dense(x, w):
  return jnp.tanh(x @ w)


def _vjp_dense_fwd(x, w):
  y = jnp.tanh(x @ w)
  return y, (x, w, y)


def _vjp_dense_bwd(res, g):
  x, w, y = res
  g = g * (1.0 - y * y)
  return g @ w.T, x.T @ g


_vjp_dense.defvjp(_vjp_dense_fwd, _vjp_dense_bwd)


@pytest.mark.parametrize("dense", [_jvp_dense, _vjp_dense], ids=["custom_jvp", "custom_vjp"])
def test_custom_derivatives_follow_the_plan(dense):
  # Issue 36 item 3: grad through a custom_jvp raised NotImplementedError (the
  # transpose of custom_vjp_call); a kept custom_vjp layer ran its backward in FP8.
  params, x = _problem()
  x = x / 3.0  # Unsaturated tanh: FP8's error is not amplified by a steep 1 - y**2.
  loss = lambda p, x: jnp.mean(dense(x, p["w1"]) ** 2)
  grad = lambda recipe: jax.jit(jax.grad(jmp.autocast(loss, jnp.bfloat16, fp8=recipe)))
  half = jax.jit(jax.grad(jmp.autocast(loss, jnp.bfloat16)))(params, x)
  # Kept: forward, tangent and backward matmuls all in half, as without FP8.
  keep = jmp.Float8Recipe(keep=("w1",), min_size=0)
  assert_bitwise_equal(grad(keep)(params, x)["w1"], half["w1"])
  # JAX runs the derivative rules of a jitted function later, outside autocast's evaluation.
  later = jax.grad(jax.jit(jmp.autocast(loss, jnp.bfloat16, fp8=keep)))(params, x)
  half_later = jax.grad(jax.jit(jmp.autocast(loss, jnp.bfloat16)))(params, x)
  assert_bitwise_equal(later["w1"], half_later["w1"])
  fp8 = grad(jmp.Float8Recipe(min_size=0))(params, x)["w1"]
  assert np.isfinite(np.asarray(fp8, np.float32)).all()
  assert not np.array_equal(np.asarray(fp8), np.asarray(half["w1"]))
  error = np.linalg.norm(np.asarray(fp8, np.float32) - np.asarray(half["w1"], np.float32))
  assert error / np.linalg.norm(np.asarray(half["w1"], np.float32)) < 0.1, error

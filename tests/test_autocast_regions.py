"""Issue 29 item 3: float32 regions are recomputed, so the backward pass keeps half values.

Autocast computes a LayerNorm's statistics, a softmax, a GELU and a loss in
float32; the backward pass must not keep those float32 intermediates: it keeps
the regions' half inputs and recomputes the rest (``jax.checkpoint``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
half_dtypes = pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])


def layer_norm(x, scale, bias):
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def block_loss(p, batch):
  """A Transformer block written in plain jnp: LayerNorm, softmax attention, GELU MLP, loss."""
  x = batch["x"]
  h = layer_norm(x, p["s1"], p["b1"])
  scores = jnp.einsum("btd,bsd->bts", h @ p["wq"], h @ p["wk"]) / 4.0
  x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), h @ p["wv"])
  h = layer_norm(x, p["s2"], p["b2"])
  x = x + jax.nn.gelu(h @ p["w1"] + p["c1"]) @ p["w2"]
  logits = x @ p["out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def block_problem(d=16, t=8, b=4, vocab=12):
  keys = iter(jax.random.split(jax.random.key(0), 10))
  dense = lambda i, o: jax.random.normal(next(keys), (i, o)) / np.sqrt(i)
  params = {"wq": dense(d, d), "wk": dense(d, d), "wv": dense(d, d), "w1": dense(d, 4 * d),
            "c1": jnp.zeros(4 * d), "w2": dense(4 * d, d), "out": dense(d, vocab),
            "s1": jnp.ones(d), "b1": jnp.zeros(d), "s2": jnp.ones(d), "b2": jnp.zeros(d)}
  batch = {"x": jax.random.normal(next(keys), (b, t, d)),
           "y": jax.random.randint(next(keys), (b, t), 0, vocab)}
  return params, batch


def pullback_leaves(fn, params, batch):
  """What ``jax.vjp`` of ``fn`` keeps for the backward pass (shapes and dtypes)."""
  return jax.eval_shape(lambda p, b: jax.tree.leaves(jax.vjp(lambda q: fn(q, b), p)[1]),
                        params, batch)


@half_dtypes
def test_the_backward_pass_keeps_no_float32_activation(dtype):
  params, batch = block_problem()
  half = jmp.Policy(F32, dtype, F32)
  hp, hb = half.cast_to_compute(params), half.cast_to_compute(batch)
  activation = batch["x"].size  # (b, t, d): every float32 array this large is an activation
  leaves = pullback_leaves(jmp.autocast(block_loss, dtype), hp, hb)
  wide = [l.shape for l in leaves if l.dtype == F32 and l.size >= activation]
  assert not wide, wide
  kept = sum(l.size * l.dtype.itemsize for l in leaves)
  full = sum(l.size * l.dtype.itemsize for l in pullback_leaves(block_loss, params, batch))
  assert kept < 0.6 * full
  remats = [e for e in jaxpr_utils.walk(jax.make_jaxpr(jmp.autocast(block_loss, dtype))(
      hp, hb).jaxpr) if e.primitive.name == "remat2"]
  assert remats  # the float32 regions, each under jax.checkpoint


@half_dtypes
def test_recomputed_regions_give_the_float32_gradients(dtype, maybe_jit):
  params, batch = block_problem()
  half = jmp.Policy(F32, dtype, F32)
  loss = lambda p, b: jmp.autocast(block_loss, dtype)(half.cast_to_compute(p),
                                                      half.cast_to_compute(b))
  value, grads = maybe_jit(jax.value_and_grad(loss))(params, batch)
  want_value, want = jax.jit(jax.value_and_grad(block_loss))(params, batch)
  assert value.dtype == F32
  np.testing.assert_allclose(value, want_value, rtol=2e-2 if dtype == BF16 else 3e-3)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    assert g.dtype == F32
    np.testing.assert_allclose(g, w, atol=(6e-2 if dtype == BF16 else 1e-2) * np.abs(w).max())


def test_a_region_inside_a_scan_keeps_only_its_half_carry():
  def loss(ws, x):
    def layer(h, w):
      h = h + jax.nn.gelu(layer_norm(h, 1.0, 0.0) @ w)
      return h, None
    return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)

  ws = jax.random.normal(jax.random.key(1), (3, 16, 16)) / 4
  x = jax.random.normal(jax.random.key(2), (32, 16)).astype(jnp.bfloat16)
  leaves = pullback_leaves(lambda w, b: jmp.autocast(loss, jnp.bfloat16)(w, b["x"]),
                           ws.astype(jnp.bfloat16), {"x": x})
  assert not [l.shape for l in leaves if l.dtype == F32 and l.size >= x.size]
  grad = jax.grad(lambda w: jmp.autocast(loss, jnp.bfloat16)(w.astype(jnp.bfloat16), x))(ws)
  want = jax.grad(lambda w: loss(w, x.astype(F32)))(ws)
  np.testing.assert_allclose(grad, want, atol=0.05 * np.abs(want).max())


def test_region_values_reach_loops_and_conds_intact(maybe_jit):
  def f(x):
    e = jnp.exp(x)  # float32, not bound yet
    s = jax.lax.cond(x[0, 0] > 0, lambda v: v * 2.0, lambda v: v, e)
    c = jax.lax.scan(lambda acc, r: (acc + r, None), jnp.zeros(4), e)[0]
    return s, c, jnp.take_along_axis(e, jnp.zeros((3, 1), jnp.int32), axis=1)

  x = jnp.full((3, 4), 12.0, jnp.float16)  # exp(12) overflows float16
  s, c, taken = maybe_jit(jmp.autocast(f, jnp.float16))(x)
  want = np.exp(np.float32(12.0))
  assert s.dtype == c.dtype == taken.dtype == F32
  np.testing.assert_allclose(s, 2 * want, rtol=1e-6)
  np.testing.assert_allclose(c, 3 * want, rtol=1e-6)
  np.testing.assert_allclose(taken, want, rtol=1e-6)

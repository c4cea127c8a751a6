"""An embedding lookup's cotangent in FP8 (issue 44), on one device.

Under FSDP the cotangent of ``table[tokens]`` is gathered for its scatter-add;
under an FP8 recipe it is quantised to e5m2 first, as a matmul's cotangent is.
What the wire carries on 8 GPUs is in ``benchmarks.fsdp_census``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal
from jmp_lite._src.autocast import autocast as autocast_lib
from jmp_lite._src.fp8 import dot as fp8_dot
from jmp_lite._src.fp8 import lookup as fp8_lookup

RECIPE = jmp.Float8Recipe(min_size=0)
E5M2 = np.dtype(jnp.float8_e5m2)


def _take(t, i):
  return jnp.take(t, i, axis=0)


def _expected_grad(table, tokens, g):
  """The scatter-add of ``g`` rounded to e5m2 with its own per-tensor scale."""
  q, s = fp8_dot.quantize(g, E5M2)
  return jnp.zeros(table.shape, jnp.float32).at[tokens].add(fp8_dot.dequantize(q, s))


@pytest.mark.parametrize("jit", [False, True])
def test_the_lookup_is_the_gather_and_its_gradient_scatters_the_e5m2_cotangent(jit):
  k = jax.random.split(jax.random.key(0), 3)
  table = jax.random.normal(k[0], (50, 16))
  tokens = jax.random.randint(k[1], (4, 7), 0, 50)
  g = jax.random.normal(k[2], (4, 7, 16)) * jnp.logspace(-4, 1, 16)

  def f(t):
    return (fp8_lookup.fp8_lookup(t, tokens, _take, RECIPE) * g).sum()

  fn = jax.jit(jax.value_and_grad(f)) if jit else jax.value_and_grad(f)
  value, grad = fn(table)
  assert_bitwise_equal(fp8_lookup.fp8_lookup(table, tokens, _take, RECIPE), _take(table, tokens))
  np.testing.assert_allclose(value, (_take(table, tokens) * g).sum(), rtol=1e-6)
  np.testing.assert_array_equal(grad, _expected_grad(table, tokens, g))
  exact = jnp.zeros_like(table).at[tokens].add(g)
  assert not np.array_equal(grad, exact)  # Rounded: e5m2 has 2 mantissa bits.
  # Each cotangent element rounds by at most 2**-3 of itself (2 mantissa bits).
  bound = jnp.zeros_like(table).at[tokens].add(jnp.abs(g)) * 2.0**-3
  assert bool(jnp.all(jnp.abs(grad - exact) <= bound * (1 + 1e-5)))


def test_only_whole_row_lookups_of_a_matrix_count():
  take = jax.make_jaxpr(_take)(jnp.ones((5, 3)), jnp.ones(4, int)).eqns[-1].params["jaxpr"].eqns[-1]
  col = jax.make_jaxpr(lambda t, i: jnp.take(t, i, axis=1))(jnp.ones((5, 3)), jnp.ones(4, int))
  col = col.eqns[-1].params["jaxpr"].eqns[-1]
  assert fp8_lookup.is_row_lookup((5, 3), take.params)
  assert not fp8_lookup.is_row_lookup((5, 3), col.params)  # Columns.
  assert not fp8_lookup.is_row_lookup((5, 3, 2), take.params)  # Not a matrix.


class _Embedder(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return nn.Embed(40, 8, name="embed")(tokens)


def _grads(recipe, params, tokens, y):
  def loss(p, b):
    return (_Embedder().apply(p, b["tokens"]) * b["y"]).sum()

  f = autocast_lib.step_autocast(loss, jnp.bfloat16, recipe)
  return jax.jit(jax.grad(f))(params, {"tokens": tokens, "y": y})


def test_a_train_steps_embedding_gets_the_e5m2_cotangent_and_a_keep_rule_keeps_it_exact():
  k = jax.random.split(jax.random.key(1), 3)
  tokens = jax.random.randint(k[0], (6, 5), 0, 40)
  y = jax.random.normal(k[1], (6, 5, 8))
  params = _Embedder().init(k[2], tokens)
  table = params["params"]["embed"]["embedding"]
  fp8 = _grads(RECIPE, params, tokens, y)["params"]["embed"]["embedding"]
  nothing = "fp8 is on, but the function runs no floating matmul"  # Nor an FP8 lookup.
  with pytest.warns(UserWarning, match=nothing):
    kept = _grads(jmp.Float8Recipe(min_size=0, keep="embed"), params, tokens, y)
  bf16 = _grads(None, params, tokens, y)
  # The lookup runs on the float32 table (exact in any dtype), so its cotangent is y, then e5m2.
  np.testing.assert_array_equal(fp8, _expected_grad(table, tokens, y))
  assert_bitwise_equal(kept, bf16)
  assert not np.array_equal(fp8, bf16["params"]["embed"]["embedding"])
  # A min_size above the lookup's sizes (30 tokens, 40 rows, 8 features) keeps it too.
  with pytest.warns(UserWarning, match=nothing):
    assert_bitwise_equal(_grads(jmp.Float8Recipe(min_size=9), params, tokens, y), bf16)


def test_a_lookup_of_a_batch_table_is_left_alone():
  def loss(p, b):
    return (jnp.take(b["table"], b["tokens"], axis=0) * p["w"]).sum()

  k = jax.random.split(jax.random.key(2), 2)
  params = {"w": jax.random.normal(k[0], (5, 8))}
  batch = {"table": jax.random.normal(k[1], (40, 8)), "tokens": jnp.arange(5)}
  grad = jax.grad(lambda t: autocast_lib.step_autocast(loss, jnp.bfloat16, RECIPE)(params, dict(batch, table=t)))
  exact = jax.grad(lambda t: loss(params, dict(batch, table=t)))
  assert_bitwise_equal(grad(batch["table"]), exact(batch["table"]))


def test_a_train_step_with_an_fp8_embedding_trains_without_retracing():
  k = jax.random.split(jax.random.key(3), 3)
  tokens = jax.random.randint(k[0], (6, 5), 0, 40)
  y = jax.random.normal(k[1], (6, 5, 8))
  params = _Embedder().init(k[2], tokens)

  traces = []

  def loss(p, b):
    traces.append(1)
    return ((_Embedder().apply(p, b["tokens"]) - b["y"]) ** 2).mean()

  step = jmp.make_train_step(loss, jmp.get_policy("mixed_bfloat16"), autocast=True, fp8=RECIPE)
  state = jmp.TrainState.create(params=params, tx=optax.adam(0.05))
  batch = {"tokens": tokens, "y": y}
  first = float(loss(params, batch))
  state, metrics = step(state, batch)
  traced = len(traces)
  for _ in range(30):
    state, metrics = step(state, batch)
  assert float(metrics["loss"]) < 0.5 * first
  assert len(traces) == traced  # No retrace after the first call.
  assert state.params["params"]["embed"]["embedding"].dtype == jnp.float32

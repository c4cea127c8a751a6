"""The weights' amaxes known before their matmuls (issue 44), on one device.

The multi-device behaviour (the cast before the gather, bit for bit) is in
``tests/test_fsdp_fp8.py``; what the wire carries, in ``benchmarks.fsdp_census``.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from conftest import assert_bitwise_equal
from jmp_lite._src.autocast import autocast as autocast_lib
from jmp_lite._src.fp8 import known as fp8_known
from jmp_lite._src.fp8 import dot as fp8_dot
from jmp_lite._src.fp8 import plan as fp8_plan

RECIPE = jmp.Float8Recipe(min_size=0)
DN = (((1,), (0,)), ((), ()))


def _exact(f, *args):
  closed = jax.make_jaxpr(f)(*args)
  paths = [f"a{k}" for k in range(len(closed.jaxpr.invars))]
  return [m.exact for _, m in fp8_plan.matmuls(closed.jaxpr, paths)]


def test_an_operand_holds_its_leaf_through_casts_and_transposes_only():
  w, x = jnp.ones((8, 4)), jnp.ones((3, 8))
  assert _exact(lambda w, x: x @ w.astype(jnp.bfloat16).astype(jnp.float32), w, x) == [("a1", "a0")]
  assert _exact(lambda w, x: x @ jax.jit(lambda v: v.T.T)(w), w, x) == [("a1", "a0")]
  assert _exact(lambda w, x: x @ (w * 2.0), w, x) == [("a1", None)]  # Not the leaf's values.


def test_inside_a_scan_or_a_while_the_operand_is_a_slice_or_a_carry():
  ws, x = jnp.ones((2, 8, 8)), jnp.ones((3, 8))

  def stacked(ws, x):
    return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]

  def looped(w, x):
    return jax.lax.fori_loop(0, 2, lambda i, c: (c[0] @ c[1], c[1] * 2.0), (x, w))[0]

  assert _exact(stacked, ws, x) == [(None, None)]
  assert _exact(looped, ws[0], x) == [(None, None)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_known_amax_gives_the_product_and_gradients_bit_for_bit(jit):
  k1, k2 = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(k1, (16, 32)) * 3).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (32, 8)) * jnp.logspace(-2, 2, 8)).astype(jnp.bfloat16)

  def loss(x, w, amax):
    out = fp8_dot.fp8_dot_general(x, w, DN, recipe=RECIPE, amaxes=(None, amax))
    return jnp.sum(out.astype(jnp.float32) * jnp.arange(8.0))

  grad = jax.value_and_grad(loss, (0, 1))
  grad = jax.jit(grad) if jit else grad
  master_amax = jnp.max(jnp.abs(w.astype(jnp.float32)))
  assert_bitwise_equal(grad(x, w, master_amax), grad(x, w, None))
  # The amax is what the quantisation reads: a larger one moves the product.
  assert float(grad(x, w, 4 * master_amax)[0]) != float(grad(x, w, None)[0])


def test_the_step_autocast_quantises_its_arguments_with_the_amaxes_taken_before(monkeypatch):
  w = jnp.array(np.linspace(-2.0, 3.0, 64).reshape(8, 8), jnp.float32)
  x = jnp.full((4, 8), -0.5, jnp.float32)
  seen = []
  original = fp8_known.amax_of

  def spy(path, operand):
    found = original(path, operand)
    seen.append((path, None if found is None else float(found)))
    return found

  monkeypatch.setattr(fp8_known, "amax_of", spy)
  f = autocast_lib.step_autocast(lambda p, x: (x @ p["w"]).sum(), jnp.bfloat16, RECIPE)
  out = f({"w": w.astype(jnp.bfloat16)}, x.astype(jnp.bfloat16))
  # The params' only: the batch's rows are scaled where they are (each device
  # its own under FSDP, fp8_groups.groups_of), not by one amax over all devices.
  assert sorted(seen) == [("1", None), ("w", 3.0)], seen
  plain = jmp.autocast(lambda w, x: (x @ w).sum(), jnp.bfloat16, fp8=RECIPE)(w, x)
  assert float(out) == float(plain)


def test_a_step_whose_layers_call_a_jitted_helper_trains_and_retraces():
  # Autocast traces a nested jit's body on its own: an amax taken outside it
  # would be a constant of another trace (it was: "No constant handler").
  dense = jax.jit(lambda w, x: jnp.tanh(x @ w))

  def loss_fn(p, b):
    return jnp.mean(dense(p["w2"], dense(p["w1"], b["x"])).astype(jnp.float32) ** 2)

  params = {"w1": jnp.full((16, 16), 0.1), "w2": jnp.full((16, 16), -0.2)}
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True, fp8=RECIPE)
  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-2))
  losses = []
  for n in (8, 4, 8):  # A second shape: a second trace.
    state, metrics = step(state, {"x": jnp.linspace(-1, 1, n * 16).reshape(n, 16)})
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[2] < losses[0], losses


def _mlp_loss(p, b):
  h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def _mlp_problem():
  k = jax.random.split(jax.random.key(5), 4)
  params = {"w1": jax.random.normal(k[0], (16, 32)) * 0.3, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k[1], (32, 4)) * 0.3}
  batch = {"x": jax.random.normal(k[2], (24, 16)), "y": jax.random.normal(k[3], (24, 4))}
  return params, batch


def test_a_state_keeps_its_weights_amaxes_and_the_fp8_step_reads_them_not_the_weights(monkeypatch):
  params, batch = _mlp_problem()
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8)
  policy = jmp.get_policy("mixed_bfloat16")
  kept = jmp.TrainState.create(params=params, tx=tx, weight_amaxes=True)
  plain = jmp.TrainState.create(params=params, tx=tx)
  assert plain.weight_amaxes is None
  assert sorted(jax.tree.leaves(fp8_known.by_path(kept.weight_amaxes))) == sorted(
      [jnp.max(jnp.abs(params["w1"])), jnp.max(jnp.abs(params["w2"]))])
  assert jmp.memory_ledger(kept).bytes_of("weight amaxes") == 8  # Two float32 scalars.
  step_plain = jmp.make_train_step(_mlp_loss, policy, autocast=True, fp8=RECIPE)
  for _ in range(3):
    plain, _ = step_plain(plain, batch)

  def refuse(paths, leaves):
    raise AssertionError("the step took the weights' amaxes instead of the state's")

  monkeypatch.setattr(fp8_known, "weight_amaxes", refuse)
  traces = []
  step = jmp.make_train_step(lambda p, b: traces.append(1) or _mlp_loss(p, b), policy,
                             autocast=True, fp8=RECIPE)
  for _ in range(3):
    kept, metrics = step(kept, batch)
    # Written with the masters: each is the amax of the weights the state now holds.
    assert_bitwise_equal(kept.weight_amaxes, fp8_known.tree_amaxes(kept.params))
  assert len(traces) == 1  # Stable structure: no retrace.
  assert_bitwise_equal(kept.params, plain.params)  # The same scales, read instead of reduced.


def test_a_skipped_step_leaves_the_amaxes_bit_for_bit_and_replace_takes_them_anew():
  params, batch = _mlp_problem()
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8)
  state = jmp.TrainState.create(params=params, tx=tx, master_dtype=jnp.bfloat16,
                                rounding="nearest", weight_amaxes=True)
  step = jmp.make_train_step(_mlp_loss, jmp.get_policy("mixed_bfloat16"), autocast=True, fp8=RECIPE)
  state, _ = step(state, batch)
  before = jax.device_get(state.weight_amaxes)  # The step donates the state.
  state, metrics = step(state, dict(batch, x=batch["x"].at[3, 2].set(jnp.nan)))
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.weight_amaxes, before)
  assert state.weight_amaxes["w1"].dtype == jnp.bfloat16  # The masters' dtype: exact.
  bigger = state.replace(params=jax.tree.map(lambda x: x * 4, state.params))
  assert float(bigger.weight_amaxes["w2"]) == 4 * float(before["w2"])
  with pytest.raises(TypeError, match="weight_amaxes"):
    jmp.TrainState.create(params=params, tx=tx, weight_amaxes="yes")


def test_replace_refuses_weight_amaxes_unlike_the_params():
  # A tree unlike the params was accepted (and the step read amaxes by path from it).
  params, _ = _mlp_problem()
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1), weight_amaxes=True)
  amaxes = state.weight_amaxes
  with pytest.raises(ValueError, match=r"^weight_amaxes must .*: no amax for the weight\(s\) "
                                       r"\['w2'\]$"):
    state.replace(weight_amaxes={"w1": amaxes["w1"], "b1": None})
  with pytest.raises(ValueError, match=r": leaves at \['b1'\], which hold no weight matrix"):
    state.replace(weight_amaxes=state.params)  # The params themselves.
  with pytest.raises(ValueError, match=r": the amax at 'w1' has shape \(2,\), not \(\)"):
    state.replace(weight_amaxes={**amaxes, "w1": jnp.stack([amaxes["w1"]] * 2)})
  with pytest.raises(ValueError, match=r"no amax for the weight\(s\) \['w3'\]"):  # New params.
    state.replace(params={**state.params, "w3": jnp.ones((4, 4))}, weight_amaxes=amaxes)
  with pytest.raises(ValueError, match=r": its tree structure is PyTreeDef\(CustomNode\(OrderedDict"):
    state.replace(weight_amaxes=collections.OrderedDict(amaxes))  # The same paths.
  # Accepted: None, the state's own, new params' own; under jit a structure check (no op).
  assert state.replace(weight_amaxes=None).weight_amaxes is None
  doubled = jax.tree.map(lambda x: x * 2, state.params)
  again = state.replace(params=doubled, weight_amaxes=fp8_known.tree_amaxes(doubled))
  assert float(again.weight_amaxes["w1"]) == 2 * float(amaxes["w1"])
  jaxpr = jax.make_jaxpr(lambda s: s.replace(weight_amaxes=s.weight_amaxes).weight_amaxes)(state)
  assert jaxpr.eqns == []


def test_a_rowwise_step_takes_each_weights_row_amaxes_before_and_matches_bit_for_bit(monkeypatch):
  rowwise = jmp.Float8Recipe(min_size=0, scaling="rowwise")
  w = jnp.array(np.linspace(-2.0, 3.0, 64).reshape(8, 8) * np.logspace(-2, 1, 8), jnp.float32)
  x = jnp.array(np.linspace(-1.0, 1.0, 32).reshape(4, 8), jnp.float32)
  seen = []
  original = fp8_known.amax_of

  def spy(path, operand):
    found = original(path, operand)
    seen.append((path, None if found is None else found.shape))
    return found

  monkeypatch.setattr(fp8_known, "amax_of", spy)

  def loss(p, x):
    return (jnp.tanh(x @ p["w"]) @ p["w"].T).sum()  # w in its layout, then transposed.

  f = autocast_lib.step_autocast(loss, jnp.bfloat16, rowwise)
  value, grad = jax.value_and_grad(f)({"w": w}, x)
  # The first use: max over w's contracting axis 0, one per column, taken before.
  assert ("w", (0,)) in [s[0] for s in seen] and dict(seen)[("w", (0,))] == (1, 8), seen
  assert None in [s[0] for s in seen]  # The transposed use reduces its operand itself.
  plain = jmp.autocast(loss, jnp.bfloat16, fp8=rowwise)  # Not a step: reduces every operand.
  value_p, grad_p = jax.value_and_grad(plain)({"w": w}, x)
  assert_bitwise_equal((value, grad), (value_p, grad_p))

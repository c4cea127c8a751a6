"""Steering FP8 (issue 30): keep rules by path, a minimum GEMM size, and the sensitivity report.

Which matmuls run in FP8 is read from the jaxpr (``precision_report`` counts a
matmul on float8 operands as ``float8_e4m3fn``, one in half as ``bfloat16``).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite as jmp

BF16, E4M3 = "bfloat16", "float8_e4m3fn"


# Every matmul in FP8, toy shapes included: the default min_size keeps GEMMs under 4096 in half.
FP8 = jmp.Float8Recipe(min_size=0)


def counts(fn, *args, **kw):
  """``{dtype: matmuls}`` of ``fn``'s forward pass (or its step's backward with backward=True)."""
  report = jmp.precision_report(fn, *args, **kw)
  found = {d: report.count("matmul", d) for d in (BF16, E4M3, f"{E4M3}+float8_e5m2")}
  return {d: n for d, n in found.items() if n}


def normal(seed, shape, scale=1.0):
  return jax.random.normal(jax.random.key(seed), shape) * scale


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(16)(x)


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.first = nnx.Linear(32, 64, rngs=rngs)
    self.middle = nnx.Linear(64, 64, rngs=rngs)
    self.last = nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.last(nnx.relu(self.middle(nnx.relu(self.first(x)))))


def linen_problem():
  """``(params, batch, loss_fn)``: the Linen MLP on 8 examples of 16 classes."""
  model, x = LinenMLP(), normal(0, (8, 32))

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           batch["y"]).mean()

  return model.init(jax.random.key(1), x)["params"], {"x": x, "y": jnp.arange(8) % 16}, loss_fn


# ------------------------------------------------------------------ keep rules


def test_keep_rules_on_linen_by_path_and_by_callable():
  model, x = LinenMLP(), normal(0, (8, 32))
  variables = model.init(jax.random.key(1), x)
  fn = lambda recipe: jmp.autocast(model.apply, jnp.bfloat16, fp8=recipe)
  assert counts(fn(FP8), variables, x) == {E4M3: 3}
  # Paths within the arguments: the first argument's leaves begin with "0/".
  first_last = jmp.Float8Recipe(min_size=0, keep=(r"^0/params/Dense_0/", r"Dense_2"))
  assert counts(fn(first_last), variables, x) == {BF16: 2, E4M3: 1}
  by_callable = jmp.Float8Recipe(min_size=0, keep=lambda path, leaf: leaf.shape == (64, 64))
  assert counts(fn(by_callable), variables, x) == {BF16: 1, E4M3: 2}
  assert np.isfinite(np.asarray(fn(first_last)(variables, x), np.float32)).all()


def test_keep_rules_on_nnx_and_equinox():
  x = normal(0, (8, 32))
  graph, state = nnx.split(NNXMLP(nnx.Rngs(0)))
  apply = lambda state, x: nnx.merge(graph, state)(x)
  recipe = jmp.Float8Recipe(min_size=0, keep="last")
  assert counts(jmp.autocast(apply, jnp.bfloat16, fp8=recipe), state, x) == {BF16: 1, E4M3: 2}
  mlp = eqx.nn.MLP(32, 16, 64, depth=2, key=jax.random.key(0))
  batched = lambda m, x: jax.vmap(m)(x)
  recipe = jmp.Float8Recipe(min_size=0, keep=r"layers/0/weight")
  assert counts(jmp.autocast(batched, jnp.bfloat16, fp8=recipe), mlp, x) == {BF16: 1, E4M3: 2}


def test_a_keep_rule_keeps_a_whole_scanned_stack():
  """Stacked layers under scan: the rule matches the stacked leaf, every step stays in half."""
  def scanned(params, h):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h @ params["proj"], params["stack"])
    return h
  params = {"proj": normal(1, (32, 48)), "stack": normal(2, (4, 48, 48), 0.1)}
  x = normal(0, (8, 32))
  fn = lambda recipe: jmp.autocast(scanned, jnp.bfloat16, fp8=recipe)
  assert counts(fn(FP8), params, x) == {E4M3: 2}
  assert counts(fn(jmp.Float8Recipe(min_size=0, keep="stack")), params, x) == {BF16: 1, E4M3: 1}
  assert counts(fn(jmp.Float8Recipe(min_size=0, keep="proj")), params, x) == {BF16: 1, E4M3: 1}


def test_keep_rules_in_the_train_step_see_the_params_own_paths():
  """Under make_train_step the paths are the params' (``Dense_0/kernel``), as the policy's."""
  params, batch, loss_fn = linen_problem()

  recipe = jmp.Float8Recipe(min_size=0, keep=r"^Dense_0/")
  policy = jmp.get_policy("mixed_bfloat16")
  # Forward: Dense_0 in half. Backward: its weight gradient in half too (its
  # input gradient is not needed), the other two layers' two GEMMs each in FP8.
  found = counts(loss_fn, params, batch, policy=policy, autocast=True, fp8=recipe, backward=True)
  assert found == {BF16: 2, E4M3: 2, f"{E4M3}+float8_e5m2": 4}, found
  step = jmp.make_train_step(loss_fn, policy, autocast=True, fp8=recipe)
  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-2))
  losses = []
  for _ in range(30):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.5 * losses[0]


def test_a_rule_that_keeps_no_matmul_warns_naming_it():
  model, x = LinenMLP(), normal(0, (8, 32))
  variables = model.init(jax.random.key(1), x)
  with pytest.warns(UserWarning, match=r"keep rule 'dense_0' of the Float8Recipe selects no "
                                       r"argument leaf that a matmul reads.*'0/params/Dense_"):
    recipe = jmp.Float8Recipe(min_size=0, keep="dense_0")
    jmp.autocast(model.apply, jnp.bfloat16, fp8=recipe)(variables, x)


# ----------------------------------------------------------------- min_size


@pytest.mark.parametrize("min_size,expected", [
    (0, {E4M3: 3}), (16, {E4M3: 3}), (17, {BF16: 3}),
    (32, {BF16: 3}), (8, {E4M3: 3}),
])
def test_min_size_checks_each_gemm_size_batch_dims_excluded(min_size, expected):
  """Three GEMMs: 16x32x64, 16x64x64 (batched x4: the batch dim does not count), 16x64x16."""
  def fn(p, x):
    h = x @ p["a"]                                                  # M=16 K=32 N=64
    h = jnp.einsum("bmk,bkn->bmn", jnp.stack([h] * 4), jnp.stack([p["b"]] * 4))[0]  # x4
    return h @ p["c"]                                               # M=16 K=64 N=16
  p = {"a": normal(1, (32, 64)), "b": normal(2, (64, 64)), "c": normal(3, (64, 16))}
  x = normal(0, (16, 32))
  recipe = jmp.Float8Recipe(min_size=min_size)
  if E4M3 in expected:
    assert counts(jmp.autocast(fn, jnp.bfloat16, fp8=recipe), p, x) == expected
  else:  # FP8 asked for and nothing large enough: said, not silent.
    with pytest.warns(UserWarning, match=rf"fp8 is on, but none of the 3 matmuls reaches the "
                                         rf"recipe's min_size={min_size} .*the largest is 16 x 64 x 64"):
      assert counts(jmp.autocast(fn, jnp.bfloat16, fp8=recipe), p, x) == expected


@pytest.mark.parametrize("fp8", [True, jmp.Float8Recipe(scaling="rowwise")])
def test_by_default_only_gemms_of_4096_and_up_run_in_fp8(fp8):
  """The default min_size (4096, where FP8 starts to pay on an H100: docs/fp8.md)."""
  assert jmp.Float8Recipe().min_size == 4096
  fn = jmp.autocast(lambda w, x: x @ w, jnp.bfloat16, fp8=fp8)
  for (m, k, n), expected in [((4096, 4096, 4096), {E4M3: 1}), ((4096, 4096, 4095), {BF16: 1}),
                              ((4095, 8192, 8192), {BF16: 1}), ((8192, 4096, 16384), {E4M3: 1}),
                              ((8, 32, 64), {BF16: 1})]:
    w, x = jax.ShapeDtypeStruct((k, n), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.float32)
    if E4M3 in expected:
      assert counts(fn, w, x) == expected, (m, k, n)
    else:
      with pytest.warns(UserWarning, match="fp8 is on, but none of the 1 matmuls reaches"):
        assert counts(fn, w, x) == expected, (m, k, n)


def _conv_loss(params, batch):  # A convolution and a sum: no matmul for FP8 to take.
  y = jax.lax.conv(batch["x"], params["k"], (1, 1), "SAME")
  return jnp.mean(jnp.tanh(y) ** 2)


@pytest.mark.parametrize("fp8", [True, FP8], ids=["default", "min_size_0"])
def test_fp8_on_a_function_without_a_matmul_warns_as_min_size_does(fp8):
  # Was silent, while matmuls under min_size warned: FP8 asked for, nothing in it.
  params = {"k": normal(1, (4, 3, 3, 3))}
  batch = {"x": normal(0, (2, 3, 8, 8))}
  match = r"^fp8 is on, but the function runs no floating matmul .* so nothing runs in FP8"
  with pytest.warns(UserWarning, match=match) as caught:
    jmp.autocast(_conv_loss, jnp.bfloat16, fp8=fp8)(params, batch)
  assert len(caught) == 1
  step = jmp.make_train_step(_conv_loss, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=fp8)
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1))
  with pytest.warns(UserWarning, match=match):
    step(state, batch)
  # One class and one message for both: a matmul under min_size says the same.
  with pytest.warns(UserWarning, match=r"^fp8 is on, but none of the 1 matmuls .* so nothing "
                                       r"runs in FP8: every one runs in the half dtype") as caught:
    jmp.autocast(lambda w, x: x @ w, jnp.bfloat16, fp8=jmp.Float8Recipe(min_size=64))(
        normal(1, (8, 8)), normal(0, (4, 8)))
  assert [w.category for w in caught] == [UserWarning]


def test_min_size_in_between_splits_the_gemms():
  def fn(p, x):
    return (x @ p["wide"]) @ p["narrow"]   # 64x128x256, then 64x256x8
  p, x = {"wide": normal(1, (128, 256)), "narrow": normal(2, (256, 8))}, normal(0, (64, 128))
  recipe = jmp.Float8Recipe(min_size=64)
  assert counts(jmp.autocast(fn, jnp.bfloat16, fp8=recipe), p, x) == {BF16: 1, E4M3: 1}


# ------------------------------------------------------------- rowwise in use


def test_rowwise_recipe_trains_in_the_step():
  params, batch, loss_fn = linen_problem()

  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0, scaling="rowwise"))
  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-2))
  first = None
  for _ in range(30):
    state, metrics = step(state, batch)
    first = float(metrics["loss"]) if first is None else first
  assert float(metrics["loss"]) < 0.5 * first and bool(metrics["grads_finite"])


# ------------------------------------------------------------ the sensitivity report


OUTLIERS = jnp.array([3, 17, 40])


def hostile_mlp(params, x):
  """Three layers; the second one's input has three features 1e5 times the rest.

  Their weights are 1e-5 times the others, so they do not drown the output:
  the error comes from the normal features, which one scale per tensor
  leaves with a bit or two of mantissa.
  """
  h = jax.nn.relu(x @ params["layer1"]) * jnp.ones(64).at[OUTLIERS].set(1e5)
  h = jax.nn.relu(h @ params["layer2"])
  return jnp.mean((h @ params["layer3"]) ** 2)


def test_sensitivity_ranks_the_layer_with_the_hostile_input_first():
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"layer1": jax.random.normal(keys[0], (32, 64)) * 0.2,
            "layer2": jax.random.normal(keys[1], (64, 64)).at[OUTLIERS].multiply(1e-5) * 0.1,
            "layer3": jax.random.normal(keys[2], (64, 8)) * 0.1}
  x = jax.random.normal(keys[3], (128, 32))
  report = jmp.fp8_sensitivity(hostile_mlp, params, x)
  assert [r.weight for r in report.rows][0] == "0/layer2"
  assert len(report.rows) == 3 and report.rows[0].output_error > 10 * report.rows[1].output_error
  assert report.rows[0].shape == (128, 64, 64, 1)
  assert all(r.grad_error is not None and r.grad_error >= 0 for r in report.rows)
  text = str(report)
  assert text.splitlines()[2].startswith("layer2 ") and "128x64x64" in text
  # The rule the report offers keeps that layer in half, in autocast and in the step.
  rule = report.keep_rule(1)
  assert rule == "(?:^|/)(?:layer2)$"
  kept = jmp.autocast(hostile_mlp, jnp.bfloat16, fp8=jmp.Float8Recipe(min_size=0, keep=rule))
  assert counts(kept, params, x) == {BF16: 1, E4M3: 2}
  # Rowwise scales (per row of the input, per column of the weights) cut its error.
  rowwise = jmp.fp8_sensitivity(hostile_mlp, params, x, recipe=jmp.Float8Recipe(scaling="rowwise"))
  by_weight = {r.weight: r for r in rowwise.rows}
  assert by_weight["0/layer2"].output_error < 0.3 * report.rows[0].output_error


def test_sensitivity_names_matmuls_without_a_weight_by_position():
  def fn(q, k):
    scores = q @ k.T                        # reads both arguments: the first one's is the weight
    return jnp.sum((scores @ scores.T) ** 2)  # reads no argument: named by position
  q, k = normal(0, (16, 32), 0.2), normal(1, (24, 32), 0.2)
  report = jmp.fp8_sensitivity(fn, q, k, dtype=jnp.float16)
  rows = sorted(report.rows, key=lambda r: r.index)
  assert [(r.index, r.paths, r.weight) for r in rows] == [(0, ("0", "1"), "0"), (1, (), None)]
  assert rows[1].label == "#1" and rows[1].grad_error is None and rows[0].grad_error > 0
  assert report.dtype == np.dtype(jnp.float16)
  assert report.keep_rule(2) == "(?:^|/)(?:0)$"  # Only matmuls that read an argument.


def test_sensitivity_compiles_once_whatever_the_number_of_matmuls():
  """The rows come from one program: tracing ``fn`` does not grow with its matmuls."""

  def traces_of(layers):
    traces = []

    def loss(p, x):
      traces.append(1)
      for w in p:
        x = jnp.tanh(x @ w)
      return jnp.mean(x ** 2)

    keys = jax.random.split(jax.random.key(0), layers + 1)
    p = [jax.random.normal(k, (16, 16)) for k in keys[1:]]
    report = jmp.fp8_sensitivity(loss, p, jax.random.normal(keys[0], (32, 16)))
    assert len(report.rows) == layers and all(r.grad_error > 0 for r in report.rows)
    return len(traces)

  assert traces_of(2) == traces_of(6)


def test_sensitivity_bad_input():
  params, x = {"w": normal(0, (8, 8))}, normal(1, (4, 8))
  f = lambda p, x: jnp.sum(x @ p["w"])
  with pytest.raises(TypeError, match="recipe must be a jmp_lite.Float8Recipe or None, got True"):
    jmp.fp8_sensitivity(f, params, x, recipe=True)
  with pytest.raises(ValueError, match="dtype must be jnp.float16 or jnp.bfloat16"):
    jmp.fp8_sensitivity(f, params, x, dtype=jnp.float32)
  with pytest.raises(ValueError, match="fn has no floating matmul"):
    jmp.fp8_sensitivity(lambda p, x: jnp.sum(p["w"]), params, x)
  with pytest.raises(TypeError, match="fn must be callable"):
    jmp.fp8_sensitivity(3, params, x)
  report = jmp.fp8_sensitivity(f, params, x)
  for k in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=f"k must be an int >= 1, got {k!r}"):
      report.keep_rule(k)

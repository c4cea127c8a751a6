"""precision_report: what really ran in half, on models written the way their users write them."""

import dataclasses

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jmp

F16, F32 = jnp.float16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
  """lm1b-style configuration: the model's layers take their dtype from here."""

  dtype: object = jnp.float32
  width: int = 16


class PinnedMlpBlock(nn.Module):
  """Written like Flax's lm1b MlpBlock: every layer gets ``dtype=config.dtype``."""

  config: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    x = x.astype(cfg.dtype)  # lm1b casts activations to the configured dtype.
    h = nn.Dense(cfg.width * 2, dtype=cfg.dtype)(x)
    h = nn.LayerNorm(dtype=cfg.dtype)(nn.gelu(h))
    h = h[:, None, :]
    h = nn.MultiHeadDotProductAttention(num_heads=2, dtype=cfg.dtype, deterministic=True)(h, h)
    return nn.Dense(4, dtype=cfg.dtype)(h[:, 0])


def _pinned(dtype):
  model = PinnedMlpBlock(Config(dtype=dtype))
  x = jax.random.normal(jax.random.key(0), (3, 8))
  variables = model.init(jax.random.key(1), x)

  def loss_fn(params, x):
    return jnp.mean(model.apply({"params": params}, x) ** 2)

  return loss_fn, variables["params"], x


@pytest.mark.parametrize("dtype", [jnp.float32, None])
def test_a_model_pinned_to_float32_is_reported_as_float32(dtype):
  loss_fn, params, x = _pinned(dtype)
  report = jmp.precision_report(loss_fn, params, x, policy="mixed_float16")
  matmuls = report.count("matmul")
  # Two Dense, the attention's q/k/v/out projections, its weights-by-values einsum; its
  # scores, over sequences of one token, are inner products: reductions, not matmuls.
  assert matmuls == 7 and report.count("reduction", F32) >= 1
  # dtype=None too: ``x.astype(None)`` is float32, and the layers follow their inputs.
  assert report.count("matmul", F32) == matmuls and report.count("matmul", F16) == 0
  on = jmp.precision_report(loss_fn, params, x, policy="mixed_float16", autocast=True)
  assert on.count("matmul", F16) == matmuls and on.count("matmul", F32) == 0
  # Autocast runs the softmax's exp and the norms' statistics in float32.
  assert on.count("exp/log", F16) == 0 and on.count("norm stats", F16) == 0


def test_counts_and_table_of_a_small_function():
  def loss_fn(params, x):
    h = jnp.tanh(x @ params["w1"])
    logits = h.astype(F32) @ params["w2"].astype(F32)
    return jnp.mean(jax.nn.log_softmax(logits))

  params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
  x = jax.ShapeDtypeStruct((2, 8), F32)  # Nothing is computed.
  report = jmp.precision_report(loss_fn, params, x, policy="mixed_float16")
  assert report.counts["matmul"] == {"float16": 1, "float32": 1}
  assert report.count("exp/log") == report.count("exp/log", F32) == 2  # exp and log
  assert report.count("conv") == 0
  # Issue 37 item 4: every kind is a key, as every kind is a row of the table.
  assert list(report.counts) == ["matmul", "conv", "exp/log", "reduction", "norm stats", "other"]
  assert report.counts["conv"] == {} and report.counts["norm stats"] == {}
  lines = str(report).splitlines()
  assert lines[0].split() == ["kind", "float16", "float32", "total"]
  assert lines[1].split() == ["matmul", "1", "1", "2"]
  assert len(lines) == 1 + len(("matmul", "conv", "exp/log", "reduction", "norm stats", "other"))
  # Without a policy the function is traced as given: all float32.
  assert jmp.precision_report(loss_fn, params, x).count("matmul", F32) == 2


def test_loops_branches_and_the_backward_pass():
  def f(w, x):
    def body(h, _):
      return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(body, x, None, length=5)
    return jax.lax.cond(h.sum() > 0, lambda: jnp.sum(h @ w), lambda: jnp.sum(h))

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  forward = jmp.precision_report(f, w, x, policy="mixed_bfloat16")
  assert forward.counts["matmul"] == {"bfloat16": 2}  # The scan body counts once.
  backward = jmp.precision_report(jax.grad(f), w, x, policy="mixed_bfloat16")
  assert backward.count("matmul", jnp.bfloat16) > forward.count("matmul")


def test_equinox_module_and_static_batch_leaves():
  model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))  # holds jax.nn.relu

  def loss_fn(model, batch):
    assert batch["split"] == "train"
    return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)

  batch = {"x": jnp.ones((5, 4)), "split": "train"}
  report = jmp.precision_report(loss_fn, model, batch, policy="mixed_float16")
  assert report.counts["matmul"] == {"float16": 3}


def test_bad_arguments():
  f = lambda w, x: jnp.sum(x @ w)
  w, x = jnp.ones((2, 2)), jnp.ones((2, 2))
  with pytest.raises(ValueError, match="autocast=True needs a policy"):
    jmp.precision_report(f, w, x, autocast=True)
  with pytest.raises(TypeError, match="policy must be"):
    jmp.precision_report(f, w, x, policy=3)
  with pytest.raises(TypeError, match="fn must be callable"):
    jmp.precision_report("f", w, x)
  with pytest.raises(ValueError, match="kind must be one of"):
    jmp.precision_report(f, w, x).count("matmuls")


@pytest.mark.parametrize("dtype", [jnp.float32, None])
def test_lint_flags_matmuls_that_a_pinned_model_runs_in_float32(dtype):
  loss_fn, params, x = _pinned(dtype)
  findings = jmp.precision_lint(loss_fn, params, x, policy="mixed_float16")
  pinned = [f for f in findings if f.reason.startswith("runs in float32")]
  assert len(pinned) == 7 and {f.op for f in pinned} == {"dot_general"}  # Scores: see above.
  assert all("autocast=True" in f.reason and "float16" in f.reason for f in pinned)
  fixed = jmp.precision_lint(loss_fn, params, x, policy="mixed_float16", autocast=True)
  assert not [f for f in fixed if f.reason.startswith("runs in float32")]


def test_lint_under_autocast_reports_nothing_autocast_runs_in_float32():
  def attention_loss(params, x):
    q, k, v = (x @ params[n] for n in ("q", "k", "v"))
    weights = jax.nn.softmax(q @ k.T / 4.0)  # exp, sum and div: float32 under autocast
    return jnp.mean((weights @ v).astype(F32) ** 2)

  params = {n: jnp.ones((16, 16)) * 0.1 for n in ("q", "k", "v")}
  x = jnp.ones((8, 16))
  plain = jmp.precision_lint(attention_loss, params, x, policy="mixed_float16")
  assert {f.op for f in plain} >= {"softmax/logsumexp"}
  assert jmp.precision_lint(attention_loss, params, x, policy="mixed_float16", autocast=True) == []


def test_a_matmul_with_a_literal_operand_is_counted():
  # A scalar constant is inlined in the jaxpr as a Literal (not hashable):
  # the float8 source walk must step over it, not crash.
  def f(x):
    return jax.lax.dot_general(x, np.float32(2.0), (((), ()), ((), ()))).sum()

  report = jmp.precision_report(f, jnp.ones(3))
  assert report.count("matmul", "float32") == 1
  assert jmp.precision_lint(f, jnp.ones(3), policy="mixed_float16") is not None


def test_nnx_batchnorm_with_float32_statistics_promotes_the_layers_after_it():
  # The step keeps model state in its stored dtype (float32 running statistics).
  # NNX BatchNorm promotes its input with them, so the Linear after it runs in
  # float32 under a plain half policy: the report shows it, the lint flags it,
  # and autocast runs it in half again.
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
      self.bn = nnx.BatchNorm(8, rngs=rngs)
      self.head = nnx.Linear(8 * 16, 16, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1))

  graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, rest, x):
    model = nnx.merge(graphdef, params, rest)
    return model(x).astype(F32).mean(), nnx.state(model, nnx.Not(nnx.Param))

  x = jnp.ones((4, 4, 4, 1))
  kw = dict(policy="mixed_float16", model_state=rest)
  plain = jmp.precision_report(loss_fn, params, x, **kw)
  assert (plain.count("conv", "float16"), plain.count("matmul", "float32")) == (1, 1)
  lint = jmp.precision_lint(loss_fn, params, x, **kw)
  assert [f.op for f in lint if f.reason.startswith("runs in float32")] == ["dot_general"]
  fixed = jmp.precision_report(loss_fn, params, x, autocast=True, **kw)
  assert (fixed.count("conv", "float16"), fixed.count("matmul", "float16")) == (1, 1)


# --- issue 29 item 5 and issue 31 item 8: fp8=, the backward pass, the step's batch options ----


def mlp_loss(params, batch):
  h = jax.nn.relu(batch["x"] @ params["w1"])
  return jnp.mean(((h @ params["w2"]).astype(F32) - batch["y"]) ** 2)


def mlp_problem():
  params = {"w1": jax.random.normal(jax.random.key(0), (32, 64)) * 0.1,
            "w2": jax.random.normal(jax.random.key(1), (64, 16)) * 0.1}
  batch = {"x": jax.random.normal(jax.random.key(2), (8, 32)),
           "y": jax.random.normal(jax.random.key(3), (8, 16))}
  return params, batch


E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
# Every matmul in FP8, toy shapes included: the default min_size keeps GEMMs under 4096 in half.
FP8 = jmp.Float8Recipe(min_size=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_backward_counts_the_steps_gradient_of_the_autocast_loss(policy):
  # Forward: two matmuls. Backward with respect to the params: dW2, dh and dW1
  # (the batch is not differentiated, so x @ w1 has no dx matmul).
  params, batch = mlp_problem()
  half = policy.split("_")[1]
  forward = jmp.precision_report(mlp_loss, params, batch, policy=policy, autocast=True)
  both = jmp.precision_report(mlp_loss, params, batch, policy=policy, autocast=True, backward=True)
  assert forward.counts["matmul"] == {half: 2}
  assert both.counts["matmul"] == {half: 5}
  # The same as grad(autocast(fn)) written out by hand, on the arguments the step casts.
  p = jmp.get_policy(policy)
  by_hand = jmp.precision_report(jax.grad(jmp.autocast(mlp_loss, p.compute_dtype)),
                                 p.cast_to_compute(params), p.cast_to_compute(batch))
  assert by_hand.counts["matmul"] == both.counts["matmul"]
  # A pinned float32 layer stays float32 in the backward pass without autocast.
  def pinned(params, batch):
    return mlp_loss(jax.tree.map(lambda w: w.astype(F32), params),
                    jax.tree.map(lambda v: v.astype(F32), batch))
  plain = jmp.precision_report(pinned, params, batch, policy=policy, backward=True)
  assert plain.counts["matmul"] == {"float32": 5}


def test_backward_fp8_gemms_are_counted_as_fp8():
  params, batch = mlp_problem()
  report = jmp.precision_report(mlp_loss, params, batch, policy="mixed_bfloat16", autocast=True,
                                fp8=FP8, backward=True)
  # The custom VJP also computes the batch's cotangent of x @ w1; nothing reads it,
  # so XLA drops it, and so does the report.
  assert report.counts["matmul"] == {E4M3: 2, f"{E4M3}+{E5M2}": 3}
  recipe = jmp.Float8Recipe(forward=jnp.float8_e5m2, backward=jnp.float8_e5m2, min_size=0)
  swapped = jmp.precision_report(mlp_loss, params, batch, policy="mixed_float16", autocast=True,
                                 fp8=recipe)
  assert swapped.counts["matmul"] == {E5M2: 2}
  wrapped = jmp.autocast(mlp_loss, jnp.bfloat16, fp8=FP8)  # the documented FP8 lint/report
  assert jmp.precision_report(wrapped, params, batch, policy="mixed_bfloat16",
                              backward=True) == report


def test_backward_follows_the_steps_loss_fn_conventions():
  params, batch = mlp_problem()
  with_aux = lambda p, b: (mlp_loss(p, b), {"h": b["x"] @ p["w1"]})
  aux = jmp.precision_report(with_aux, params, batch, policy="mixed_float16", backward=True,
                             has_aux=True)
  assert aux.count("matmul", F16) == 6  # the aux matmul runs once more, forward only
  with pytest.raises(TypeError, match="has_aux=True"):
    jmp.precision_report(with_aux, params, batch, policy="mixed_float16", backward=True)
  stats = {"mean": jnp.zeros(32)}

  def with_state(p, s, b):
    x = b["x"] - s["mean"].astype(b["x"].dtype)
    return mlp_loss(p, {**b, "x": x}), {"mean": jnp.mean(b["x"].astype(F32), axis=0)}

  state = jmp.precision_report(with_state, params, batch, policy="mixed_float16",
                               model_state=stats, backward=True)
  assert state.count("matmul", F16) == 5
  with pytest.raises(TypeError, match=r"\(loss, new_model_state\)"):
    jmp.precision_report(mlp_loss, params, batch, policy="mixed_float16",
                         model_state=stats, backward=True)


def test_grad_of_the_loss_under_autocast_is_refused():
  # Issue 31 item 8: precision_report(jax.grad(fn), autocast=True) counted
  # autocast(grad(fn)), which the step never runs.
  params, batch = mlp_problem()
  for grad in (jax.grad(mlp_loss), jax.value_and_grad(mlp_loss)):
    with pytest.raises(ValueError, match="pass the loss itself with backward=True"):
      jmp.precision_report(grad, params, batch, policy="mixed_float16", autocast=True)
    with pytest.raises(ValueError, match="grad.autocast.fn.."):
      jmp.precision_lint(grad, params, batch, policy="mixed_float16", autocast=True)
  # Without autocast, grad(fn) is what the step differentiates (as given).
  assert jmp.precision_report(jax.grad(mlp_loss), params, batch,
                              policy="mixed_float16").count("matmul") == 5


def test_batch_keep_full_and_cast_batch_trace_the_batch_as_the_step_casts_it():
  params, batch = mlp_problem()
  f16 = jmp.get_policy("mixed_float16")
  cast = jmp.precision_report(mlp_loss, params, batch, policy=f16)
  kept = jmp.precision_report(mlp_loss, params, batch, policy=f16, batch_keep_full=("x",))
  uncast = jmp.precision_report(mlp_loss, params, batch, policy=f16, cast_batch=False)
  assert cast.counts["matmul"] == {"float16": 2}
  # A float32 input promotes the first matmul, and the relu keeps the second float32.
  assert kept.counts["matmul"] == uncast.counts["matmul"] == {"float32": 2}
  only_y = jmp.precision_report(mlp_loss, params, batch, policy=f16, batch_keep_full=("y",))
  assert only_y.counts["matmul"] == {"float16": 2}
  # What the step itself sees: loss_fn's argument dtypes under the same options.
  seen = {}

  def spy(params, batch):
    seen.update({k: v.dtype for k, v in batch.items()})
    return mlp_loss(params, batch)

  state = jmp.TrainState.create(params=params, tx=__import__("optax").sgd(0.1))
  # x kept float32 makes both matmuls float32, on purpose here (NothingInHalfWarning off).
  jmp.make_train_step(spy, f16, batch_keep_full=("x",), warn_no_half=False)(state, batch)
  step_seen = dict(seen)
  jmp.precision_report(spy, params, batch, policy=f16, batch_keep_full=("x",))
  assert seen == step_seen == {"x": F32, "y": F16}


def test_fp8_and_batch_options_are_checked_as_the_step_checks_them():
  params, batch = mlp_problem()
  f32, f16 = jmp.get_policy("float32"), jmp.get_policy("mixed_float16")
  for policy, kwargs in [(f16, dict(fp8=True)), (f32, dict(autocast=True)),
                         (f16, dict(fp8="e4m3")), (f16, dict(cast_batch=1))]:
    with pytest.raises((TypeError, ValueError)) as from_step:
      jmp.make_train_step(mlp_loss, policy, **kwargs)
    with pytest.raises(from_step.type) as from_report:
      jmp.precision_report(mlp_loss, params, batch, policy=policy, **kwargs)
    assert str(from_report.value) == str(from_step.value)
  with pytest.raises(TypeError, match="backward must be True or False, got 'yes'"):
    jmp.precision_report(mlp_loss, params, batch, policy=f16, backward="yes")
  with pytest.raises(ValueError, match="batch_keep_full=\\('y',\\) needs a policy"):
    jmp.precision_report(mlp_loss, params, batch, batch_keep_full=("y",))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_summing_scatter_is_counted_as_a_reduction_in_its_dtype(policy):
  def loss(params, batch):  # segment_sum and .at[].add: one scatter-add each.
    nodes = jax.ops.segment_sum(batch["x"] @ params["w"], batch["ids"], num_segments=4)
    return jnp.mean(jnp.zeros((2, 8), nodes.dtype).at[batch["graph"]].add(nodes))

  params = {"w": jnp.ones((16, 8))}
  batch = {"x": jnp.ones((64, 16)), "ids": jnp.arange(64) % 4, "graph": jnp.array([0, 0, 1, 1])}
  half = np.dtype(jmp.get_policy(policy).compute_dtype).name
  plain = jmp.precision_report(loss, params, batch, policy=policy)
  auto = jmp.precision_report(loss, params, batch, policy=policy, autocast=True)
  # The mean's sum: float32 (jnp widens it); the two scatters: half, float32 under autocast.
  assert plain.count("reduction", half) == 2 and plain.count("other", half) == 0
  assert auto.count("reduction", half) == 0 and auto.count("reduction", "float32") == 3

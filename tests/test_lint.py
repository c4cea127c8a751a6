"""precision_lint: the risky half-precision operations of a function, with source lines."""

import inspect
import pathlib
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jmp_lite as jmp


# --- precision_lint ---------------------------------------------------------


class Classifier(nn.Module):
  """Dense(width) -> LayerNorm -> Dense(16) -> log-softmax in the compute dtype."""

  width: int

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.LayerNorm()(nn.Dense(self.width)(x)))
    return jax.nn.log_softmax(nn.Dense(16)(x))  # SOFTMAX LINE


def classifier_loss(width):
  model = Classifier(width)

  def loss_fn(params, batch):
    logp = model.apply(params, batch["x"])
    return -jnp.mean(jnp.sum(logp.astype(jnp.float32) * batch["y"], axis=-1))

  params = model.init(jax.random.key(0), jnp.ones((1, 32)))
  batch = {"x": jnp.ones((8, 32)), "y": jax.nn.one_hot(jnp.arange(8), 16)}
  return loss_fn, params, batch


F16 = jmp.get_policy("mixed_float16")
BF16_FP32_NORMS = jmp.get_policy("mixed_bfloat16").with_keep_full("LayerNorm")
SOFTMAX_LINE = f"{pathlib.Path(__file__).name}:" + str(
    next(i for i, line in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1)
         if line.endswith("# SOFTMAX LINE")))


def test_lint_flags_f16_softmax_and_a_100_wide_dense():
  findings = jmp.precision_lint(*classifier_loss(100), policy=F16)
  ops = [f.op for f in findings]
  assert "softmax/logsumexp" in ops
  softmax = findings[ops.index("softmax/logsumexp")]
  assert SOFTMAX_LINE in softmax.source and "float16" in softmax.reason
  dots = [f for f in findings if f.op == "dot_general"]
  assert [d.reason.split(" not")[0] for d in dots] == ["output features 100", "contracting size 100"]
  assert all("Classifier.__call__" in d.source for d in dots)
  assert "loss" not in ops  # The loss is float32.
  assert str(softmax).startswith(softmax.source + ": softmax/logsumexp: ")


def test_lint_bf16_with_fp32_norms():
  # Only the tensor-core alignment rule applies to bf16: the softmax passes,
  # and the 100-wide Dense is flagged while a 128-wide one is not.
  # The float32 LayerNorm's output promotes the Dense(16) after it to float32:
  # that matmul is flagged as running in float32 (not for its alignment).
  findings = jmp.precision_lint(*classifier_loss(100), policy=BF16_FP32_NORMS)
  assert [f.op for f in findings] == ["dot_general", "dot_general"]
  assert "output features 100 not a multiple of 8 in bfloat16" in findings[0].reason
  assert findings[1].reason.startswith("runs in float32 although the policy computes in bfloat16")
  assert "autocast=True" in findings[1].reason
  assert [f.reason for f in jmp.precision_lint(*classifier_loss(128), policy=BF16_FP32_NORMS)
          ] == [findings[1].reason]
  assert jmp.precision_lint(*classifier_loss(128), policy=BF16_FP32_NORMS, autocast=True) == []
  assert [f.op for f in jmp.precision_lint(*classifier_loss(128), policy=F16)] == [
      "softmax/logsumexp"]


def test_lint_f16_loss_reductions_scan_and_conv():
  def loss_fn(params, x):
    def body(c, xi):
      return c + jnp.exp(xi @ params["w"]), None  # Inside scan.
    c, _ = jax.lax.scan(body, jnp.zeros((4, 8), x.dtype), x)
    y = jax.lax.conv_general_dilated(c[None, :, :, None], params["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(y)

  params = {"w": jnp.ones((8, 8)), "k": jnp.ones((3, 3, 1, 12))}
  findings = jmp.precision_lint(loss_fn, params, jnp.ones((5, 4, 8)), policy="mixed_float16")
  ops = [f.op for f in findings]
  assert ops == ["exp", "conv_general_dilated", "reduce_sum", "loss"]
  assert "output channels 12" in findings[1].reason
  assert all(pathlib.Path(__file__).name in f.source for f in findings)
  assert jmp.precision_lint(loss_fn, params, jnp.ones((5, 4, 8)), policy="f32") == []


def test_lint_bad_policy():
  with pytest.raises(TypeError, match="policy"):
    jmp.precision_lint(lambda x: x, jnp.ones(2), policy=3)


# --- issue 11: abstract arguments and PRNG keys -------------------------------


def test_lint_shape_dtype_structs_give_the_same_findings():
  loss_fn, params, batch = classifier_loss(100)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
  concrete = jmp.precision_lint(loss_fn, params, batch, policy=F16)
  assert [f.op for f in concrete] == ["dot_general", "dot_general", "softmax/logsumexp"]
  assert jmp.precision_lint(loss_fn, *abstract, policy=F16) == concrete


class DropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dropout(0.5, deterministic=not train)(nn.Dense(100)(x))
    return jax.nn.log_softmax(nn.Dense(16)(x))


def test_lint_with_prng_keys_in_the_arguments():
  model = DropoutNet()
  params = model.init(jax.random.key(0), jnp.ones((1, 32)), train=False)

  def loss_fn(params, batch):
    logp = model.apply(params, batch["x"], train=True, rngs={"dropout": batch["key"]})
    return -jnp.mean(logp.astype(jnp.float32)[:, 0])

  batch = {"x": jnp.ones((8, 32)), "key": jax.random.key(1)}
  ops = [f.op for f in jmp.precision_lint(loss_fn, params, batch, policy=F16)]
  assert ops == ["dot_general", "dot_general", "softmax/logsumexp"]


# --- issue 22 item 8: static leaves, as the train step accepts them ---------------


def test_lint_accepts_an_equinox_module_and_a_string_in_the_batch():
  # Issue 22 item 8: lint traced every leaf and crashed on relu and on "train".
  mlp = eqx.nn.MLP(32, 16, 100, 1, key=jax.random.key(0))  # holds jax.nn.relu as a leaf
  weights = {"scale": {"train": 1.0, "eval": 0.5}}

  def loss_fn(model, batch):
    logp = jax.nn.log_softmax(jax.vmap(model)(batch["x"]))
    return -jnp.mean(logp[:, 0]) * weights["scale"][batch["split"]]  # a str key: not traced

  batch = {"x": jnp.ones((8, 32)), "split": "train"}
  found = jmp.precision_lint(loss_fn, mlp, batch, policy=F16)
  assert [f.op for f in found] == ["dot_general", "softmax/logsumexp", "reduce_sum", "loss"]
  assert "contracting size 100 not a multiple of 8" in found[0].reason  # the second layer
  autocast = jmp.precision_lint(loss_fn, mlp, batch, policy=F16, autocast=True)
  assert autocast == found[:1]
  abstract = eqx.filter_eval_shape(lambda: mlp)  # ShapeDtypeStructs and the same relu
  assert jmp.precision_lint(loss_fn, abstract, batch, policy=F16) == found


def test_lint_accepts_a_string_leaf_in_the_batch():
  # Issue 22 item 8, without Equinox: the only static leaf is the string.
  loss_fn, params, batch = classifier_loss(100)
  tagged = lambda p, b: loss_fn(p, b) * {"train": 1.0}[b["split"]]  # a str key: not traced
  expected = jmp.precision_lint(loss_fn, params, batch, policy=F16)
  found = jmp.precision_lint(tagged, params, {**batch, "split": "train"}, policy=F16)
  assert [f.op for f in found] == [f.op for f in expected] == [
      "dot_general", "dot_general", "softmax/logsumexp"]
  assert [f.reason for f in found] == [f.reason for f in expected]

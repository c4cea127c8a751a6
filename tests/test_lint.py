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


# --- issue 29 item 4: why a matmul runs in float32 (recurrent carries) ---------------


class LSTMClassifier(nn.Module):
  """A stock ``nn.RNN(nn.OptimizedLSTMCell)``, carry from ``initialize_carry`` unless fixed."""

  fix: bool = False

  @nn.compact
  def __call__(self, x):
    cell = nn.OptimizedLSTMCell(32)
    carry = None
    if self.fix:  # The documented fix: the carry in the input's (compute) dtype.
      carry = cell.initialize_carry(jax.random.key(0), x[:, 0].shape)
      carry = jax.tree.map(lambda c: c.astype(x.dtype), carry)
    h = nn.RNN(cell)(x, initial_carry=carry)
    return nn.Dense(8)(h[:, -1])


def lstm_loss(fix):
  model = LSTMClassifier(fix)
  x = jax.random.normal(jax.random.key(1), (4, 5, 16))
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(params, x):
    return jnp.mean(model.apply({"params": params}, x).astype(jnp.float32) ** 2)

  return loss_fn, params, x


CARRY = "a float32 carry of a scan/while"
PINS = "a layer pins its dtype"


@pytest.mark.parametrize("jit", [False, True])
def test_lint_names_the_float32_carry_of_a_flax_lstm(jit):
  # Issue 29 item 4: initialize_carry makes a float32 carry, which promotes the
  # recurrent matmul and the Dense after the RNN; lint blamed "a layer pins its dtype".
  loss_fn, params, x = lstm_loss(fix=False)
  fn = jax.jit(loss_fn) if jit else loss_fn
  report = jmp.precision_report(fn, params, x, policy=F16)
  assert report.counts["matmul"] == {"float16": 1, "float32": 2}  # input projection: f16
  found = jmp.precision_lint(fn, params, x, policy=F16)
  assert [f.op for f in found] == ["dot_general", "dot_general"]
  for f in found:
    assert f.reason.startswith("runs in float32 although the policy computes in float16: " + CARRY)
    assert PINS not in f.reason and "initialize_carry" in f.reason and "autocast=True" in f.reason
  lines = [f.source.split(":")[-1] for f in found]  # the RNN line, then the Dense line
  assert lines[0] != lines[1] and all("LSTMClassifier.__call__" in f.source for f in found)
  fixed_fn, fixed_params, _ = lstm_loss(fix=True)
  fixed = jmp.precision_report(fixed_fn, fixed_params, x, policy=F16)
  assert fixed.counts["matmul"] == {"float16": 3}
  assert jmp.precision_lint(fixed_fn, fixed_params, x, policy=F16) == []
  assert jmp.precision_lint(fn, params, x, policy=F16, autocast=True) == []


def gru_loss(cell, xs, carry_dtype=None):
  def step(h, x):
    h = cell(x, h)
    return h, h

  h0 = jnp.zeros((cell.hidden_size,), carry_dtype or jnp.float32)
  h, _ = jax.lax.scan(step, h0 if carry_dtype is None else h0.astype(xs.dtype), xs)
  return jnp.mean(h.astype(jnp.float32) ** 2)


def test_lint_names_the_float32_carry_of_an_equinox_gru():
  cell = eqx.nn.GRUCell(16, 32, key=jax.random.key(0))
  xs = jax.random.normal(jax.random.key(1), (5, 16))
  found = jmp.precision_lint(gru_loss, cell, xs, policy=F16)
  assert len(found) == 1 and found[0].reason.split(": ")[1].startswith(CARRY)
  assert "gru_loss.<locals>.step" in found[0].source
  report = jmp.precision_report(gru_loss, cell, xs, policy=F16)
  assert report.counts["matmul"] == {"float16": 1, "float32": 1}  # weight_ih @ x: f16
  fixed = lambda c, x: gru_loss(c, x, carry_dtype=x.dtype)  # jnp.zeros(hidden, x.dtype)
  assert jmp.precision_report(fixed, cell, xs, policy=F16).counts["matmul"] == {"float16": 2}
  assert jmp.precision_lint(fixed, cell, xs, policy=F16) == []


def test_lint_tells_carries_random_draws_kept_leaves_and_pinned_layers_apart():
  def loss_fn(params, batch):
    w = params["w"]
    carry = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), jnp.ones((2, 8)))
    drawn = jax.random.normal(batch["key"], (2, 8)) @ w  # float32 noise: no dtype given
    pinned = batch["x"].astype(jnp.float32) @ w.astype(jnp.float32)
    kept = batch["t"] @ w
    embedded = jax.nn.one_hot(batch["label"], 8) @ w  # one_hot: float32 by default
    return sum(jnp.sum(v.astype(jnp.float32)) for v in (carry, drawn, pinned, kept, embedded))

  params = {"w": jnp.ones((8, 8))}
  batch = {"x": jnp.ones((2, 8)), "t": jnp.ones((2, 8)), "key": jax.random.key(0),
           "label": jnp.arange(2)}
  found = jmp.precision_lint(loss_fn, params, batch, policy=F16, batch_keep_full=("t",))
  causes = [f.reason.split(": ")[1].split(" (")[0] for f in found]
  made = "a float32 value made inside the function"
  assert causes == [CARRY, "a random draw made in float32 inside the function",
                    PINS, "a batch leaf passed in float32", made]
  assert "x.dtype" in found[1].reason and "jnp.zeros(shape, x.dtype)" in found[4].reason
  # Without the keep rule the fourth matmul runs in float16; cast_batch=False keeps them all.
  assert len(jmp.precision_lint(loss_fn, params, batch, policy=F16)) == 4
  uncast = jmp.precision_lint(loss_fn, params, batch, policy=F16, cast_batch=False)
  assert [f.reason.split(": ")[1].split(" (")[0] for f in uncast][1:] == [
      "a random draw made in float32 inside the function", "a batch leaf passed in float32",
      "a batch leaf passed in float32", made]


def test_a_kept_param_is_named_and_a_promotion_convert_is_not_a_cause():
  policy = F16.with_keep_full("norm")
  params = {"norm": jnp.ones(8), "w": jnp.ones((8, 8))}
  found = jmp.precision_lint(lambda p, x: jnp.sum((x * p["norm"]) @ p["w"]), params,
                             jnp.ones((2, 8)), policy=policy)
  assert [f.reason.split(": ")[1] for f in found if f.op == "dot_general"] == [
      "a param that a keep rule keeps in float32; build the step with autocast=True, or "
      "cast the kept layer's output to float16"]
  # Running statistics in the model state (never cast), used as they are.
  state = {"mean": jnp.zeros(8)}
  found = jmp.precision_lint(lambda p, s, x: (jnp.sum((x - s["mean"]) @ p["w"]), s), params,
                             jnp.ones((2, 8)), policy=F16, model_state=state)
  assert [f.reason.split(": ")[1].split(" (")[0] for f in found] == [
      "a float32 model-state leaf"]


# --- issue 29 item 4: repeated findings are grouped when printed ----------------------


class PinnedStack(nn.Module):
  """Twelve identical pinned blocks, as a ViT's encoder (one source line, twelve findings)."""

  @nn.compact
  def __call__(self, x):
    x = x.astype(jnp.float32)
    for _ in range(12):
      x = nn.Dense(16, dtype=jnp.float32)(x)  # PINNED LINE
    return nn.Dense(10)(x)  # output features 10: an alignment finding too


def test_repeated_findings_print_as_one_line_with_a_count():
  model = PinnedStack()
  params = model.init(jax.random.key(0), jnp.ones((2, 16)))["params"]
  loss_fn = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
  found = jmp.precision_lint(loss_fn, params, jnp.ones((2, 16)), policy=F16)
  assert isinstance(found, list) and isinstance(found, jmp.LintFindings)
  assert len(found) == 13 and all(isinstance(f, jmp.LintFinding) for f in found)
  assert len({f.reason for f in found}) == 1  # the 10-wide head runs in float32 too
  assert found == list(found) and found[3] == found[3]._replace()
  lines = str(found).splitlines()
  assert len(lines) == 1
  where, rest = lines[0].split(": dot_general (13 times): ")
  assert rest == found[0].reason
  # Two distinct lines (the loop's Dense and the head), each named once.
  assert where.count("PinnedStack.__call__") == 2 and "more places" not in where
  assert found.summary(max_sources=1).startswith(found[0].source + " and 1 more places: ")
  with pytest.raises(ValueError, match="max_sources must be an int >= 1, got 0"):
    found.summary(max_sources=0)
  single = jmp.LintFindings(found[:1])
  assert str(single) == str(found[0])
  assert str(jmp.LintFindings()) == ""


# --- issue 31 item 3: an autocast function lints as autocast=True ----------------------


def sum_then_matmul(p, x):
  h = x @ p["w1"]
  h = h / jnp.sum(h, axis=-1, keepdims=True)  # a float32 sum under autocast, cast for the matmul
  return jnp.mean((h @ p["w2"]).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("fp8", [False, jmp.Float8Recipe(min_size=0)])  # every matmul in FP8
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_linting_an_autocast_function_gives_the_findings_of_autocast_true(fp8, dtype):
  # Issue 31 item 3: lint reported "reduce_sum of float16 data returns float16"
  # for a jnp.sum that autocast runs in float32.
  params = {"w1": jnp.ones((16, 24)), "w2": jnp.ones((24, 16))}  # 24: not a multiple of 16
  x = jnp.ones((8, 16))
  policy = "mixed_float16" if dtype == jnp.float16 else "mixed_bfloat16"
  wrapped = jmp.autocast(sum_then_matmul, dtype, fp8=fp8)
  flagged = jmp.precision_lint(sum_then_matmul, params, x, policy=policy, autocast=True, fp8=fp8)
  assert jmp.precision_lint(wrapped, params, x, policy=policy) == flagged
  assert jmp.precision_lint(jax.jit(wrapped), params, x, policy=policy) == flagged
  assert not [f for f in flagged if f.op.startswith("reduce")]
  assert len(flagged) == (2 if fp8 else 0)  # the FP8 GEMMs' 24s
  report = jmp.precision_report(wrapped, params, x, policy=policy)
  assert report == jmp.precision_report(sum_then_matmul, params, x, policy=policy,
                                        autocast=True, fp8=fp8)


def test_only_the_autocast_function_itself_is_recognised():
  # jax.grad and functools.wraps copy a function's attributes: grad(autocast(f))
  # is linted as it is, never as autocast(f).
  params, x = {"w1": jnp.ones((16, 24)), "w2": jnp.ones((24, 16))}, jnp.ones((8, 16))
  wrapped = jmp.autocast(sum_then_matmul, jnp.float16)
  grad = jax.grad(wrapped)
  assert jmp.precision_report(grad, params, x, policy=F16).count("matmul") == 5
  with pytest.raises(ValueError, match="fp8=None; got fp8=True"):
    jmp.precision_lint(wrapped, params, x, policy=F16, fp8=True)


def test_the_cause_behind_most_float32_matmuls_is_named_first():
  # Issue 37 item 5: a model whose config pins dtype=float32 ran all its matmuls in
  # float32, but the lint named a float32 table made inside the function (RoPE's)
  # first, and the pinned dtype only second.
  dtype = jnp.float32  # a config's dtype field

  def loss_fn(params, x):
    table = jnp.sin(jnp.arange(8.0))  # made in float32
    first = jnp.sum((x * table) @ params["w"][0])  # float32 for the table only
    h = x.astype(dtype)
    for w in params["w"]:
      h = jnp.tanh(h @ w.astype(dtype))  # pinned
    return first + jnp.sum((h * table) @ params["w"][0].astype(dtype))  # pinned, and the table

  params = {"w": jnp.ones((3, 8, 8))}
  found = jmp.precision_lint(loss_fn, params, jnp.ones((2, 8)), policy=F16)
  made = "a float32 value made inside the function"
  named = [f.reason.split(": ")[1].split(" (")[0] for f in found]
  assert named == [made, PINS, PINS, PINS, PINS]  # In program order.
  # Issue 42 item 5: h is float32 whatever the table's dtype, so the table is no cause
  # of the last matmul (a half table would change nothing there).
  assert made not in found[-1].reason
  assert "set the layer's dtype to float16" in found[-1].reason
  lines = str(found).splitlines()  # Printed, the line that explains the most comes first.
  assert len(lines) == 2 and "dot_general (4 times)" in lines[0]
  assert f"float16: {PINS}" in lines[0] and f"float16: {made}" in lines[1]


def test_a_float32_value_meeting_a_half_conv_is_a_finding_not_a_crash():
  # Issue 37 item 3: float32 noise drawn inside the loss met the float16 weights of
  # an Equinox Conv2d ("lax.conv_general_dilated requires arguments to have the same
  # dtypes"), and precision_lint and precision_report crashed with that error.
  import inspect
  import equinox as eqx

  conv = eqx.nn.Conv2d(8, 8, 3, padding=1, key=jax.random.key(0))

  def loss_fn(model, batch, cast=False):
    dtype = batch["x"].dtype if cast else None
    noise = jax.random.normal(batch["key"], batch["x"].shape, dtype)  # float32: no dtype given
    return jnp.mean(jax.vmap(model)(batch["x"] + noise).astype(jnp.float32) ** 2)

  lines, first = inspect.getsourcelines(loss_fn)
  noise_line = first + next(i for i, l in enumerate(lines) if "float32: no dtype" in l)
  batch = {"x": jnp.ones((2, 8, 8, 8)), "key": jax.random.key(1)}
  with pytest.raises(TypeError, match="same dtypes"):  # What the user's step runs into.
    jax.eval_shape(loss_fn, F16.cast_to_compute(conv), F16.cast_to_compute(batch))
  [found] = jmp.precision_lint(loss_fn, conv, batch, policy=F16)
  assert found.op == "conv_general_dilated"
  assert found.source.endswith(f":{noise_line} (test_a_float32_value_meeting_a_half_conv_is_a_"
                               "finding_not_a_crash.<locals>.loss_fn)")  # The noise's line.
  assert found.reason.startswith("mixes float32 and float16 operands, so the function does not "
                                 "trace under the policy (lax.conv_general_dilated requires")
  assert "a random draw made in float32 inside the function" in found.reason
  assert f":{noise_line + 1} (" in found.reason  # where it meets the conv's weights
  assert "Cast it to float16" in found.reason and "autocast=True" in found.reason
  with pytest.raises(TypeError, match=r"random draw made in float32 .* autocast=True"):
    jmp.precision_report(loss_fn, conv, batch, policy=F16)
  # The fixes it names work: autocast, or the noise drawn in the batch's dtype.
  assert jmp.precision_lint(loss_fn, conv, batch, policy=F16, autocast=True) == []
  report = jmp.precision_report(loss_fn, conv, batch, policy=F16, autocast=True)
  assert report.count("conv", jnp.float16) == 1
  assert jmp.precision_lint(lambda m, b: loss_fn(m, b, cast=True), conv, batch, policy=F16) == []


def test_a_finding_names_its_own_call_site_when_jax_reuses_a_cached_body():
  # jnp.matmul is itself jitted: JAX traces its body once per shapes and hands every
  # later caller that jaxpr, with the first caller's traceback. A second function's
  # finding named the first function's line (found when the jax.nn corpus ran first).
  params, x = {"w1": jnp.ones((16, 24))}, jnp.ones((8, 16))
  first = lambda p, x: jnp.mean((x @ p["w1"]).astype(jnp.float32))  # noqa: E731
  second = lambda p, x: jnp.mean((x @ p["w1"]).astype(jnp.float32))  # noqa: E731
  recipe = jmp.Float8Recipe(min_size=0)
  found = [jmp.precision_lint(f, params, x, policy="mixed_bfloat16", autocast=True, fp8=recipe)
           for f in (first, second)]
  assert all(found), found  # output features 24: not a multiple of 16 for FP8
  sources = [{f.source for f in fs} for fs in found]
  assert len(sources[0]) == len(sources[1]) == 1 and sources[0] != sources[1], sources
  assert all("test_lint.py" in s for group in sources for s in group), sources


# --- sums by scatter ----------------------------------------------------------


def graph_loss(params, batch):
  """A graph network's step: messages summed into nodes, nodes into graphs."""
  messages = batch["x"] @ params["w"]
  nodes = jax.ops.segment_sum(messages, batch["receivers"], num_segments=4)  # SEGMENT LINE
  graphs = jnp.zeros((2, 8), nodes.dtype).at[batch["graph"]].add(nodes)  # AT ADD LINE
  return jnp.mean(graphs.astype(jnp.float32) ** 2)


def graph_data():
  edges = 20000  # Each node sums 2000 or more messages: past 256 (bfloat16) times one.
  batch = {"x": jax.random.uniform(jax.random.key(1), (edges, 16)),
           "receivers": jnp.minimum(jnp.arange(edges) % 7, 3),
           "graph": jnp.array([0, 0, 1, 1])}
  return {"w": jax.random.uniform(jax.random.key(2), (16, 8)) / 16}, batch


def _line(marker):
  return f"{pathlib.Path(__file__).name}:" + str(
      next(i for i, line in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1)
           if line.endswith(marker)))


@pytest.mark.parametrize("policy, dtype", [("mixed_float16", "float16"),
                                           ("mixed_bfloat16", "bfloat16")])
def test_lint_names_sums_by_scatter_in_half_and_none_under_autocast(policy, dtype):
  # jax.ops.segment_sum accumulated silently in half, bfloat16 included.
  params, batch = graph_data()
  found = [f for f in jmp.precision_lint(graph_loss, params, batch, policy=policy)
           if f.op == "scatter-add"]
  assert [f.source.split(" ")[0].split("/")[-1] for f in found] == [
      _line("# SEGMENT LINE"), _line("# AT ADD LINE")]
  for f in found:
    assert f.reason.startswith(f"scatter-add (jax.ops.segment_sum, x.at[i].add) accumulates "
                               f"in {dtype}: a sum stops growing at "), f.reason
  assert not [f for f in jmp.precision_lint(graph_loss, params, batch, policy=policy,
                                            autocast=True) if f.op.startswith("scatter")]
  want = float(graph_loss(params, batch))
  half = float(graph_loss(*jmp.get_policy(policy).cast_to_compute((params, batch))))
  auto = float(jmp.autocast(graph_loss, getattr(jnp, dtype))(
      *jmp.get_policy(policy).cast_to_compute((params, batch))))
  assert abs(half - want) > 0.1 * want and abs(auto - want) < 0.01 * want, (want, half, auto)

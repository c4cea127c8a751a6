"""Autocast through diffrax's solves and Equinox's default BatchNorm (issue 37 item 1).

Both crashed autocast: a jaxpr returning a literal (BatchNorm's ``mode="ema"``,
diffrax's loops), then diffrax's ``filter_custom_vjp`` loops, which refuse a
tangent on the inputs they declare non-differentiable. The models are tiny:
diffrax is slow to trace.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import Traces
import jmp_lite as jmp

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
MODES = {
    "f16": (jmp.get_policy("mixed_float16"),
            lambda: jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)),
    "bf16": (jmp.get_policy("mixed_bfloat16"), lambda: optax.adam(1e-2)),
}


def test_a_jaxpr_that_returns_a_literal_is_autocast(maybe_jit):
  f = jax.jit(lambda x: (x @ x, jnp.float32(1.0)))  # The jit's jaxpr returns a Literal.
  out, one = maybe_jit(jmp.autocast(f, F16))(jnp.ones((2, 2)))
  assert out.dtype == F16 and one.dtype == F32 and float(one) == 1.0
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((2, 2), 2.0))


def test_a_filter_custom_vjp_is_differentiated_in_its_perturbed_inputs_only(maybe_jit):
  # diffrax's loops are eqx.filter_custom_vjp functions: their rule refuses a tangent on
  # the arguments after the first, and autocast's rebuilt rule differentiated them all.
  @eqx.filter_custom_vjp
  def layer(x, w):
    return jnp.tanh(x @ w)

  @layer.def_fwd
  def layer_fwd(perturbed, x, w):
    y = jnp.tanh(x @ w)
    return y, y

  @layer.def_bwd
  def layer_bwd(y, g, perturbed, x, w):
    return (g * (1 - y * y)) @ w.T

  x = jax.random.normal(jax.random.key(0), (4, 8))
  w = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
  loss = lambda x, w: jnp.sum(layer(x, w).astype(F32) ** 2)
  got = maybe_jit(jax.grad(jmp.autocast(loss, F16)))(x.astype(F16), w.astype(F16))
  assert got.dtype == F16
  np.testing.assert_allclose(np.asarray(got, np.float32), jax.grad(loss)(x, w), rtol=2e-2, atol=2e-2)


# --- diffrax ------------------------------------------------------------------------------


class Field(eqx.Module):
  """The vector field of a neural ODE: a tiny MLP of the state."""

  mlp: eqx.nn.MLP

  def __init__(self, key):
    self.mlp = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=key)

  def __call__(self, t, y, args):
    return self.mlp(y)


def _solve(field, y0):
  """Tsit5 with a PID step-size controller from t=0 to 1: (y(1), t(1), success)."""
  sol = diffrax.diffeqsolve(
      diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0,
      stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
      saveat=diffrax.SaveAt(t1=True), max_steps=32, throw=False)
  return sol.ys[-1], sol.ts[-1], sol.result == diffrax.RESULTS.successful


def _ode_loss(field, batch):
  y1 = jax.vmap(lambda y: _solve(field, y)[0])(batch["y0"])
  return jnp.mean((y1.astype(F32) - batch["y1"]) ** 2)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_neural_ode_trains_under_autocast_with_its_solver_in_float32(mode):
  policy, make_tx = MODES[mode]
  half = policy.compute_dtype
  field = Field(jax.random.key(0))
  y0 = jax.random.normal(jax.random.key(1), (8, 2))
  batch = {"y0": y0, "y1": 0.5 * y0}
  keep = (r"^y0$",)  # The solver's initial state stays float32.

  # The solve: matmuls in half, the state and the time in float32, the tolerance met.
  solve = eqx.filter_jit(jax.vmap(jmp.autocast(_solve, half), in_axes=(None, 0)))
  y1, t1, ok = solve(policy.cast_to_compute(field), y0)
  reference = jax.vmap(_solve, in_axes=(None, 0))(field, y0)[0]
  assert y1.dtype == F32 and t1.dtype == F32 and bool(ok.all())
  np.testing.assert_allclose(y1, reference, atol=0.05 if half == BF16 else 0.01)
  report = jmp.precision_report(_ode_loss, field, batch, policy=policy, autocast=True,
                                batch_keep_full=keep)
  assert report.count("matmul", half) > 0 and report.count("matmul", F32) == 0
  jmp.precision_lint(_ode_loss, field, batch, policy=policy, autocast=True,
                     batch_keep_full=keep)  # Crashed before.

  state = jmp.TrainState.create(params=field, tx=make_tx())
  traces = Traces()
  step = jmp.make_train_step(traces(_ode_loss), policy, autocast=True, batch_keep_full=keep)
  losses = []
  for _ in range(6):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    assert bool(metrics["grads_finite"])
  assert losses[-1] < 0.8 * losses[0], losses
  assert traces.count == 1


# --- Equinox's default BatchNorm ----------------------------------------------------------


class Net(eqx.Module):
  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.lin = eqx.nn.Linear(4, 8, key=k1)
    with pytest.warns(UserWarning, match="defaults to 'ema'"):  # The default mode.
      self.bn = eqx.nn.BatchNorm(8, axis_name="batch")
    self.head = eqx.nn.Linear(8, 1, key=k2)

  def __call__(self, x, state):
    h, state = self.bn(self.lin(x), state)
    return self.head(jax.nn.relu(h)), state


def _bn_loss(model, model_state, batch):
  pred, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                               out_axes=(0, None))(batch["x"], model_state)
  return jnp.mean((pred.astype(F32) - batch["y"]) ** 2), model_state


@pytest.mark.parametrize("mode", list(MODES))
def test_equinox_default_batchnorm_trains_under_autocast(mode):
  policy, make_tx = MODES[mode]
  model, model_state = eqx.nn.make_with_state(Net)(jax.random.key(0))
  assert model.bn.mode == "ema"
  x = jax.random.normal(jax.random.key(1), (16, 4))
  batch = {"x": x, "y": jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]}
  report = jmp.precision_report(_bn_loss, model, batch, policy=policy, autocast=True,
                                model_state=model_state)
  assert report.count("matmul", policy.compute_dtype) == 2 and report.count("matmul", F32) == 0
  jmp.precision_lint(_bn_loss, model, batch, policy=policy, autocast=True,
                     model_state=model_state)  # Crashed before.
  state = jmp.TrainState.create(params=model, tx=make_tx(), model_state=model_state)
  traces = Traces()
  step = jmp.make_train_step(traces(_bn_loss), policy, autocast=True)
  state, first = step(state, batch)
  for _ in range(30):
    state, metrics = step(state, batch)
  assert float(metrics["loss"]) < 0.5 * float(first["loss"])
  stats = [a for a in jax.tree.leaves(state.model_state) if jnp.issubdtype(a.dtype, jnp.floating)]
  assert stats and all(a.dtype == F32 for a in stats)  # The running statistics stay float32.
  before = [a for a in jax.tree.leaves(model_state) if jnp.issubdtype(a.dtype, jnp.floating)]
  assert any(not np.array_equal(a, b) for a, b in zip(stats, before))  # and are updated.
  assert traces.count == 1


# --- GANs: sigmoid BCE (softplus's custom_jvp) and float32 noise drawn in the loss -------

GAN_MODES = {**MODES, "fp8": (jmp.get_policy("mixed_bfloat16"), lambda: optax.adam(1e-2))}
LATENT, GAN_BATCH = 4, 8


class Gen(eqx.Module):
  """DCGAN's generator in small: noise (latent, 1, 1) to a 1x8x8 image, Equinox's BatchNorm."""

  c1: eqx.nn.ConvTranspose2d
  bn: eqx.nn.BatchNorm
  c2: eqx.nn.ConvTranspose2d

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.c1 = eqx.nn.ConvTranspose2d(LATENT, 8, 4, use_bias=False, key=k1)
    with pytest.warns(UserWarning, match="defaults to 'ema'"):
      self.bn = eqx.nn.BatchNorm(8, axis_name="batch")
    self.c2 = eqx.nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1, use_bias=False, key=k2)

  def __call__(self, z, state):
    h, state = self.bn(self.c1(z), state)
    return jnp.tanh(self.c2(jax.nn.relu(h))), state


class Disc(eqx.Module):
  c1: eqx.nn.Conv2d
  bn: eqx.nn.BatchNorm
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.c1 = eqx.nn.Conv2d(1, 8, 4, stride=2, padding=1, use_bias=False, key=k1)
    with pytest.warns(UserWarning, match="defaults to 'ema'"):
      self.bn = eqx.nn.BatchNorm(8, axis_name="batch")
    self.out = eqx.nn.Linear(8 * 4 * 4, "scalar", key=k2)

  def __call__(self, x, state):
    h, state = self.bn(self.c1(x), state)
    return self.out(jax.nn.leaky_relu(h, 0.2).reshape(-1)), state


def _batched(model, x, state):
  return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


class GAN(eqx.Module):
  g: Gen
  d: Disc

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.g, self.d = Gen(k1), Disc(k2)


def _gan_loss(model, state, batch):
  # The noise is drawn in float32 inside the loss; D reads fakes, then reals, its
  # BatchNorm state threaded through both calls (its second call reads the first's).
  noise = jax.random.normal(batch["key"], (GAN_BATCH, LATENT, 1, 1))
  fake, state = _batched(model.g, noise, state)
  fake_logits, state = _batched(model.d, fake, state)
  real_logits, state = _batched(model.d, batch["real"], state)
  bce = optax.sigmoid_binary_cross_entropy
  loss = bce(fake_logits, jnp.zeros(GAN_BATCH)).mean() + bce(real_logits, jnp.ones(GAN_BATCH)).mean()
  return loss, state


@pytest.mark.parametrize("mode", list(GAN_MODES))
def test_a_gan_with_float32_noise_and_sigmoid_bce_trains_under_autocast(mode):
  policy, make_tx = GAN_MODES[mode]
  model, state0 = eqx.nn.make_with_state(GAN)(jax.random.key(0))
  real = jnp.tanh(jax.random.normal(jax.random.key(1), (GAN_BATCH, 1, 8, 8)))
  batch = {"real": real, "key": jax.random.key(2)}
  want = float(_gan_loss(model, state0, batch)[0])
  fp8 = jmp.Float8Recipe(min_size=0) if mode == "fp8" else None
  state = jmp.TrainState.create(params=model, tx=make_tx(), model_state=state0)
  traces = Traces()
  step = jmp.make_train_step(traces(_gan_loss), policy, autocast=True, fp8=fp8)  # Crashed before.
  first = None
  for i in range(3):
    state, metrics = step(state, {**batch, "key": jax.random.key(2 + i)})
    first = float(metrics["loss"]) if first is None else first
    assert bool(metrics["grads_finite"]), (mode, i)
  assert abs(first - want) <= (0.1 if mode == "fp8" else 0.02) * want, (mode, first, want)
  stats = [a for a in jax.tree.leaves(state.model_state) if jnp.issubdtype(a.dtype, jnp.floating)]
  assert stats and all(a.dtype == F32 for a in stats)
  assert traces.count == 1


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_the_porting_guides_gan_recipe_runs_with_autocast(policy_name, capsys):
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting.md").read_text()
  code = next(b for b in re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M)
              if "class Disc" in b)
  edits = {"make_train_step(d_loss, policy)": "make_train_step(d_loss, policy, autocast=True)",
           "make_train_step(g_loss, policy,": "make_train_step(g_loss, policy, autocast=True,",
           '"mixed_float16"': repr(policy_name)}
  for old, new in edits.items():
    assert old in code, old  # The recipe still reads as this test expects.
    code = code.replace(old, new)
  namespace: dict = {}
  exec(compile(code, "docs/porting.md", "exec"), namespace)  # Crashed in softplus's JVP before.
  assert all(bool(namespace[m]["grads_finite"]) for m in ("d_metrics", "g_metrics"))
  assert all(np.isfinite(float(namespace[m]["loss"])) for m in ("d_metrics", "g_metrics"))

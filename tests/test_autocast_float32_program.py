"""Issue 29 item 1: a function that runs in float32 runs under autocast.

The losses here build float32 values inside (``jax.random.normal`` noise, a
diffusion time) that meet the half params of the train step. Equinox's
``Conv2d`` does not promote, so the Equinox diffusion loss of Equinox's
score-based example fails to trace with half params; Flax's layers promote.
All of them train under ``make_train_step(..., autocast=True)`` in float16 and
bfloat16, as they do in float32.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
STEPS = 30
MODES = {"f32": ("f32", False), "f16_autocast": ("mixed_float16", True),
         "bf16_autocast": ("mixed_bfloat16", True)}


def digits(n=16):
  images = load_digits().images[:n].astype(np.float32) / 16.0
  return jnp.asarray(images[:, None])  # (n, 1, 8, 8), channels first as Equinox has them


# --- The Equinox diffusion loss (equinox/examples/score_based_diffusion, made small) -------


class TinyUNet(eqx.Module):
  """Stock ``eqx.nn.Conv2d`` layers; the time enters as a channel, as a float32 value."""

  conv1: eqx.nn.Conv2d
  conv2: eqx.nn.Conv2d

  def __init__(self, key):
    k1, k2 = jr.split(key)
    self.conv1 = eqx.nn.Conv2d(2, 8, 3, padding=1, key=k1)
    self.conv2 = eqx.nn.Conv2d(8, 1, 3, padding=1, key=k2)

  def __call__(self, t, y):
    h = jnp.concatenate([y, jnp.broadcast_to(t, y.shape)], axis=0)
    return self.conv2(jax.nn.silu(self.conv1(h)))


def int_beta(t):
  return t


def single_loss_fn(model, data, t, key):
  mean = data * jnp.exp(-0.5 * int_beta(t))
  var = jnp.maximum(1 - jnp.exp(-int_beta(t)), 1e-5)
  std = jnp.sqrt(var)
  noise = jr.normal(key, data.shape)
  y = mean + std * noise
  pred = model(t, y)
  return (1 - jnp.exp(-int_beta(t))) * jnp.mean((pred + noise / std) ** 2)


def diffusion_loss(model, batch, t1=10.0):
  data, key = batch["x"], batch["key"]
  n = data.shape[0]
  tkey, losskey = jr.split(key)
  t = jr.uniform(tkey, (n,), minval=0, maxval=t1 / n) + (t1 / n) * jnp.arange(n)
  return jnp.mean(jax.vmap(functools.partial(single_loss_fn, model))(
      data, t, jr.split(losskey, n)))


# --- Linen and NNX denoisers whose loss adds float32 noise -----------------------------------


class LinenDenoiser(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3))(x))
    h = nn.LayerNorm()(h)
    return nn.Conv(1, (3, 3))(h)


class NNXDenoiser(nnx.Module):
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 1, (3, 3), rngs=rngs)

  def __call__(self, x):
    return self.conv2(self.norm(jax.nn.relu(self.conv1(x))))


def denoising_loss(apply, params, batch):
  x = jnp.moveaxis(batch["x"], 1, -1)  # channels last for Flax
  noise = jr.normal(batch["key"], x.shape)  # float32, made inside the loss
  pred = apply(params, x + 0.5 * noise)
  return jnp.mean((pred - noise) ** 2)


def problems():
  linen = LinenDenoiser()
  linen_params = linen.init(jr.key(1), jnp.ones((1, 8, 8, 1)))["params"]
  graphdef, nnx_params = nnx.split(NNXDenoiser(nnx.Rngs(2)))
  return {
      "equinox_diffusion": (diffusion_loss, TinyUNet(jr.key(0))),
      "linen_noise": (functools.partial(
          denoising_loss, lambda p, v: linen.apply({"params": p}, v)), linen_params),
      "nnx_noise": (functools.partial(
          denoising_loss, lambda p, v: nnx.merge(graphdef, p)(v)), nnx_params),
  }


def train(loss_fn, params, mode):
  policy_name, autocast = MODES[mode]
  policy = jmp.get_policy(policy_name)
  tx = optax.adam(3e-3)
  if policy.compute_dtype == F16:
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**10)
  traces = []

  def counted(p, b):
    traces.append(1)
    return loss_fn(p, b)

  step = jmp.make_train_step(counted, policy, autocast=autocast)
  state = jmp.TrainState.create(params=params, tx=tx)
  x, losses = digits(), []
  for i in range(STEPS):
    state, metrics = step(state, {"x": x, "key": jr.key(100 + i)})
    losses.append(float(metrics["loss"]))
  return np.array(losses), len(traces)


@pytest.mark.parametrize("name", ["equinox_diffusion", "linen_noise", "nnx_noise"])
def test_float32_noise_losses_train_under_autocast_in_f16_and_bf16(name):
  loss_fn, params = problems()[name]
  f32, _ = train(loss_fn, params, "f32")
  assert f32[-10:].mean() < 0.8 * f32[:5].mean()
  for mode in ("f16_autocast", "bf16_autocast"):
    losses, traces = train(loss_fn, params, mode)
    assert np.all(np.isfinite(losses)) and traces <= 2, mode  # as given, then as float32
    assert losses[-10:].mean() < 0.8 * losses[:5].mean(), mode
    np.testing.assert_allclose(losses[-10:].mean(), f32[-10:].mean(), rtol=0.1)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_the_equinox_diffusion_loss_fails_with_half_params_and_runs_under_autocast(dtype):
  _, model = problems()["equinox_diffusion"]
  half = jmp.Policy(F32, dtype, F32).cast_to_compute(model)
  batch = {"x": digits().astype(dtype), "key": jr.key(7)}
  with pytest.raises(TypeError, match="requires arguments to have the same dtypes"):
    diffusion_loss(half, batch)  # what every half mode did before: the trace fails
  auto = jmp.autocast(diffusion_loss, dtype)
  for run in (auto, eqx.filter_jit(auto)):
    loss = run(half, batch)
    assert loss.dtype == F32
    np.testing.assert_allclose(loss, diffusion_loss(model, {**batch, "x": digits()}), rtol=0.05)
  convs = {str(jaxpr_utils.dtype_of(e.outvars[0]))
           for e in jaxpr_utils.walk(eqx.filter_make_jaxpr(auto)(half, batch)[0].jaxpr)
           if e.primitive.name == "conv_general_dilated"}
  assert convs == {dtype.name}  # the float32 noise met the half weights: cast to half


def test_a_function_that_only_runs_in_half_is_traced_as_given():
  # A float16 carry: as the float32 program it would not trace (its carry widens).
  scan = lambda v: jax.lax.scan(lambda c, r: (c + r ** 2, c), jnp.float16(0), v)
  carry, _ = jmp.autocast(scan, jnp.float16)(jnp.full((4,), 300.0, jnp.float16))
  assert carry.dtype == F32 and float(carry) == 360_000.0


def test_a_function_that_fails_either_way_raises_its_own_error():
  def bad(x):
    y = jax.lax.add(x, jnp.ones(2, jnp.float32))  # as called: f16 + f32 fails here
    return jax.lax.add(y, jnp.ones(2, jnp.float16))  # as the float32 program: here

  with pytest.raises(TypeError, match="same dtypes, got float16, float32"):
    jmp.autocast(bad, jnp.float16)(jnp.ones(2, jnp.float16))

"""Two optimizers, two loss scales: a tiny Equinox GAN under float16 (issue 37 item 6).

The recipe of docs/porting.md ("Two optimizers, two loss scales"): two
TrainStates and two steps, each with its own dynamic_loss_scaling; the frozen
network passed in the batch as the arrays of an ``eqx.partition``; the
discriminator's BatchNorm state, updated by the generator's step, handed back
with ``.replace(model_state=...)``.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import Traces
import jmp_lite as jmp


class Disc(eqx.Module):
  lin: eqx.nn.Linear
  bn: eqx.nn.BatchNorm
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.lin = eqx.nn.Linear(8, 16, key=k1)
    self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
    self.out = eqx.nn.Linear(16, "scalar", key=k2)

  def __call__(self, x, state):
    h, state = self.bn(self.lin(x), state)
    return self.out(jax.nn.leaky_relu(h)), state


def _run_disc(disc, bn_state, x):
  return jax.vmap(disc, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, bn_state)


def test_a_gan_trains_in_float16_with_two_loss_scales_moving_independently():
  gen = eqx.nn.MLP(4, 8, 16, 1, key=jax.random.key(0))
  disc, disc_bn = eqx.nn.make_with_state(Disc)(jax.random.key(1))
  g_static = eqx.partition(gen, eqx.is_array)[1]
  d_static = eqx.partition(disc, eqx.is_array)[1]

  def d_loss(d, bn_state, batch):
    fake = jax.vmap(eqx.combine(batch["g"], g_static))(batch["z"])  # G frozen
    logits, bn_state = _run_disc(d, bn_state, jnp.concatenate([batch["real"], fake]))
    labels = jnp.concatenate([jnp.ones(len(fake)), jnp.zeros(len(fake))])
    return optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels).mean(), bn_state

  def g_loss(g, batch):
    fake = jax.vmap(g)(batch["z"])
    logits, bn_state = _run_disc(eqx.combine(batch["d"], d_static), batch["d_bn"], fake)  # D frozen
    loss = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), 1.0).mean()
    return loss, bn_state

  policy = jmp.get_policy("mixed_float16")
  scaling = dict(init_scale=2.0**15, growth_interval=3)
  d_train = jmp.TrainState.create(
      params=disc, tx=jmp.dynamic_loss_scaling(optax.adam(2e-3), **scaling), model_state=disc_bn)
  g_train = jmp.TrainState.create(
      params=gen, tx=jmp.dynamic_loss_scaling(optax.adam(2e-3), **scaling))
  d_traces, g_traces = Traces(), Traces()
  d_step = jmp.make_train_step(d_traces(d_loss), policy)
  g_step = jmp.make_train_step(g_traces(g_loss), policy, has_aux=True, batch_keep_full=(r"^d_bn",))

  history = []
  for i in range(20):
    k_real, k_d, k_g = jax.random.split(jax.random.key(100 + i), 3)
    real = jax.random.normal(k_real, (16, 8)) * 0.5 + 2.0
    d_train, d_metrics = d_step(d_train, {"g": eqx.filter(g_train.params, eqx.is_array),
                                          "z": jax.random.normal(k_d, (16, 4)), "real": real})
    d_params, bn_before = jax.tree.map(np.asarray, (eqx.filter(d_train.params, eqx.is_array),
                                                    d_train.model_state))
    g_train, g_metrics = g_step(g_train, {"d": eqx.filter(d_train.params, eqx.is_array),
                                          "d_bn": d_train.model_state,
                                          "z": jax.random.normal(k_g, (16, 4))})
    d_train = d_train.replace(model_state=g_metrics["aux"])  # D's BatchNorm state, handed back
    # The generator's step leaves D's params alone and updates its statistics, in float32.
    jax.tree.map(np.testing.assert_array_equal, eqx.filter(d_train.params, eqx.is_array), d_params)
    stats = jax.tree.leaves(d_train.model_state)
    assert all(a.dtype == b.dtype for a, b in zip(stats, jax.tree.leaves(bn_before)))
    assert any(not np.array_equal(a, b) for a, b in zip(stats, jax.tree.leaves(bn_before)))
    history.append([float(m[k]) for m in (d_metrics, g_metrics)
                    for k in ("loss_scale", "grads_finite", "loss")])

  d_scale, d_ok, d_loss_, g_scale, g_ok, g_loss_ = np.array(history).T
  assert len(set(d_scale)) > 1 and len(set(g_scale)) > 1  # Both scales move,
  assert d_scale[-1] != g_scale[-1]  # each its own way,
  assert (d_ok != g_ok).any()  # and one step skips while the other applies.
  assert d_ok.sum() > 10 and g_ok.sum() > 10  # Most steps apply.
  assert np.isfinite(d_loss_).all() and np.isfinite(g_loss_).all()
  assert d_loss_[-5:].mean() < d_loss_[:5].mean()  # D learns to tell real from fake.
  assert d_traces.count == 1 and g_traces.count == 1  # each step compiled once
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(
      eqx.filter((d_train.params, g_train.params), eqx.is_array)))

"""The same train step on 1 device, a 1-D data mesh and a 2-D (data, model) mesh.

With float32 masters, and with bf16 masters (stochastic rounding and Kahan).

Runs in one subprocess with 4 host-platform CPU devices, since the device count
is fixed when JAX starts.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here is a 4-device subprocess

CHILD = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jmp_lite as jmp

    assert jax.device_count() == 4, jax.devices()

    def loss_fn(params, batch):
      h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
      logits = (h @ params["w2"]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k1, (8, 32)) * 0.5,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
        "count": jnp.int32(5),
    }
    batches = [
        {"x": jax.random.normal(k, (16, 8)), "y": jax.random.randint(k, (16,), 0, 4)}
        for k in jax.random.split(k3, 3)
    ]
    bad = dict(batches[0], x=batches[0]["x"].at[13, 2].set(jnp.nan))  # In the last shard.

    tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**8)
    step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))

    def run(param_shardings=None, batch_sharding=None, **lean):
      p = params
      if param_shardings is not None:
        p = jax.tree.map(jax.device_put, params, param_shardings)
      state = jmp.TrainState.create(params=jax.tree.map(jnp.copy, p), tx=tx, **lean)
      if param_shardings is not None:
        check_lean_placement(state, param_shardings)
      for b in batches:
        if batch_sharding is not None:
          b = jax.device_put(b, batch_sharding)
        state, metrics = step(state, b)
        assert bool(metrics["grads_finite"])
      before = jax.tree.map(np.asarray, state.params)
      comp_before = jax.tree.map(np.asarray, state.compensation)
      if batch_sharding is not None:
        bad_b = jax.device_put(bad, batch_sharding)
        assert len(bad_b["x"].sharding.device_set) == 4
      else:
        bad_b = bad
      state, metrics = step(state, bad_b)
      assert not bool(metrics["grads_finite"])
      assert float(jmp.loss_scale_of(state.opt_state)) == 2.0**7
      # Every device skipped: every shard of every param (and of the Kahan
      # compensation) is unchanged, bit for bit.
      trees = [(state.params, before)]
      if state.compensation is not None:
        trees.append((state.compensation, comp_before))
      for tree, old in trees:
        for name, leaf in tree.items():
          if leaf is None:
            continue
          for shard in leaf.addressable_shards:
            assert np.asarray(shard.data).tobytes() == old[name][shard.index].tobytes(), name
      if param_shardings is not None:
        check_lean_placement(state, param_shardings)
      return state, before

    def check_lean_placement(state, shardings):
      # The compensation follows the params' sharding; the key is replicated
      # over the params' mesh.
      if state.compensation is not None:
        for name, c in state.compensation.items():
          if c is not None:
            assert c.sharding.is_equivalent_to(state.params[name].sharding, c.ndim), name
            assert c.sharding.is_equivalent_to(shardings[name], c.ndim), name
      if state.rounding_key is not None:
        mesh = shardings["w1"].mesh
        assert state.rounding_key.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)

    single, single_params = run()
    assert len(single.params["w1"].sharding.device_set) == 1

    data_mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(data_mesh, P())
    dp, dp_params = run(
        jax.tree.map(lambda _: replicated, params), NamedSharding(data_mesh, P("data"))
    )

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    model_shardings = {
        "w1": NamedSharding(mesh, P(None, "model")),
        "b1": NamedSharding(mesh, P("model")),
        "w2": NamedSharding(mesh, P("model", None)),
        "count": NamedSharding(mesh, P()),
    }
    mp, mp_params = run(model_shardings, NamedSharding(mesh, P("data")))
    assert mp.params["w1"].sharding.is_equivalent_to(model_shardings["w1"], 2)
    assert len({str(s.index) for s in mp.params["w1"].addressable_shards}) == 2

    for other in (dp_params, mp_params):
      for name in ("w1", "b1", "w2"):
        np.testing.assert_allclose(other[name], single_params[name], rtol=2e-3, atol=2e-4)
      assert int(other["count"]) == 5
    for state in (dp, mp):
      for leaf in jax.tree.leaves(state.opt_state):
        assert np.isfinite(np.asarray(leaf)).all()

    # Lean bf16 masters, on one device and on the 2-D mesh (the same step
    # object: it compiles once per layout).
    for lean in (dict(master_dtype=jnp.bfloat16, rounding="stochastic", key=jax.random.key(9)),
                 dict(master_dtype=jnp.bfloat16, rounding="kahan")):
      lean_single, ls_params = run(**lean)
      lean_mp, lmp_params = run(model_shardings, NamedSharding(mesh, P("data")), **lean)
      for state in (lean_single, lean_mp):
        assert state.params["w1"].dtype == jnp.bfloat16
      assert lean_mp.params["w1"].sharding.is_equivalent_to(model_shardings["w1"], 2)
      for name in ("w1", "b1", "w2"):
        # Reduction order differs between layouts; bf16 keeps 8 bits.
        np.testing.assert_allclose(lmp_params[name].astype(np.float32),
                                   ls_params[name].astype(np.float32), rtol=2e-2, atol=2e-3)
      assert int(lmp_params["count"]) == 5

    # Stochastic rounding draws the same bits whatever the layout: a sharded
    # apply_updates equals the single-device one bit for bit.
    lean_params = {k: v.astype(jnp.bfloat16) for k, v in params.items() if k != "count"}
    updates = {k: jnp.full(v.shape, 1e-3, jnp.float32) for k, v in lean_params.items()}
    apply = jax.jit(lambda p, u, k: jmp.apply_updates(p, u, rounding="stochastic", key=k)[0])
    key = jax.random.key(4)
    one = apply(lean_params, updates, key)
    placed = lambda t: {k: jax.device_put(v, model_shardings[k]) for k, v in t.items()}
    many = apply(placed(lean_params), placed(updates), key)
    for name in one:
      assert len(many[name].sharding.device_set) == 4
      assert np.asarray(many[name]).tobytes() == np.asarray(one[name]).tobytes(), name
    print("ok")
    """
)


def test_same_step_on_one_device_data_mesh_and_2d_mesh():
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  env["XLA_FLAGS"] = flags.strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout


LOOP_CHILD = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jmp_lite as jmp

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.device_put(jax.random.normal(k1, (8, 32)) * 0.3, NamedSharding(mesh, P(None, "model"))),
        "b1": jax.device_put(jnp.zeros(32), NamedSharding(mesh, P("model"))),
        "w2": jax.device_put(jax.random.normal(k2, (32, 1)) * 0.3, NamedSharding(mesh, P("model", None))),
    }

    def loss_fn(p, b):
      h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
      return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)

    x = jax.random.normal(k3, (64, 8))
    batch = jax.device_put({"x": x, "y": jnp.sin(x[:, :1])}, NamedSharding(mesh, P("data")))
    for tx in (optax.adam(1e-2), jmp.dynamic_loss_scaling(optax.adam(1e-2))):
      state = jmp.TrainState.create(params=params, tx=tx)
      step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
      first = None
      for _ in range(300):  # No blocking in the loop, as users write it.
        state, metrics = step(state, batch)
        first = float(metrics["loss"]) if first is None else first
      assert float(metrics["loss"]) < 0.1 * first, (first, float(metrics["loss"]))
    print("ok")
    """
)


def test_a_long_unblocked_loop_on_a_cpu_mesh_does_not_hang():
  # XLA:CPU aborts ("Termination timeout ... 40 seconds" in an all-reduce
  # rendezvous) when many sharded steps are in flight on a small machine,
  # with plain optax too; the step waits for each call on a multi-device CPU.
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", LOOP_CHILD], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout


BATCHNORM_CHILD = textwrap.dedent(
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jmp_lite as jmp

    class ResNetBlock(nn.Module):  # As in Flax's ImageNet example: BatchNorm with axis_name.
      @nn.compact
      def __call__(self, x, train):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                    axis_name="batch")
        y = nn.relu(norm()(nn.Conv(8, (3, 3))(x)).astype(x.dtype))
        y = norm()(nn.Conv(8, (3, 3))(y)).astype(x.dtype)
        return nn.Dense(4)(jnp.mean(nn.relu(nn.Conv(8, (1, 1))(x) + y), axis=(1, 2)))

    model = ResNetBlock()
    x = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
    batch = {"x": x, "y": jnp.argmax(jnp.mean(x, axis=(1, 2)) @ jnp.ones((3, 4)) * jnp.arange(4), -1)}
    variables = jax.vmap(lambda v: model.init(jax.random.key(1), v, train=False),
                         axis_name="batch")(x[:1][None])
    variables = jax.tree.map(lambda v: v[0], variables)

    def loss_fn(params, model_state, batch):
      logits, updates = model.apply({"params": params, **model_state}, batch["x"], train=True,
                                    mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch["y"]).mean()
      return loss, updates

    policy = jmp.get_policy("mixed_float16").with_keep_full("BatchNorm")
    def run(batch):
      state = jmp.TrainState.create(
          params=variables["params"], model_state={"batch_stats": variables["batch_stats"]},
          tx=jmp.dynamic_loss_scaling(optax.sgd(0.1), init_scale=2.0**10))
      step = jmp.make_train_step(loss_fn, policy, axis_name="batch")
      for _ in range(5):
        state, metrics = step(state, batch)
      return jax.device_get(state)

    single = run(batch)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = run(jax.device_put(batch, NamedSharding(mesh, P("data"))))
    for a, b in zip(jax.tree.leaves(sharded.model_state), jax.tree.leaves(single.model_state)):
      np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params)):
      np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)
    assert not np.allclose(sharded.model_state["batch_stats"]["BatchNorm_0"]["mean"], 0.0)
    try:  # Without axis_name the pmap-style model cannot run under jit.
      jmp.make_train_step(loss_fn, policy)(
          jmp.TrainState.create(params=variables["params"], tx=optax.adam(1e-2),
                                model_state={"batch_stats": variables["batch_stats"]}), batch)
    except NameError as e:
      assert "batch" in str(e)
    else:
      raise AssertionError("expected an unbound axis name")
    print("ok")
    """
)


def test_batchnorm_with_axis_name_on_a_data_parallel_mesh():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", BATCHNORM_CHILD], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout

"""``quantize_state`` on 4 devices and through orbax (issue 35).

One subprocess with 4 host-platform CPU devices (the device count is fixed
when JAX starts): the same run on one device and on a 2-D (data, model) mesh,
an orbax save on the mesh restored bit for bit, and restored into one device,
where it continues like the run that never stopped.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a 4-device subprocess

CHILD = textwrap.dedent(
    """
    import tempfile
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jmp_lite as jmp

    assert jax.device_count() == 4, jax.devices()

    def loss_fn(params, batch):
      h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
      return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 512)) / 4, "b1": jnp.zeros(512),
              "w2": jax.random.normal(k2, (512, 8)) / 23}
    batches = []
    for k in jax.random.split(k3, 6):
      x = jax.random.normal(k, (32, 16))
      batches.append({"x": x, "y": jnp.sin(x[:, :8])})

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    shardings = {"w1": NamedSharding(mesh, P(None, "model")), "b1": NamedSharding(mesh, P("model")),
                 "w2": NamedSharding(mesh, P("model", None))}
    data = NamedSharding(mesh, P("data"))

    def make(sharded):
      tx = jmp.dynamic_loss_scaling(
          jmp.quantize_state(optax.adamw(1e-2), "int8", min_size=0, block_size=256))
      p = jax.tree.map(jnp.copy, params)
      if sharded:
        p = {k: jax.device_put(v, shardings[k]) for k, v in p.items()}
      return jmp.TrainState.create(params=p, tx=tx, master_dtype=jnp.bfloat16,
                                   rounding="stochastic", key=jax.random.key(3))

    step = jmp.make_train_step(loss_fn, jmp.get_policy("p=f32,c=f32,o=f32"))

    def run(state, bs, sharded):
      for b in bs:
        state, metrics = step(state, jax.device_put(b, data) if sharded else b)
        assert bool(metrics["grads_finite"])
      return state

    def coded(state):
      adam = state.opt_state.inner_state.inner[0]
      return adam.mu["w1"], adam.nu["w1"]

    single = run(make(False), batches, False)
    many = run(make(True), batches, True)
    assert many.params["w1"].sharding.is_equivalent_to(shardings["w1"], 2)
    for name in params:
      np.testing.assert_allclose(np.asarray(many.params[name], np.float32),
                                 np.asarray(single.params[name], np.float32), rtol=3e-2, atol=3e-3)
    for q in coded(many):  # codes (16, 512) and scales (16, 2) sharded like w1
      assert q.codes.sharding.is_equivalent_to(shardings["w1"], 2), q.codes.sharding
      assert q.scales.sharding.is_equivalent_to(shardings["w1"], 2), q.scales.sharding

    # orbax: save after 3 steps on the mesh; restore on the mesh (bit for bit) and on one device.
    half = run(make(True), batches[:3], True)
    path = tempfile.mkdtemp() + "/ckpt"
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, half)
      ckptr.wait_until_finished()
    with ocp.StandardCheckpointer() as ckptr:
      back = ckptr.restore(path, make(True))
      moved = ckptr.restore(path, make(False))
    def same(a, b):
      la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
      assert len(la) == len(lb)
      for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
          x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    same((back.step, back.params, back.opt_state), (half.step, half.params, half.opt_state))
    same((moved.step, moved.params, moved.opt_state), (half.step, half.params, half.opt_state))
    assert len(coded(moved)[0].codes.sharding.device_set) == 1
    # Resumed in another layout, it goes on like the run that never stopped.
    finished = run(moved, batches[3:], False)
    for name in params:
      np.testing.assert_allclose(np.asarray(finished.params[name], np.float32),
                                 np.asarray(many.params[name], np.float32), rtol=3e-2, atol=3e-3)
    print("ok")
    """
)


def test_quantized_state_on_a_mesh_matches_one_device_and_resumes_across_layouts():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, f"child failed:\\nstdout:\\n{proc.stdout}\\nstderr:\\n{proc.stderr}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout

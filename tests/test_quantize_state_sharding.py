"""``quantize_state`` on 4 devices and through orbax (issues 35 and 45), int8 and int4.

One subprocess with 4 host-platform CPU devices (the device count is fixed
when JAX starts), for each format: the same run on one device and on a 2-D
(data, model) mesh, whose codes and scales are sharded like their params (an
odd number of elements a shard included); an orbax save on the mesh restored
bit for bit, and restored into one device, where it continues like the run
that never stopped.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a 4-device subprocess

FORMATS = ("int8", "int4")
CHILD = textwrap.dedent(
    """
    import sys
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
      return (jnp.mean((h @ params["w2"] - batch["y"]) ** 2)
              + jnp.mean((params["odd"] - jnp.mean(batch["x"])) ** 2))

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    # w1: blocked along its last axis, 256 elements a shard; w2: blocked over its flattened
    # form; odd: 255 elements a shard, flattened and padded to whole blocks.
    params = {"w1": jax.random.normal(k1, (16, 512)) / 4, "b1": jnp.zeros(512),
              "w2": jax.random.normal(k2, (512, 10)) / 23, "odd": jnp.linspace(-1.0, 1.0, 510)}
    batches = []
    for k in jax.random.split(k3, 6):
      x = jax.random.normal(k, (32, 16))
      batches.append({"x": x, "y": jnp.sin(x[:, :10])})

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    shardings = {"w1": NamedSharding(mesh, P(None, "model")), "b1": NamedSharding(mesh, P("model")),
                 "w2": NamedSharding(mesh, P("model", None)), "odd": NamedSharding(mesh, P("model"))}
    data = NamedSharding(mesh, P("data"))
    step = jmp.make_train_step(loss_fn, jmp.get_policy("p=f32,c=f32,o=f32"))

    def same(a, b):
      la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
      assert len(la) == len(lb)
      for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
          x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()

    # format: (block_size given, mu's block, nu's block, codes a byte, tolerance against one device);
    # int4's default: mu in blocks of 32 (bfloat16 scales), nu in blocks of 256 (float32 scales).
    CASES = {"int8": (256, 256, 256, 1, 3e-2), "int4": (None, 32, 256, 2, 5e-2)}
    for fmt in sys.argv[1:]:
      block, mu_block, nu_block, per_byte, tol = CASES[fmt]

      def make(sharded):
        tx = jmp.dynamic_loss_scaling(
            jmp.quantize_state(optax.adamw(1e-2), fmt, min_size=0, block_size=block))
        p = jax.tree.map(jnp.copy, params)
        if sharded:
          p = {k: jax.device_put(v, shardings[k]) for k, v in p.items()}
        return jmp.TrainState.create(params=p, tx=tx, master_dtype=jnp.bfloat16,
                                     rounding="stochastic", key=jax.random.key(3))

      def run(state, bs, sharded):
        for b in bs:
          state, metrics = step(state, jax.device_put(b, data) if sharded else b)
          assert bool(metrics["grads_finite"])
        return state

      def close(a, b):
        for name in params:
          np.testing.assert_allclose(np.asarray(a.params[name], np.float32),
                                     np.asarray(b.params[name], np.float32), rtol=tol,
                                     atol=tol / 10, err_msg=f"{fmt} {name}")

      single = run(make(False), batches, False)
      many = run(make(True), batches, True)
      assert many.params["w1"].sharding.is_equivalent_to(shardings["w1"], 2)
      close(many, single)
      adam = many.opt_state.inner_state.inner[0]
      for q, b in ((adam.mu["w1"], mu_block), (adam.nu["w1"], nu_block)):  # along w1's rows
        assert q.codes.shape == (16, 512 // per_byte), (fmt, q.codes.shape)
        assert q.scales.shape == (16, 512 // b), (fmt, q.scales.shape)
        assert q.codes.sharding.is_equivalent_to(shardings["w1"], 2), q.codes.sharding
        assert q.scales.sharding.is_equivalent_to(shardings["w1"], 2), q.scales.sharding
      assert adam.mu["w1"].scales.dtype == (jnp.bfloat16 if fmt == "int4" else jnp.float32)
      for moment, b in ((adam.mu, mu_block), (adam.nu, nu_block)):  # blocked across rows
        if fmt == "int4":  # the leaf's shape, the last axis halved
          assert (moment["w2"].codes.shape, moment["odd"].codes.shape) == ((512, 5), (255,))
        else:
          assert moment["w2"].codes.shape == (5120 // b, b // per_byte)
          assert moment["odd"].codes.shape == (-(-510 // b), b // per_byte)
      assert adam.nu["odd"].shape == (510,)

      # orbax: save after 3 steps on the mesh; restore on the mesh (bit for bit) and on one device.
      half = run(make(True), batches[:3], True)
      path = tempfile.mkdtemp() + "/ckpt"
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, half)
        ckptr.wait_until_finished()
      with ocp.StandardCheckpointer() as ckptr:
        back = ckptr.restore(path, make(True))
        moved = ckptr.restore(path, make(False))
      same((back.step, back.params, back.opt_state), (half.step, half.params, half.opt_state))
      same((moved.step, moved.params, moved.opt_state), (half.step, half.params, half.opt_state))
      assert len(moved.opt_state.inner_state.inner[0].mu["w1"].codes.sharding.device_set) == 1
      # Resumed in another layout, it goes on like the run that never stopped.
      close(run(moved, batches[3:], False), many)
      print(fmt, "ok")
    """
)


def test_quantized_state_on_a_mesh_matches_one_device_and_resumes_across_layouts():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", CHILD, *FORMATS], env=env, capture_output=True,
                        text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
  assert proc.stdout.split() == [w for fmt in FORMATS for w in (fmt, "ok")], proc.stdout

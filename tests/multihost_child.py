"""One process of tests/test_multihost.py: ``python multihost_child.py PROCESS_ID PORT CKPT_DIR``.

Two of these run the same data-parallel train step over 2 processes x 4 CPU
devices, connected by jax.distributed with gloo collectives, then an FSDP
step with FP8 weights (issue 44). Each feeds its
own shard of every batch; process 1 poisons its shard of step 3. The result
(one JSON line) must be the same in both processes.
"""

import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jmp_lite as jmp


def main(pid: int, port: str, ckpt: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
  assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = Mesh(np.array(jax.devices()), ("data",))
  rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)

  def global_array(sharding, local):
    return jax.make_array_from_process_local_data(sharding, np.asarray(local))

  k1, k2 = jax.random.split(jax.random.key(0))
  init = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 1)) * 0.3}
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)


  def make_state():
    return jmp.TrainState.create(params=jax.tree.map(lambda x: global_array(rep, x), init), tx=tx)


  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))

  def batch(i, poison=False):
    rng = np.random.default_rng(100 * i + jax.process_index())  # each process its own shard
    x = rng.normal(size=(8, 8)).astype(np.float32)
    if poison:
      x[3, 2] = np.nan
    return {"x": global_array(data, x), "y": global_array(data, np.sin(x[:, :1]))}

  def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
      h.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
    return h.hexdigest()

  state, finite, params_before = make_state(), [], None
  for i in range(6):
    if i == 3:
      params_before = digest(state.params)
    state, m = step(state, batch(i, poison=(i == 3 and jax.process_index() == 1)))
    finite.append(bool(m["grads_finite"]))
    if i == 3:
      params_after_skip = digest(state.params)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(ckpt, "state"), state)
    ckptr.wait_until_finished()
    resumed = ckptr.restore(os.path.join(ckpt, "state"), jax.eval_shape(make_state))
  for i in range(6, 9):
    state, _ = step(state, batch(i))
    resumed, _ = step(resumed, batch(i))
  print(json.dumps({
      "finite": finite, "skip_kept_params": params_before == params_after_skip,
      "skipped": int(jmp.skipped_steps_of(state.opt_state)),
      "final": digest(state), "resumed": digest(resumed),
      **fsdp_fp8(mesh, init, loss_fn, batch, digest),
  }))


def fsdp_fp8(mesh, init, loss_fn, batch, digest):
  """FSDP with FP8 (issue 44) over both processes: params and batch on one axis, a global skip."""
  def sharded(x):
    spec = P("data") if x.shape[0] % mesh.size == 0 else P()
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

  tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), init_scale=2.0**10)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0))
  state = jmp.TrainState.create(params=jax.tree.map(sharded, init), tx=tx,
                                master_dtype=jnp.bfloat16, rounding="nearest")
  losses, finite = [], []
  for i in range(6):
    state, m = step(state, batch(10 + i, poison=(i == 2 and jax.process_index() == 0)))
    losses.append(float(m["loss"]))
    finite.append(bool(m["grads_finite"]))
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  whole = multihost_utils.process_allgather(state.params, tiled=True)  # Every shard, both processes.
  return {"fsdp_fp8_finite": finite, "fsdp_fp8_losses": losses,
          "fsdp_fp8_spec": str(state.params["w1"].sharding.spec),
          "fsdp_fp8_final": hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(whole))).hexdigest()}


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3])

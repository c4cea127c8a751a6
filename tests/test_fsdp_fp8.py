"""FSDP with FP8 weights (issue 44), on 8 host-platform CPU devices in one subprocess.

Params, Adam state and batch sharded on their first axis over one mesh axis:

- the float8 values a gather delivers, from the weight cast on its shard with
  the amax known before the gather, are bit for bit those of casting after it;
- the FP8 eval step's logits on sharded params and batch are, bit for bit,
  those of each device's rows evaluated on their own (each device scales its
  shard of the activations by its own amax), and the compiled step reduces no
  activation's or cotangent's amax across devices;
- an embedding's gradient is the scatter-add of each device's cotangent rows
  rounded to e5m2 with their own scale (gathered as float8 on GPUs);
- after 100 steps the FSDP FP8 params are about as close to bf16 autocast's
  as the unsharded FP8 ones are (relative distance, worst leaf);
- with bf16 masters, the weights' amaxes kept in the state and dynamic loss
  scaling, a NaN in one device's shard skips the step everywhere, params and
  amaxes bit for bit, and the next step trains;
- with ``quantize_state`` its codes shard with the params, and an orbax
  checkpoint saved on 8 devices resumes on a mesh of 4, bit for bit, and trains.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # an 8-device subprocess

CHILD = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jmp_lite as jmp
    from jmp_lite._src.fp8 import dot as fp8_dot

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    first, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    E4M3 = np.dtype(jnp.float8_e4m3fn)

    # 1. The float8 values after the gather, bit for bit.
    w = jax.random.normal(jax.random.key(1), (64, 48)) * jnp.logspace(-3, 2, 48)
    w = w.at[37, 5].set(-517.0)  # The amax, on the fifth shard.
    w16 = jax.device_put(w.astype(jnp.bfloat16), first)

    @jax.jit
    def cast_then_gather(w16, amax):
      q, s = fp8_dot._quantize(w16, E4M3, 0, False, (0, 1), amax)
      return jax.lax.with_sharding_constraint(q, whole), s

    @jax.jit
    def gather_then_cast(w16):
      return fp8_dot._quantize(jax.lax.with_sharding_constraint(w16, whole), E4M3, 0, False, (0, 1))

    amax = jnp.max(jnp.abs(w))  # From the float32 master, rounded by the quantisation.
    (q1, s1), (q2, s2) = cast_then_gather(w16, amax), gather_then_cast(w16)
    np.testing.assert_array_equal(q1.view(jnp.uint8), q2.view(jnp.uint8))
    assert float(s1.reshape(())) == float(s2.reshape(())), (s1, s2)
    # (What the wire carries is read from the program compiled for GPUs:
    # benchmarks.fsdp_census. XLA:CPU gathers the values widened.)

    # 2. The FP8 eval step on FSDP-sharded params: the unsharded logits.
    def mlp(p, x):
      h = jax.nn.relu(x @ p["w1"] + p["b1"])
      h = jax.nn.relu(h @ p["w2"])
      return (h @ p["w3"]).astype(jnp.float32)

    def loss_fn(p, b):
      return optax.softmax_cross_entropy_with_integer_labels(mlp(p, b["x"]), b["y"]).mean()

    k = jax.random.split(jax.random.key(0), 6)
    params = {"w1": jax.random.normal(k[0], (32, 64)) * 0.3, "b1": jnp.zeros(64) + 0.01,
              "w2": jax.random.normal(k[1], (64, 64)) * 0.2,
              "w3": jax.random.normal(k[2], (64, 8)) * 0.2}
    x = jax.random.normal(k[3], (64, 32))
    y = jnp.argmax(x[:, :8] + 0.3 * jax.random.normal(k[4], (64, 8)), axis=1)
    recipe = jmp.Float8Recipe(min_size=0)
    bf16 = jmp.get_policy("mixed_bfloat16")
    shard = lambda t: jax.device_put(t, first)

    evaluate = jmp.make_eval_step(mlp, bf16, autocast=True, fp8=recipe)
    sharded = evaluate(shard(params), shard(x))
    # Each device scales its own rows of the activations by their own amax, as
    # one device given only those rows does (torchao's ranks alike).
    per_device = np.concatenate([np.asarray(evaluate(params, x[8 * i:8 * (i + 1)])) for i in range(8)])
    np.testing.assert_array_equal(np.asarray(sharded), per_device)
    assert not np.array_equal(per_device, np.asarray(evaluate(params, x)))  # Not one scale.

    # 2b. So the compiled FSDP FP8 step reduces no activation's or cotangent's
    # amax across devices: its only max-reductions are the weights' amaxes.
    from jmp_lite._src.diagnostics import hlo_census
    def all_reduces(fp8):
      step = jmp.make_train_step(loss_fn, bf16, autocast=True, fp8=fp8 or None)
      state = jmp.TrainState.create(params=shard(params), tx=optax.adam(1e-3))
      text = step.lower(state, shard({"x": x, "y": y})).compile().as_text()
      return [c.reduction for c in hlo_census.collectives(text) if c.kind == "all-reduce"]
    bf16_reduces = all_reduces(None)
    # Rowwise too: the weights' per-row amaxes taken together at the top, the
    # weight gradients' over each device's rows of the batch.
    for r in (recipe, jmp.Float8Recipe(min_size=0, scaling="rowwise")):
      fp8_reduces = all_reduces(r)
      print("all-reduces", r.scaling, fp8_reduces, bf16_reduces)
      assert fp8_reduces.count("maximum") <= 3, fp8_reduces  # w1, w2, w3 (XLA:CPU may not combine)
      assert len(fp8_reduces) - fp8_reduces.count("maximum") <= len(bf16_reduces), (fp8_reduces, bf16_reduces)

    # 2c. An embedding's cotangent: each device's rows in e5m2 with their own
    # scale, gathered, and scatter-added into the vocabulary-sharded table.
    from jmp_lite._src.autocast import autocast as autocast_lib
    ke = jax.random.split(jax.random.key(7), 3)
    table = jax.random.normal(ke[0], (64, 16))
    tokens = jax.random.randint(ke[1], (16, 4), 0, 64)
    cot = jax.random.normal(ke[2], (16, 4, 16)) * jnp.logspace(-3, 0, 16)[:, None, None]
    lookup_loss = lambda p, b: (jnp.take(p["table"], b["tokens"], axis=0) * b["cot"]).sum()
    grad = jax.jit(jax.grad(autocast_lib.step_autocast(lookup_loss, jnp.bfloat16, recipe)))
    got = grad(shard({"table": table}), shard({"tokens": tokens, "cot": cot}))["table"]
    E5M2 = jnp.float8_e5m2
    rows = jnp.concatenate([fp8_dot.dequantize(*fp8_dot.quantize(cot[2 * i:2 * i + 2], E5M2))
                            for i in range(8)])
    # (Up to the order in which a repeated token's rows are summed; e5m2 is 2**-3 apart.)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.zeros((64, 16)).at[tokens].add(rows)),
                               rtol=1e-5, atol=1e-7)

    # 3. 100 steps: FSDP FP8 vs unsharded FP8, as close as unsharded FP8 is to bf16.
    def train(fp8, sharded):
      tx = jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10)
      step = jmp.make_train_step(loss_fn, bf16, autocast=True, fp8=recipe if fp8 else None)
      p, b = (shard(params), shard({"x": x, "y": y})) if sharded else (params, {"x": x, "y": y})
      state = jmp.TrainState.create(params=p, tx=tx)
      for _ in range(100):
        state, metrics = step(state, b)
      return float(metrics["loss"]), jax.device_get(state.params)

    (l_bf16, p_bf16), (l_fp8, p_fp8), (l_fsdp, p_fsdp) = (
        train(False, False), train(True, False), train(True, True))

    def dist(a, b):
      return max(float(jnp.linalg.norm(a[n] - b[n]) / jnp.linalg.norm(b[n])) for n in a)

    start = float(loss_fn(params, {"x": x, "y": y}))
    assert l_fsdp < 0.5 * start and l_fp8 < 0.5 * start, (start, l_fsdp, l_fp8)
    print("distances", dist(p_fsdp, p_fp8), dist(p_fp8, p_bf16), dist(p_fsdp, p_bf16), l_fsdp, l_fp8, l_bf16)
    # Each device scales its own rows, so the FSDP step rounds otherwise than the
    # unsharded one: two independent roundings, about sqrt(2) times as far apart
    # as one is from bf16. Swept over 4 seeds x lr (1e-3, 1e-4), the worst
    # ratios were 1.23 (to unsharded FP8) and 1.15 (to bf16, the FSDP step's
    # faithfulness, against the unsharded FP8 step's own).
    assert dist(p_fsdp, p_fp8) <= 1.5 * dist(p_fp8, p_bf16), (dist(p_fsdp, p_fp8), dist(p_fp8, p_bf16))
    assert dist(p_fsdp, p_bf16) <= 1.25 * dist(p_fp8, p_bf16), (dist(p_fsdp, p_bf16), dist(p_fp8, p_bf16))

    # 4. Composes with bf16 masters and dynamic loss scaling: a NaN in one
    # device's shard of the batch skips the step on every device, bit for bit.
    tx = jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10)
    step = jmp.make_train_step(loss_fn, bf16, autocast=True, fp8=recipe)
    state = jmp.TrainState.create(params=shard(params), tx=tx, master_dtype=jnp.bfloat16,
                                  rounding="nearest", weight_amaxes=True)
    before, amaxes = jax.device_get(state.params), jax.device_get(state.weight_amaxes)
    state, metrics = step(state, shard({"x": x.at[61, 3].set(jnp.nan), "y": y}))
    assert not bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 2.0**10
    for n, v in jax.device_get(state.params).items():
      np.testing.assert_array_equal(v.view(np.uint16), before[n].view(np.uint16))
    for n, v in jax.device_get(state.weight_amaxes).items():  # The weights' amaxes too.
      assert (v is None and amaxes[n] is None) or v.view(np.uint16) == amaxes[n].view(np.uint16), n
    assert float(jmp.loss_scale_of(state.opt_state)) == 2.0**9
    state, metrics = step(state, shard({"x": x, "y": y}))
    assert bool(metrics["grads_finite"]) and state.params["w1"].sharding.spec == P("fsdp")
    assert not np.array_equal(np.asarray(state.params["w1"]), np.asarray(before["w1"]))

    # 5. Composes with quantize_state (its codes and scales sharded with the
    # params) and orbax: saved on 8 devices, resumed on a mesh of 4, bit for bit.
    import tempfile
    import orbax.checkpoint as ocp
    tx = jmp.dynamic_loss_scaling(jmp.quantize_state(optax.adam(1e-3), "int8", min_size=0),
                                  init_scale=2.0**10)
    step = jmp.make_train_step(loss_fn, bf16, autocast=True, fp8=recipe)
    state = jmp.TrainState.create(params=shard(params), tx=tx, master_dtype=jnp.bfloat16,
                                  rounding="nearest")
    for _ in range(5):
      state, metrics = step(state, shard({"x": x, "y": y}))
    assert bool(metrics["grads_finite"]) and float(metrics["loss"]) < start
    coded = [l for l in jax.tree.leaves(state.opt_state) if l.dtype == jnp.uint8]  # int8 codes' bytes
    assert any(l.sharding.spec[:1] == ("fsdp",) for l in coded), [(l.shape, l.sharding.spec) for l in coded]
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    def on4(x):
      ok = x.ndim >= 1 and x.shape[0] % 4 == 0
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh4, P("fsdp") if ok else P()))
    with tempfile.TemporaryDirectory() as d, ocp.StandardCheckpointer() as ckptr:
      ckptr.save(d + "/state", state)
      ckptr.wait_until_finished()
      resumed = ckptr.restore(d + "/state", jax.tree.map(on4, state))
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(resumed))):
      np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))
    assert resumed.params["w1"].sharding.mesh.devices.size == 4
    four = lambda t: jax.device_put(t, NamedSharding(mesh4, P("fsdp")))
    resumed, metrics = jmp.make_train_step(loss_fn, bf16, autocast=True, fp8=recipe)(
        resumed, four({"x": x, "y": y}))
    assert bool(metrics["grads_finite"]) and resumed.params["w1"].sharding.mesh.devices.size == 4
    print("ok")
    """
)


def test_fsdp_fp8_gathers_float8_bit_for_bit_and_trains_like_one_device():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, f"child failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
  assert proc.stdout.strip().endswith("ok"), proc.stdout

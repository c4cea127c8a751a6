"""Which leaves ``quantize_state`` codes, read from the state itself (issue 43, item 1).

A moment (floating, a parameter's shape, its value independent of the
parameters' values) is coded; a copy of the parameters stays float32; counts
and everything else stay as the inner made them. Also the ecosystem:
``nnx.Optimizer`` and ``optax.tree_map_params``.
"""

import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax import contrib

import jmp_lite as jmp
from jmp_lite._src.optim import classify

PARAMS = {"w": jax.random.normal(jax.random.key(0), (16, 64)), "b": jnp.linspace(-1.0, 1.0, 48)}


def _is_q(x):
  return isinstance(x, jmp.QuantizedArray)


def _paths(state, keep):
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_q)[0]
  return sorted(jax.tree_util.keystr(p, simple=True, separator="/") for p, x in flat if keep(x))


def _is_copy(x):
  return not _is_q(x) and x.dtype == jnp.float32 and any(
      x.shape == p.shape and bool(jnp.array_equal(x, p)) for p in PARAMS.values())


# (coded leaves, float32 copies of the parameters) of each transformation's state. Adan's
# ``g`` (the last gradient, which the update overwrites and subtracts from the next one) is
# zeros at init like a moment, but no running value: it stays float32.
KINDS = {
    "sm3": (lambda: optax.sm3(0.1), ["0/mu/b/0", "0/nu/b", "0/nu/w"], []),
    "adan": (lambda: optax.adan(1e-3),
             ["0/m/b", "0/m/w", "0/n/b", "0/n/w", "0/v/b", "0/v/w"], []),
    "adadelta": (lambda: optax.adadelta(1.0), ["1/e_g/b", "1/e_g/w", "1/e_x/b", "1/e_x/w"], []),
    "schedule_free_adamw": (lambda: contrib.schedule_free_adamw(1e-3),
                            ["base_optimizer_state/0/nu/b", "base_optimizer_state/0/nu/w"],
                            ["z/b", "z/w"]),
    "mechanize": (lambda: contrib.mechanize(optax.adam(1e-3)),
                  [f"base_optimizer_state/0/{m}/{p}" for m in ("mu", "nu") for p in "bw"],
                  ["x0/b", "x0/w"]),
    "prodigy": (lambda: contrib.prodigy(),
                [f"{m}/{p}" for m in ("exp_avg", "exp_avg_sq", "grad_sum") for p in "bw"],
                ["params0/b", "params0/w"]),
    "madgrad": (lambda: contrib.madgrad(1e-2), ["1/grad_sum_sq/b", "1/grad_sum_sq/w", "1/s/b", "1/s/w"],
                ["1/x0/b", "1/x0/w"]),
    "cocob": (lambda: contrib.cocob(),
              [f"2/{m}/{p}" for m in ("cumulative_gradients", "reward", "scale", "subgradients")
               for p in "bw"], ["2/init_particles/b", "2/init_particles/w"]),
    "multisteps": (lambda: optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
                   ["acc_grads/b", "acc_grads/w"]
                   + [f"inner_opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in "bw"], []),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_moments_are_coded_and_copies_of_the_params_stay_float32(name):
  make, coded, copies = KINDS[name]
  state = jmp.quantize_state(make(), min_size=0, block_size=32).init(PARAMS)
  assert _paths(state.inner, _is_q) == coded
  assert _paths(state.inner, _is_copy) == copies


def test_dog_codes_nothing_and_says_why():
  with pytest.warns(UserWarning, match=r"no moment.*\(3 leaves copy or depend on the param"):
    state = jmp.quantize_state(contrib.dog(), min_size=0).init(PARAMS)
  assert _paths(state.inner, _is_q) == []
  assert _paths(state.inner, _is_copy) == ["1/init_params/b", "1/init_params/w"]


def test_lookahead_codes_the_fast_optimizers_moments():
  tx = jmp.quantize_state(optax.lookahead(optax.adam(1e-2), 5, 0.5), min_size=0, block_size=32)
  params = optax.LookaheadParams.init_synced(PARAMS)
  state = tx.init(params)
  assert _paths(state.inner, _is_q) == [f"fast_state/0/{m}/{p}" for m in ("mu", "nu") for p in "bw"]
  # keep rules name the parameter: "/w$" selects fast/w and slow/w, whose moments end in w.
  kept = jmp.quantize_state(optax.lookahead(optax.adam(1e-2), 5, 0.5), min_size=0,
                            block_size=32, keep="/w$").init(params)
  assert _paths(kept.inner, _is_q) == ["fast_state/0/mu/b", "fast_state/0/nu/b"]
  update = jax.jit(tx.update)
  for _ in range(12):
    updates, state = update(params.fast, state, params)  # the gradient of |fast|**2 / 2
    params = optax.apply_updates(params, updates)
  assert float(jnp.max(jnp.abs(params.slow["w"] - PARAMS["w"]))) > 0.05


def test_an_unknown_optimizer_is_read_from_its_init_program():
  def init(params):
    copy = jax.tree.map(lambda p: jax.lax.cond(True, lambda x: x * 1.0, jnp.zeros_like, p), params)
    return {"ema": jax.tree.map(jnp.zeros_like, params), "anchor": copy,
            "steps": jnp.zeros([], jnp.int32), "scalar": jnp.ones([])}

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  state = jmp.quantize_state(tx, min_size=0, block_size=32).init(PARAMS)
  assert _paths(state.inner, _is_q) == ["ema/b", "ema/w"]
  assert _paths(state.inner, _is_copy) == ["anchor/b", "anchor/w"]
  assert state.inner["steps"].dtype == jnp.int32 and not _is_q(state.inner["scalar"])


def test_leaves_the_update_rewrites_are_not_coded():
  """Zeros at init like a moment, but the update overwrites them or rebuilds them in a loop."""
  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return {"ema": zeros(), "last": zeros(), "looped": zeros(), "skipped": zeros()}

  def update(g, s, p=None):
    ok = jnp.all(jnp.isfinite(g["w"]))
    return g, {"ema": jax.tree.map(lambda m, x: 0.9 * m + x, s["ema"], g),
               "last": g,
               "looped": jax.tree.map(lambda m, x: jax.lax.fori_loop(0, 2, lambda _, y: y + x, m),
                                      s["looped"], g),
               "skipped": jax.tree.map(lambda m, x: jax.lax.cond(ok, lambda: m * 0.5 + x,
                                                                 lambda: m), s["skipped"], g)}

  state = jmp.quantize_state(optax.GradientTransformation(init, update), min_size=0,
                             block_size=32).init(PARAMS)
  assert _paths(state.inner, _is_q) == ["ema/b", "ema/w", "skipped/b", "skipped/w"]


def test_lbfgs_keeps_its_memory_and_matches_optax():
  """L-BFGS's last params, gradient and line-search memory are rewritten, so none is coded."""
  tx = optax.lbfgs()
  with pytest.warns(UserWarning, match=r"codes no leaf.*rewritten at each update"):
    wrapped = jmp.quantize_state(tx, min_size=0)
    state = wrapped.init(PARAMS)
  assert not _paths(state.inner, _is_q)
  loss = lambda p: jnp.sum((p["w"] - 1.0) ** 2) + jnp.sum(jnp.cos(p["b"]))
  value_and_grad = optax.value_and_grad_from_state(loss)

  def run(opt, opt_state):
    params = PARAMS
    for _ in range(5):
      value, grad = value_and_grad(params, state=opt_state)
      updates, opt_state = opt.update(grad, opt_state, params, value=value, grad=grad,
                                      value_fn=loss)
      params = optax.apply_updates(params, updates)
    return params

  chex.assert_trees_all_equal(run(wrapped, state), run(tx, tx.init(PARAMS)))


def test_an_init_that_reads_values_in_python_is_refused():
  def init(params):
    return {"m": jax.tree.map(lambda p: jnp.asarray(np.asarray(p) * 0), params)}

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  with pytest.raises(TypeError, match="could not trace the inner transformation's init"):
    jmp.quantize_state(tx, min_size=0).init(PARAMS)


def test_kinds_follow_data_through_a_nested_jit():
  init = jax.jit(lambda p: (jnp.zeros_like(p["w"]), p["w"] + 0.0, jnp.ones(3)))
  assert classify.kinds(init, PARAMS, 3, "f") == ["moment", "params", "other"]


# ------------------------------------------------------------------ overrides


def test_keep_state_rules_match_the_state_path():
  ms = lambda: optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation()
  state = jmp.quantize_state(ms(), min_size=0, keep_state="acc_grads").init(PARAMS)
  assert _paths(state.inner, _is_q) == [f"inner_opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in "bw"]
  state = jmp.quantize_state(ms(), min_size=0,
                             keep_state=lambda path, leaf: path.endswith("/w")).init(PARAMS)
  assert _paths(state.inner, _is_q) == ["acc_grads/b", "inner_opt_state/0/mu/b",
                                       "inner_opt_state/0/nu/b"]
  with pytest.warns(UserWarning, match="keep_state.*selects no floating leaf of the inner state"):
    jmp.quantize_state(ms(), min_size=0, keep_state="no_such_field").init(PARAMS)


@pytest.mark.parametrize("make, match", [
    (lambda: optax.sgd(0.1), "no moment: no floating leaf shaped like a parameter"),
    (lambda: optax.adam(1e-3), r"of its 4 moment leaves, 4 have fewer than min_size=4096 "
                               r"elements \(the largest has 1024\)"),
])
def test_a_transformation_that_codes_nothing_warns(make, match):
  with pytest.warns(UserWarning, match=match):
    jmp.quantize_state(make()).init(PARAMS)


def test_kept_moments_are_named_in_the_warning():
  with pytest.warns(UserWarning, match="4 are selected by keep or keep_state rules"):
    jmp.quantize_state(optax.adam(1e-3), min_size=0, keep=".").init(PARAMS)


# --------------------------------------------------------------- validation


@pytest.mark.parametrize("block_size", [2**17, 2**40])
def test_block_size_has_an_upper_bound(block_size):
  with pytest.raises(ValueError, match=rf"<= 65536 \(2\*\*16; e.g. 256\), got {block_size}"):
    jmp.quantize_state(optax.adam(1e-3), block_size=block_size)
  assert jmp.quantize_state(optax.adam(1e-3), block_size=2**16) is not None


@pytest.mark.parametrize("arg", ["keep", "keep_state"])
def test_a_one_argument_keep_callable_names_the_signature(arg):
  def by_path(path):
    return "embed" in path

  with pytest.raises(TypeError, match=re.escape("must take (path: str, leaf) -> bool")
                     + ".*'by_path' has the signature \\(path\\)"):
    jmp.quantize_state(optax.adam(1e-3), **{arg: by_path})


# ---------------------------------------------------------------- ecosystem


def _params_copy_training(make, steps=300):
  """Final losses of ``make()`` in float32 and int8 on a small MLP (one scan each)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  start = {"w1": jax.random.normal(k1, (32, 64)) / np.sqrt(32), "w2": jax.random.normal(k2, (64, 8)) / 8}
  x = jax.random.normal(jax.random.key(1), (128, 32))
  y = jnp.sin(x @ jax.random.normal(jax.random.key(99), (32, 8)))
  loss = lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  def final(tx):
    def body(carry, _):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return (optax.apply_updates(p, u), s), None
    return float(loss(jax.lax.scan(body, (start, tx.init(start)), None, steps)[0][0]))

  return float(loss(start)), final(make()), final(jmp.quantize_state(make(), min_size=0, block_size=32))


def test_schedule_free_adamw_reaches_float32s_loss():
  start, fp32, int8 = _params_copy_training(lambda: contrib.schedule_free_adamw(1e-2))
  assert int8 < 1.5 * fp32 < 1e-3 * start  # with z coded: 3.4x fp32


def test_mechanize_leaves_its_start():
  start, fp32, int8 = _params_copy_training(lambda: contrib.mechanize(optax.adam(1e-3)))
  assert fp32 < 0.1 * start and int8 < 1.5 * fp32  # with x0 coded it stayed at 0.998 start


class _Mlp(nnx.Module):
  def __init__(self, rngs):
    self.l1, self.l2 = nnx.Linear(32, 128, rngs=rngs), nnx.Linear(128, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def test_nnx_optimizer_trains_for_many_steps():
  x = jax.random.normal(jax.random.key(1), (64, 32))
  y = jnp.sin(x[:, :8])

  def losses(tx):
    model = _Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      optimizer.update(model, grads)
      return loss

    return [float(step(model, optimizer)) for _ in range(200)], optimizer

  coded, optimizer = losses(jmp.quantize_state(optax.adam(1e-3), min_size=1024, block_size=64))
  ref, _ = losses(optax.adam(1e-3))
  assert len(_paths(nnx.as_pure(optimizer.opt_state), _is_q)) == 4  # both kernels, mu and nu
  assert coded[-1] < 0.01 * coded[0] and abs(coded[-1] - ref[-1]) < 0.1 * ref[-1]


def test_tree_map_params_maps_over_every_array_of_the_state():
  """optax's own subtest (``tree_map_params(opt, lambda v: v, state)``) and a device_put."""
  tx = jmp.quantize_state(optax.adam(1e-3), min_size=0)
  state = tx.init(PARAMS)
  same = optax.tree_map_params(tx, lambda v: v, state)
  chex.assert_trees_all_equal(same, state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  seen = []
  optax.tree_map_params(tx, lambda v: seen.append(v.dtype) or v, state,
                        transform_non_params=lambda v: v)
  coded = len(_paths(state, _is_q))
  assert coded and sorted(map(str, seen)).count("uint8") == coded  # the codes of mu and nu
  moved = optax.tree_map_params(tx, lambda v: jax.device_put(v, jax.devices()[0]), state)
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, PARAMS), moved, PARAMS)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_coding_the_multisteps_accumulator_adds_little_drift():
  """Distance from the float32 run of ``MultiSteps(adamw, 4)``, as a share of its travel."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  start = {"w1": jax.random.normal(k1, (32, 64)) / 5.7, "w2": jax.random.normal(k2, (64, 32)) / 8}
  w = jax.random.normal(k3, (32, 32)) / 5.7
  xs = jax.random.normal(jax.random.key(1), (200, 16, 32))
  loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - jnp.sin(x @ w)) ** 2)

  def final(tx):
    def body(carry, x):
      p, s = carry
      u, s = tx.update(jax.grad(loss)(p, x), s, p)
      return (optax.apply_updates(p, u), s), None
    return jax.lax.scan(body, (start, tx.init(start)), xs)[0][0]

  make = lambda: optax.MultiSteps(optax.adamw(3e-3), 4).gradient_transformation()
  ref = final(make())
  dist = lambda a, b: float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)))
  coded, kept = (dist(final(jmp.quantize_state(make(), "int8", min_size=0, block_size=64, **kw)), ref)
                 / dist(ref, start) for kw in ({}, dict(keep_state="acc_grads")))
  assert coded < 0.05 and coded < 1.25 * kept  # measured: 2.07% and 2.06%

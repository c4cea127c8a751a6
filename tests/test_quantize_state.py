"""Optimizer state in 8 bits (issue 35): ``jmp.quantize_state``.

Every numeric bound here is against the same run with the float32 state.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite as jmp
from jmp_lite._src.optim import quantize as quantize_lib
from jmp_lite._src.optim import codes as codes_lib
from conftest import assert_bitwise_equal

FORMATS = ["int8", "float8"]
CODE_DTYPES = {("int8", False): jnp.int8, ("int8", True): jnp.uint8,
               ("float8", False): jnp.float8_e4m3fn, ("float8", True): jnp.uint8}


def quantized_leaves(state):
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jmp.QuantizedArray))
          if isinstance(x, jmp.QuantizedArray)]


def mlp_params(seed=0, n_in=32, hidden=128, n_out=8):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (n_in, hidden)) / np.sqrt(n_in), "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, n_out)) / np.sqrt(hidden)}


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def mlp_batch(seed, n=64, n_in=32, n_out=8):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (n, n_in))
  return {"x": x, "y": jnp.sin(x @ jax.random.normal(jax.random.key(99), (n_in, n_out)))}


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(format="int4"), ValueError, r"format must be one of \('int8', 'float8'\), got 'int4'"),
    (dict(format=8), TypeError, "format must be one of"),
    (dict(block_size=48), ValueError, "block_size must be a power of two >= 32.*got 48"),
    (dict(block_size=16), ValueError, "block_size must be a power of two >= 32.*got 16"),
    (dict(block_size=256.0), TypeError, "block_size must be a power of two >= 32.*got 256.0"),
    (dict(min_size=-1), ValueError, "min_size must be an int >= 0, got -1"),
    (dict(keep="(["), ValueError, "keep rule '\\(\\[' is not a valid regular expression"),
    (dict(keep=3), TypeError, "a keep rule must be"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    jmp.quantize_state(optax.adam(1e-3), **kwargs)


@pytest.mark.parametrize("tx", [optax.adamw, "adam", None, optax.GradientTransformation])
def test_tx_must_be_a_transformation(tx):
  with pytest.raises(TypeError, match="tx must be an optax GradientTransformation"):
    jmp.quantize_state(tx)


# ------------------------------------------------------ inner transformations

INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-1, momentum=0.9),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(),
                                 optax.add_decayed_weights(1e-2), optax.scale(-1e-2)),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inner", list(INNERS))
def test_inner_state_is_coded_and_updates_track_float32(inner, fmt):
  params = mlp_params()
  tx = jmp.quantize_state(INNERS[inner](), fmt, block_size=32, min_size=1000)
  ref_tx = INNERS[inner]()
  state, ref_state = tx.init(params), ref_tx.init(params)
  coded = quantized_leaves(state)
  # w1 (4096) and w2 (1024) are coded in each per-parameter field; b1 (128) is not.
  fields = {"adam": 2, "adamw": 2, "lion": 1, "sgd_momentum": 1, "chain": 2}[inner]
  assert len(coded) == 2 * fields
  for q in coded:
    assert q.codes.dtype == CODE_DTYPES[(fmt, q.non_negative)]
    assert q.scales.dtype == jnp.float32
    # w1 (32, 128): blocks along the last axis; w2 (128, 8): over the flattened leaf.
    assert (q.codes.shape, q.scales.shape) == {(32, 128): ((32, 128), (32, 4)),
                                               (128, 8): ((32, 32), (32,))}[q.shape]
  assert {q.non_negative for q in coded} == ({False, True} if fields == 2 else {False})
  update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
  for t in range(5):
    grads = jax.grad(mlp_loss)(params, mlp_batch(t))
    u, state = update(grads, state, params)
    r, ref_state = ref_update(grads, ref_state, params)
    for k in params:
      scale = float(jnp.max(jnp.abs(r[k])))
      if inner == "lion":  # Steps of +-lr: a sign flips only where |c| is tiny.
        assert float(jnp.mean(u[k] == r[k])) > 0.95
      else:  # Per element, against the largest step. The second moment's tail rounds up:
        # in the first steps, while v grows fast, the steps of its elements shrink.
        tol = 0.3
        assert float(jnp.max(jnp.abs(u[k] - r[k]))) <= tol * scale, (k, t)
  assert update._cache_size() == 1
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))


# ------------------------------------------------- mixed magnitudes: no blow-up


def _probe(tx, small=1e-6, steps=3000):
  """Adam on (16, 256) params whose columns see gradients of 1 or ``small`` (times noise).

  Returns ``tx``'s largest |update| over the run and its final state.
  Thousands of steps: a second moment lost to rounding shows fully only once
  Adam's bias correction has faded (the fresh ``(1 - b2) g**2`` alone then
  gives steps of ``(1 - b1) / sqrt(1 - b2) = 3.16`` learning rates).
  """
  params = {"w": jnp.zeros((16, 256))}
  magnitude = jnp.where(jnp.arange(256) % 2 == 0, 1.0, small)

  @jax.jit
  def run(state):
    def body(state, key):
      noise = jax.random.uniform(key, (16, 256), minval=0.5, maxval=1.5)
      u, state = tx.update({"w": magnitude * noise}, state, params)
      return state, jnp.max(jnp.abs(u["w"]))
    state, largest = jax.lax.scan(body, state, jax.random.split(jax.random.key(0), steps))
    return jnp.max(largest), state

  return run(tx.init(params))


def _largest_adam_step(tx, steps=3000, small=1e-6):
  """Largest |update| of ``tx`` on :func:`_probe`'s params."""
  return float(_probe(tx, small, steps)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_magnitude_block_does_not_blow_up(fmt, monkeypatch):
  lr = 1e-3
  reference = _largest_adam_step(optax.adam(lr))
  assert lr <= reference < 1.25 * lr
  largest = _largest_adam_step(jmp.quantize_state(optax.adam(lr), fmt))
  assert largest <= 1.5 * reference
  # The bound has teeth: coded as signed state (companded int8 or e4m3 of v
  # itself), the small second moments round to zero and the steps blow up.
  monkeypatch.setattr(quantize_lib, "NON_NEGATIVE_FIELDS", frozenset())
  assert _largest_adam_step(jmp.quantize_state(optax.adam(lr), fmt)) > 2 * reference


def _second_moments_after(tx, small, steps=3000):
  """``sqrt(v)`` of ``tx`` over float32 Adam's for :func:`_probe`'s small columns."""
  state = _probe(tx, small, steps)[1]
  ref_state = _probe(optax.adam(1e-3), small, steps)[1]
  return jnp.sqrt(state.inner[0].nu["w"].dequantize() / ref_state[0].nu["w"])[:, 1::2]


@pytest.mark.parametrize("small", [0.2, 1e-2])
def test_no_blow_up_at_any_ratio_within_a_block(small, monkeypatch):
  # Below the top of the block v is rounded up, so no ratio of gradients in a
  # block makes a step much larger than float32 Adam's: the code's tail, and
  # the cube-root code it replaced (1.41x at 1e-2), were measured at 1e-1 to 1e-7.
  lr = 1e-3
  reference = _largest_adam_step(optax.adam(lr), small=small)
  tx = jmp.quantize_state(optax.adam(lr), "int8")
  assert _largest_adam_step(tx, small=small) <= 1.2 * reference
  # Teeth: rounded to the nearest tail code instead of up, the bound is broken.
  monkeypatch.setattr(codes_lib, "_CEIL_SLACK", 0.5)
  assert _largest_adam_step(tx, small=small) > 1.2 * reference


def test_the_tail_tracks_v_without_a_ratchet(monkeypatch):
  tx = jmp.quantize_state(optax.adam(1e-3), "int8")
  ratio = _second_moments_after(tx, 1e-2)
  # Rounded up, sqrt(v) is never much below float32's; the slack keeps it near.
  assert float(jnp.min(ratio)) > 0.85
  assert 0.9 < float(jnp.median(ratio)) < 1.5
  # Teeth: rounded strictly up, each fall of the block's scale moves the tail
  # up a code, and sqrt(v) settles near 3x float32's (steps a third of Adam's).
  monkeypatch.setattr(codes_lib, "_CEIL_SLACK", 1e-3)
  assert float(jnp.median(_second_moments_after(tx, 1e-2))) > 2.0


def test_the_second_moments_code():
  q = jnp.arange(256, dtype=jnp.float32)
  levels = codes_lib._decode_non_negative(q)
  assert float(levels[0]) == 0.0 and float(levels[255]) == 1.0
  assert float(levels[1]) < 1e-14  # the tail reaches far below any v Adam can tell from eps
  assert bool(jnp.all(jnp.diff(levels) > 0))
  assert bool(jnp.all(codes_lib._encode_non_negative(levels) == q))  # Idempotent: no ratchet.
  steps = levels[2:] / levels[1:-1] - 1
  assert float(steps[-1]) < 0.005  # The top of the block, where drift is made.
  assert float(jnp.max(steps[codes_lib._TOP_FROM - 1:])) < 0.022
  y = jnp.exp(jax.random.uniform(jax.random.key(0), (100_000,), minval=np.log(1e-9), maxval=0.0))
  decoded = codes_lib._decode_non_negative(codes_lib._encode_non_negative(y))
  tail = y < codes_lib._TOP_FOOT
  # Rounded up, with a tenth of a code's slack: at most 8% below, down to 1e-6.
  assert float(jnp.min((decoded / y)[tail & (y > 1e-6)])) >= 0.92
  assert float(jnp.max(jnp.abs(decoded[~tail] / y[~tail] - 1))) < 0.011  # half of 2.1%
  x = jnp.abs(jax.random.normal(jax.random.key(1), (4, 256))) ** 4
  codes, scales = codes_lib.encode(x, "int8", True)
  assert codes.dtype == jnp.uint8 and scales.shape == (4,)
  decoded, seen = codes_lib.decode(codes, scales, "int8", True), x > 1e-12 * jnp.max(x)
  assert bool(jnp.all(decoded[seen] >= 0.84 * x[seen]))  # never far below, whatever the ratio
  top = x >= codes_lib._TOP_FOOT ** 2 * jnp.max(x, axis=-1, keepdims=True)
  np.testing.assert_allclose(decoded[top], x[top], rtol=0.02)


# ------------------------------------------------------- drift from float32


@pytest.mark.parametrize("fmt, bound", [("int8", 0.05), ("float8", 0.1)])
def test_drift_from_float32_adamw_on_an_mlp(fmt, bound):
  params0 = mlp_params()
  policy = jmp.get_policy("p=f32,c=f32,o=f32")
  step = jmp.make_train_step(mlp_loss, policy, donate=False)
  runs = {}
  for name, tx in [("f32", optax.adamw(3e-3)),
                   (fmt, jmp.quantize_state(optax.adamw(3e-3), fmt, block_size=64, min_size=0))]:
    state = jmp.TrainState.create(params=params0, tx=tx)
    for t in range(150):
      state, metrics = step(state, mlp_batch(t))
    runs[name] = (state.params, float(metrics["loss"]))
  moved = optax.tree.norm(jax.tree.map(jnp.subtract, runs["f32"][0], params0))
  drift = optax.tree.norm(jax.tree.map(jnp.subtract, runs[fmt][0], runs["f32"][0]))
  assert float(drift) <= bound * float(moved)
  assert runs[fmt][1] <= 1.1 * runs["f32"][1]
  assert runs["f32"][1] < 0.7 * float(mlp_loss(params0, mlp_batch(149)))


# ---------------------------------------------------------- which leaves


def test_min_size_and_keep_rules_leave_state_as_the_inner_made_it():
  params = {"embed": jnp.ones((64, 64)), "dense": {"kernel": jnp.ones((64, 64)),
                                                   "bias": jnp.ones(64)}, "head": jnp.ones((64, 64))}

  def coded(**kwargs):
    state = jmp.quantize_state(optax.adam(1e-3), block_size=64, **kwargs).init(params)
    return {k: isinstance(v, jmp.QuantizedArray) for k, v in
            [("embed", state.inner[0].mu["embed"]), ("kernel", state.inner[0].mu["dense"]["kernel"]),
             ("bias", state.inner[0].nu["dense"]["bias"]), ("head", state.inner[0].nu["head"])]}

  assert coded(min_size=4096) == dict(embed=True, kernel=True, bias=False, head=True)
  assert coded(min_size=0) == dict(embed=True, kernel=True, bias=True, head=True)
  with pytest.warns(UserWarning, match="8 have fewer than min_size=4097 elements"):
    assert coded(min_size=4097) == dict(embed=False, kernel=False, bias=False, head=False)
  assert coded(keep="embed") == dict(embed=False, kernel=True, bias=False, head=True)
  assert coded(keep=["^embed$", lambda path, leaf: path.startswith("dense")]) == dict(
      embed=False, kernel=False, bias=False, head=True)
  # A kept leaf is the inner's own array: its dtype and values.
  state = jmp.quantize_state(optax.adam(1e-3), keep="embed").init(params)
  assert state.inner[0].mu["embed"].dtype == jnp.float32 and state.inner[0].count.dtype == jnp.int32


# ------------------------------------------------- through the train step

POLICY = jmp.get_policy("p=f32,c=bf16,o=f32")


def digits_like(seed=0, n=64):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (n, 32)), "y": jax.random.normal(ky, (n, 8))}


def test_lean_masters_and_int8_state_train_with_one_compilation():
  tx = jmp.dynamic_loss_scaling(jmp.quantize_state(optax.adamw(3e-3), min_size=1024))
  state = jmp.TrainState.create(params=mlp_params(), tx=tx, master_dtype=jnp.bfloat16,
                                rounding="stochastic", key=jax.random.key(0))
  step = jmp.make_train_step(mlp_loss, POLICY)
  types = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "weak_type", False)), s)
  before = types(state)
  losses = []
  for t in range(40):
    state, metrics = step(state, mlp_batch(t))
    losses.append(float(metrics["loss"]))
  assert types(state) == before and step._cache_size() == 1
  assert {x.codes.dtype for x in quantized_leaves(state.opt_state)} == {np.dtype(jnp.int8), np.dtype(jnp.uint8)}
  assert state.params["w1"].dtype == jnp.bfloat16
  assert losses[-1] < 0.7 * losses[0]


def test_a_skipped_step_leaves_codes_and_scales_bitwise_unchanged():
  tx = jmp.dynamic_loss_scaling(jmp.quantize_state(optax.adam(1e-2), min_size=0, block_size=32))
  state = jmp.TrainState.create(params=mlp_params(), tx=tx)
  step = jmp.make_train_step(mlp_loss, POLICY)
  for t in range(3):
    state, metrics = step(state, mlp_batch(t))
  before = jax.device_get(state.opt_state.inner_state)
  params = jax.device_get(state.params)
  poisoned = mlp_batch(3)
  poisoned["x"] = poisoned["x"].at[0, 0].set(jnp.inf)
  state, metrics = step(state, poisoned)
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.opt_state.inner_state, before)
  assert_bitwise_equal(state.params, params)
  state, metrics = step(state, mlp_batch(4))  # and the next finite step moves the codes
  assert bool(metrics["grads_finite"])
  moved = [not np.array_equal(a, b) for a, b in
           zip(jax.tree.leaves(jax.device_get(state.opt_state.inner_state)), jax.tree.leaves(before))]
  assert sum(moved) >= 8


def test_multisteps_accumulates_and_applies_every_k_steps():
  tx = optax.MultiSteps(jmp.quantize_state(optax.adam(1e-2), min_size=0, block_size=32), 2)
  state = jmp.TrainState.create(params=mlp_params(), tx=tx)
  step = jmp.make_train_step(mlp_loss, POLICY)
  seen = [jax.device_get(state.params["w1"])]
  for t in range(4):
    state, _ = step(state, mlp_batch(t))
    seen.append(jax.device_get(state.params["w1"]))
  changed = [not np.array_equal(a, b) for a, b in zip(seen, seen[1:])]
  assert changed == [False, True, False, True]
  assert len(quantized_leaves(state.opt_state.inner_opt_state)) == 6
  assert step._cache_size() == 1


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jnp.tanh(nn.Dense(64)(x)))


class _Nnx(nnx.Module):
  def __init__(self, rngs):
    self.l1, self.l2 = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def _frameworks():
  linen = _Linen()
  variables = linen.init(jax.random.key(0), jnp.ones((1, 32)))
  graphdef, nnx_params = nnx.split(_Nnx(nnx.Rngs(0)))
  eqx_model = eqx.nn.MLP(32, 8, 64, 1, activation=jnp.tanh, key=jax.random.key(0))
  return {
      "linen": (variables["params"], lambda p, x: linen.apply({"params": p}, x)),
      "nnx": (nnx_params, lambda p, x: nnx.merge(graphdef, p)(x)),
      "equinox": (eqx_model, lambda m, x: jax.vmap(m)(x)),
  }


@pytest.mark.parametrize("framework", ["linen", "nnx", "equinox"])
def test_linen_nnx_and_equinox_params(framework):
  params, apply = _frameworks()[framework]

  def loss_fn(p, batch):
    return jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2)

  tx = jmp.quantize_state(optax.adam(1e-2), block_size=32, min_size=512)
  state = jmp.TrainState.create(params=params, tx=tx)
  coded = quantized_leaves(state.opt_state)
  # The two kernels (Equinox stores them transposed), in mu and nu; not the biases.
  assert sorted(int(np.prod(q.shape)) for q in coded) == [512, 512, 2048, 2048]
  step = jmp.make_train_step(loss_fn, POLICY)
  first = None
  for t in range(30):
    state, metrics = step(state, digits_like(t % 2))
    first = float(metrics["loss"]) if first is None else first
  assert float(metrics["loss"]) < 0.8 * first

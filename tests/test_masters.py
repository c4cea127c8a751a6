"""Lean master weights (issue 14): bf16 masters with nearest, stochastic or Kahan rounding.

The references are float32 (or float64) sums; the stall of round-to-nearest
is shown, not assumed. Resume is in ``test_resume.py`` and sharding in
``test_sharding.py``.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp
from jmp_lite._src import masters
from conftest import Traces
from conftest import assert_bitwise_equal
from conftest import classifier_batch
from conftest import classifier_loss
from conftest import classifier_params
from conftest import host

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = jnp.bfloat16
LEAN = [
    dict(master_dtype=BF16, rounding="nearest"),
    dict(master_dtype=BF16, rounding="stochastic", key=jax.random.key(7)),
    dict(master_dtype=BF16, rounding="kahan"),
]
LEAN_IDS = ["nearest", "stochastic", "kahan"]


def ulp_bf16(x):
  """bf16's spacing at |x| (the gap to the next larger magnitude), in float64."""
  x = np.abs(np.asarray(x, np.float64))
  e = np.floor(np.log2(np.maximum(x, 2.0**-126)))
  return 2.0 ** (e - 7)


def as_f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def bits(x):
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}")


# ------------------------------------------------------------ stochastic rounding


@jax.jit
def many_roundings(x, key):
  seeds = jax.random.bits(key, (4096,), jnp.uint32)
  return jax.vmap(lambda s: masters.stochastic_round(x, s))(seeds)


def test_stochastic_rounding_is_unbiased_per_element():
  rng = np.random.default_rng(0)
  mags = 2.0 ** rng.uniform(-20, 20, 256)
  x = (mags * rng.choice([-1, 1], 256)).astype(np.float32)
  x[:4] = [1.0 + 0.001 * 2**-7, 1.0 + 0.999 * 2**-7, 2.0 - 2.0**-20, -(3.0 + 0.5 * 2**-6)]
  out = many_roundings(jnp.asarray(x), jax.random.key(0))
  assert out.dtype == BF16
  got = as_f64(out)
  down = as_f64(jnp.asarray(x).astype(BF16))
  # Each result is one of the two bf16 neighbours of x: never further away.
  lo = np.minimum(down, got.min(0))
  hi = np.maximum(down, got.max(0))
  assert np.all(hi - lo <= ulp_bf16(x) + 1e-30)
  assert np.all((lo <= x) & (x <= hi))
  # Unbiased: the mean of 4096 roundings is within 5 standard errors (ulp / 2 /
  # sqrt(4096)) of x. The seeds are fixed, so this is deterministic.
  err = np.abs(got.mean(0) - x.astype(np.float64)) / ulp_bf16(x)
  assert err.max() < 5 * 0.5 / np.sqrt(4096), err.max()
  # Round to nearest, in contrast, is off by up to half an ulp at every draw.
  assert np.abs(down - x).max() / ulp_bf16(x[np.argmax(np.abs(down - x))]) > 0.4


@pytest.mark.parametrize("fraction", [0.001, 0.25, 0.5, 0.9])
def test_stochastic_rounding_rounds_up_with_the_right_probability_across_elements(fraction):
  # One seed, 2**16 elements: the hash must decorrelate neighbouring elements.
  base = 2.0 ** np.random.default_rng(1).integers(-10, 10, 2**16)
  x = (base * (1.0 + 2.0**-7 * (1 + fraction))).astype(np.float32)
  out = jax.jit(masters.stochastic_round)(jnp.asarray(x), jnp.uint32(12345))
  up = as_f64(out) > x
  assert abs(up.mean() - fraction) < 5 * np.sqrt(fraction * (1 - fraction) / up.size)


def test_stochastic_rounding_edge_values():
  f32 = np.finfo(np.float32)
  bf16_max = float(jnp.finfo(BF16).max)
  x = jnp.array([f32.max, -f32.max, np.nextafter(np.float32(bf16_max), np.float32(np.inf)),
                 np.inf, -np.inf, np.nan, -0.0, 0.0, 1.5, -2.0**-130, 2.0**-149], jnp.float32)
  out = many_roundings(x, jax.random.key(3))
  got = np.asarray(out.astype(jnp.float32))
  # A finite value never becomes inf: past bf16's max it truncates to it.
  assert np.all(got[:, :3] == np.array([bf16_max, -bf16_max, bf16_max], np.float32))
  assert np.all(got[:, 3] == np.inf) and np.all(got[:, 4] == -np.inf)
  assert np.all(np.isnan(got[:, 5]))
  # Exact bf16 values come back unchanged, bit for bit, -0.0 included.
  assert np.all(bits(out[:, 6]) == 0x8000) and np.all(bits(out[:, 7]) == 0)
  assert np.all(got[:, 8] == 1.5)
  # Subnormals round between their neighbours (the mean is unbiased here too);
  # both neighbours of 2**-149 are 0 and 2**-133.
  assert set(np.unique(got[:, 10])) <= {0.0, np.float32(2.0**-133)}
  assert np.all(got[:, 9] <= 0)


def test_stochastic_rounding_is_deterministic_given_the_key():
  params = {"a": jnp.linspace(1, 2, 100, dtype=BF16), "b": jnp.full((3, 5), 0.3, BF16)}
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params)
  key = jax.random.key(42)
  apply = jax.jit(lambda p, u, k: jmp.apply_updates(p, u, rounding="stochastic", key=k)[0])
  first = jmp.apply_updates(params, updates, rounding="stochastic", key=key)[0]  # eager
  assert_bitwise_equal(first, apply(params, updates, key))
  other = apply(params, updates, jax.random.key(43))
  assert not np.array_equal(bits(first["a"]), bits(other["a"]))
  # Each leaf draws its own seed: the same value in two leaves rounds independently.
  same = {"a": jnp.full(4096, 1.0, BF16), "b": jnp.full(4096, 1.0, BF16)}
  ups = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-9, jnp.float32), same)
  out = apply(same, ups, key)
  assert not np.array_equal(bits(out["a"]), bits(out["b"]))


# ------------------------------------------------------------ apply_updates


def tiny_problem(n=4096, seed=0):
  rng = np.random.default_rng(seed)
  p0 = jnp.asarray(rng.uniform(1.0, 4.0, n), BF16)
  # Each update is 1%-40% of the smaller gap next to p0 (half the ulp above at a
  # power of two), below half a gap, so round-to-nearest drops it. Each weight
  # drifts one way (its own sign), about 200 gaps over 1000 steps.
  gap = ulp_bf16(as_f64(p0)) / 2
  u = rng.uniform(0.01, 0.4, (1000, n)) * gap * rng.choice([-1, 1], n)
  return p0, jnp.asarray(u, jnp.float32)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_1000_tiny_updates_against_a_float64_reference(rounding):
  p0, u = tiny_problem()
  reference = as_f64(p0) + np.asarray(u, np.float64).sum(0)
  keys = jax.random.split(jax.random.key(0), len(u))
  comp0 = jnp.zeros_like(p0) if rounding == "kahan" else None

  @jax.jit
  def run(p, c):
    def body(carry, xs):
      p, c = carry
      ui, ki = xs
      key = ki if rounding == "stochastic" else None
      p, c = jmp.apply_updates(p, ui, rounding=rounding, key=key, compensation=c)
      return (p, c), None
    return jax.lax.scan(body, (p, c), (u, keys))[0]

  p, c = run(p0, comp0)
  value = as_f64(p) + (0.0 if c is None else as_f64(c))
  err = np.abs(value - reference) / ulp_bf16(reference)  # in ulps of the result
  drift = np.abs(reference - as_f64(p0)) / ulp_bf16(reference)
  assert drift.min() > 10 and np.median(drift) > 30
  if rounding == "nearest":
    # Every update is rounded away: the weights never move, whatever the drift.
    assert_bitwise_equal(p, p0)
  elif rounding == "kahan":
    # p + c tracks the exact sum to a fraction of an ulp (against a drift of
    # 10-400 ulps): the bf16 compensation keeps about 8 bits of what each
    # rounding lost, so each step can lose ~2**-9 of the compensation.
    assert err.max() < 0.25 and err.mean() < 0.02, (err.max(), err.mean())
    assert np.all(np.abs(as_f64(c)) <= 0.5 * ulp_bf16(as_f64(p)))
  else:
    # An unbiased random walk: each rounding adds at most half an ulp of
    # zero-mean noise, so the error is ~sqrt(1000 * q(1-q)) ulps per weight,
    # and its mean over 4096 weights is ~0 (5 standard errors allowed).
    signed = (as_f64(p) - reference) / ulp_bf16(reference)
    assert abs(signed.mean()) < 5 * np.sqrt(1000 * 0.25 / len(signed)), signed.mean()
    assert np.sqrt(np.mean(err**2)) < np.sqrt(1000 * 0.25)
    assert np.median(err) < 0.2 * np.median(drift)


@pytest.mark.parametrize("zero", [-0.0, 0.0])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_zero_updates_change_nothing(rounding, zero, maybe_jit):
  # p has an odd last mantissa bit and c is exactly half an ulp: re-rounding
  # p + c would move p to its even neighbour.
  p = {"w": jnp.array([1.0 + 2.0**-7, -3.0, 0.0, -0.0], BF16), "n": jnp.int32(3)}
  c = {"w": jnp.array([2.0**-8, -2.0**-7, 0.0, 0.0], BF16), "n": jnp.int32(0)}
  u = {"w": jnp.full(4, zero, jnp.float32), "n": None}
  kwargs = {"nearest": {}, "stochastic": {"key": jax.random.key(0)}, "kahan": {"compensation": c}}
  new_p, new_c = maybe_jit(lambda p, u, kw: jmp.apply_updates(p, u, rounding=rounding, **kw))(
      {"w": p["w"], "n": None}, u, kwargs[rounding])
  expected = np.asarray(p["w"])
  if not np.signbit(zero) and rounding != "kahan":
    expected = expected + np.float32(0.0).astype(BF16)  # optax's rule: -0.0 + 0.0 == +0.0
  assert bits(new_p["w"]).tolist() == bits(jnp.asarray(expected, BF16)).tolist()
  if rounding == "kahan":
    assert_bitwise_equal(new_c["w"], c["w"])
    assert int(new_c["n"]) == 0  # non-bf16 compensation leaves come back as they are
  else:
    assert new_c is None


def test_float32_leaves_are_updated_like_optax_and_none_stays_none():
  params = {"f32": jnp.array([1.0, -2.0]), "bf16": jnp.array([1.0, 2.0], BF16), "none": None}
  updates = {"f32": jnp.array([1e-3, 0.5]), "bf16": jnp.array([0.5, 0.5]), "none": None}
  for rounding, kw in [("nearest", {}), ("stochastic", {"key": jax.random.key(1)}),
                       ("kahan", {"compensation": jax.tree.map(jnp.zeros_like, params)})]:
    new, _ = jax.jit(lambda p, u, kw: jmp.apply_updates(p, u, rounding=rounding, **kw))(
        params, updates, kw)
    assert_bitwise_equal(new["f32"], optax.apply_updates(params["f32"], updates["f32"]))
    assert new["none"] is None
    np.testing.assert_array_equal(new["bf16"].astype(jnp.float32), [1.5, 2.5])  # exact sums
    assert new["bf16"].dtype == BF16


# ------------------------------------------------------------ the train step


def make_params(seed=0):
  return dict(classifier_params(seed), count=jnp.int32(4))


def dtypes(tree):
  return jax.tree.map(lambda x: (x.dtype, x.shape, getattr(x, "weak_type", False)), tree)


@pytest.mark.parametrize("lean", LEAN, ids=LEAN_IDS)
def test_step_computes_in_float32_and_writes_back_bf16(lean):
  seen = {}

  def spy():
    def init(params):
      seen["init"] = {x.dtype for x in jax.tree.leaves(params)}
      return optax.EmptyState()

    def update(grads, state, params=None):
      seen["update"] = ({g.dtype for g in jax.tree.leaves(grads)},
                        {p.dtype for p in jax.tree.leaves(params)})
      return grads, state
    return optax.GradientTransformation(init, update)

  def loss_fn(params, batch):
    seen["loss_fn"] = {params[k].dtype for k in ("w1", "b1", "w2")}
    return classifier_loss(params, batch)

  tx = jmp.static_loss_scaling(optax.chain(spy(), optax.adam(1e-2)), 1.0)
  state = jmp.TrainState.create(params=make_params(), tx=tx, **lean)
  assert state.master_dtype == BF16 and state.rounding == lean["rounding"]
  assert seen["init"] == {np.dtype(jnp.float32)}
  adam = state.opt_state.inner_state[1][0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(jnp.float32)}
  traces = Traces()
  step = jmp.make_train_step(traces(loss_fn), jmp.get_policy("mixed_bfloat16"))
  before = dtypes(state)
  losses = []
  for _ in range(25):
    state, metrics = step(state, classifier_batch())
    losses.append(float(metrics["loss"]))
  assert seen["update"] == ({np.dtype(jnp.float32)}, {np.dtype(jnp.float32)})
  assert seen["loss_fn"] == {np.dtype(BF16)}
  assert dtypes(state) == before  # dtypes, shapes and weak types are stable
  assert traces.count == 1  # one compilation
  assert int(state.params["count"]) == 4 and state.params["count"].dtype == jnp.int32
  assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("lean", LEAN, ids=LEAN_IDS)
def test_step_write_back_is_apply_updates(lean):
  """One step with sgd(1) equals jmp.apply_updates of -grads on the float32 view."""
  params, batch = make_params(), classifier_batch()
  state = jmp.TrainState.create(params=params, tx=optax.sgd(1.0), **lean)
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("p=f32,c=f32,o=f32"), donate=False)
  new_state, _ = step(state, batch)
  trained = {k: v for k, v in state.params.items() if k != "count"}
  kwargs = {}
  if lean["rounding"] == "stochastic":
    kwargs["key"] = jax.random.fold_in(lean["key"], 0)
  if lean["rounding"] == "kahan":
    kwargs["compensation"] = {k: state.compensation[k] for k in trained}

  @jax.jit
  def reference(trained, kwargs):
    grads = jax.grad(classifier_loss)(jax.tree.map(lambda p: p.astype(jnp.float32), trained), batch)
    updates = jax.tree.map(lambda g: -g, grads)
    return jmp.apply_updates(trained, updates, rounding=lean["rounding"], **kwargs)

  expected, comp = reference(trained, kwargs)
  for k in trained:
    got, want = as_f64(new_state.params[k]), as_f64(expected[k])
    # XLA may fuse the gradient differently from the eager reference: allow a
    # different rounding in a few elements, never more than an ulp.
    assert np.mean(got == want) > 0.95
    assert np.all(np.abs(got - want) <= ulp_bf16(want))
  if comp is not None:
    assert new_state.compensation["count"] is None


def test_nearest_bf16_masters_stall_where_stochastic_and_kahan_follow_float32():
  """The seed's failure: updates below half an ulp vanish with round-to-nearest."""
  def loss_fn(params, batch):
    return jnp.sum(params["w"] * batch["x"]).astype(jnp.float32)

  n, steps, lr = 4096, 100, 1e-4  # 1e-4 is 1/39 of half an ulp of 1.0 in bf16
  batch = {"x": jnp.ones(n)}
  results = {}
  for name, kw in [("f32", {})] + list(zip(LEAN_IDS, LEAN)):
    state = jmp.TrainState.create(params={"w": jnp.ones(n)}, tx=optax.sgd(lr), **kw)
    step = jmp.make_train_step(loss_fn, jmp.get_policy("p=f32,c=f32,o=f32"))
    for _ in range(steps):
      state, _ = step(state, batch)
    view = as_f64(state.params["w"])
    if state.compensation is not None:
      view = view + as_f64(state.compensation["w"])
    results[name] = view
  exact = 1.0 - steps * lr
  np.testing.assert_allclose(results["f32"], exact, atol=1e-5)
  assert np.all(results["nearest"] == 1.0)  # stalled: not one of 4096 weights moved
  # Kahan follows to within 1% of the drift (its bf16 compensation has 8 bits).
  np.testing.assert_allclose(results["kahan"], exact, atol=0.01 * steps * lr)
  # Unbiased: the mean over 4096 weights is within 5% of the drift (about 5
  # standard errors; the key is fixed, so the check is deterministic).
  assert abs(results["stochastic"].mean() - exact) < 0.05 * steps * lr


@pytest.mark.parametrize("lean", LEAN, ids=LEAN_IDS)
def test_skipped_step_is_exact(lean):
  schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
  inner = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(schedule))
  tx = jmp.dynamic_loss_scaling(inner, init_scale=2.0**10, growth_interval=100)
  state = jmp.TrainState.create(params=make_params(), tx=tx, **lean)
  traces = Traces()
  step = jmp.make_train_step(traces(classifier_loss), jmp.get_policy("mixed_bfloat16"))
  batch = classifier_batch()
  for _ in range(3):
    state, metrics = step(state, batch)
    assert bool(metrics["grads_finite"])
  if lean["rounding"] == "kahan":  # the compensation is live, so the skip has something to keep
    assert any(np.any(as_f64(c) != 0) for c in jax.tree.leaves(state.compensation))
    # Make the compensation exactly half an ulp where that would flip p under
    # a naive "round(p + c + (-0.0))": the skip must not touch it either.
    w = as_f64(state.params["w2"])
    half_ulp = jnp.asarray(np.sign(w) * ulp_bf16(w) / 2, BF16)
    state = state.replace(compensation={**state.compensation, "w2": half_ulp})
    naive = (state.params["w2"].astype(jnp.float32) + half_ulp.astype(jnp.float32)).astype(BF16)
    assert np.any(as_f64(naive) != w)
  before = host(state)
  bad = dict(batch, x=batch["x"].at[3, 2].set(jnp.nan))
  state, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])
  assert_bitwise_equal(state.params, before.params)
  assert_bitwise_equal(state.compensation, before.compensation)
  assert_bitwise_equal(state.opt_state.inner_state, before.opt_state.inner_state)
  if lean["rounding"] == "stochastic":  # the key never changes; the step counter moves on
    np.testing.assert_array_equal(jax.random.key_data(state.rounding_key),
                                  jax.random.key_data(lean["key"]))
  assert int(state.step) == 4
  state, metrics = step(state, batch)
  assert bool(metrics["grads_finite"])
  assert not np.array_equal(bits(state.params["w1"]), bits(before.params["w1"]))
  assert traces.count == 1


def test_stochastic_state_rounds_each_step_with_fresh_bits():
  """Two identical steps from the same values round differently: the stream moves with ``step``."""
  state = jmp.TrainState.create(params={"w": jnp.ones(4096)}, tx=optax.sgd(1.0), **LEAN[1])
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b), jmp.get_policy("f32"),
                             donate=False)
  x = jnp.full(4096, -2.0**-9)  # a quarter of an ulp upwards
  a, _ = step(state, x)
  b, _ = step(state.replace(step=jnp.int32(1)), x)
  assert 0.1 < float(jnp.mean(a.params["w"] > 1)) < 0.4
  assert not np.array_equal(bits(a.params["w"]), bits(b.params["w"]))


def test_create_copies_and_casts_every_floating_leaf():
  params = {"f64np": np.linspace(0, 1, 3), "f16": jnp.ones(2, jnp.float16), "py": 0.5,
            "f32": jnp.arange(3.0), "i": jnp.int32(2), "key": jax.random.key(0)}
  state = jmp.TrainState.create(params=params, tx=optax.adam(1e-3), **LEAN[2])
  assert {k: v.dtype for k, v in state.params.items()} == {
      "f64np": BF16, "f16": BF16, "py": BF16, "f32": BF16, "i": jnp.int32,
      "key": params["key"].dtype}
  assert state.params["f32"] is not params["f32"] and state.params["i"] is not params["i"]
  assert not state.params["py"].weak_type
  assert state.compensation["i"] is None and state.compensation["key"] is None
  assert {k: v.dtype for k, v in state.compensation.items() if v is not None} == {
      k: BF16 for k in ("f64np", "f16", "py", "f32")}
  # The state's key is a copy: donating the state never deletes the caller's key.
  key = jax.random.key(5)
  lean = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), master_dtype=BF16,
                               rounding="stochastic", key=key)
  assert lean.rounding_key is not key
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b), jmp.get_policy("f32"))
  step(lean, jnp.ones(2))
  assert not key.is_deleted() and lean.rounding_key.is_deleted()
  # A legacy uint32 key works too.
  legacy = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), master_dtype=BF16,
                                 rounding="stochastic", key=jax.random.PRNGKey(5))
  np.testing.assert_array_equal(jax.random.key_data(legacy.rounding_key), [0, 5])


def test_x64_float64_params_become_bf16_masters_and_compute_in_float32():
  with jax.enable_x64(True):
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), make_params())
    state = jmp.TrainState.create(params=params, tx=optax.adam(1e-2), **LEAN[1])
    assert {state.params[k].dtype for k in ("w1", "b1", "w2")} == {np.dtype(BF16)}
    adam = state.opt_state[0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {np.dtype(jnp.float32)}
    traces = Traces()
    step = jmp.make_train_step(traces(classifier_loss), jmp.get_policy("mixed_bfloat16"))
    before = dtypes(state)
    for _ in range(5):
      state, metrics = step(state, classifier_batch())
    assert dtypes(state) == before and traces.count == 1
    assert bool(metrics["grads_finite"])


def test_float32_masters_are_unchanged_by_the_new_fields():
  state = jmp.TrainState.create(params=make_params(), tx=optax.adam(1e-3))
  assert state.master_dtype == jnp.float32 and state.rounding == "nearest"
  assert state.compensation is None and state.rounding_key is None
  leaves = jax.tree.leaves(state)
  assert len(leaves) == len(jax.tree.leaves((state.step, state.params, state.opt_state)))


@pytest.fixture
def bench(monkeypatch):
  """``benchmarks.masters``, importable however pytest was started."""
  monkeypatch.syspath_prepend(str(ROOT))
  from benchmarks import masters as bench_masters

  return bench_masters


def test_benchmark_smoke_reports_bytes_per_parameter(bench, tmp_path, capsys):
  assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
  (path,) = tmp_path.glob("masters-*.json")
  payload = json.loads(path.read_text())
  rows = {r["name"]: r for r in payload["results"][0]["variants"]}
  assert list(rows) == ["fp32", "bf16_stochastic", "bf16_kahan"]
  # Adam's two float32 moments plus the masters: 4, 2 or 2 + 2 bytes per weight
  # (the step counters and the key add a few bytes in all).
  state = {k: r["state_bytes_per_param"] for k, r in rows.items()}
  assert state["fp32"] == pytest.approx(12.0, abs=0.01)
  assert state["bf16_stochastic"] == pytest.approx(10.0, abs=0.01)
  assert state["bf16_kahan"] == pytest.approx(12.0, abs=0.01)
  args = {k: r["argument_bytes_per_param"] for k, r in rows.items()}
  assert args["fp32"] - args["bf16_stochastic"] == pytest.approx(2.0, abs=0.01)
  assert {b["variant"] for b in payload["bars"]} == {"bf16_stochastic", "bf16_kahan"}
  assert "| bf16_kahan | bf16 kahan |" in path.with_suffix(".md").read_text()
  assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("sigma", [1.0, 1e-4])
def test_why_float16_masters_are_refused(sigma, bench):
  """The evidence behind refusing float16: its Kahan-compensated storage stalls on small weights.

  At scale 1, float16 (11 bits) tracks tiny updates better than bfloat16 (8
  bits); at scale 1e-4, with updates of 1e-8, everything float16 stores is
  subnormal and the updates vanish, while bfloat16 behaves as at scale 1.
  """
  rng = np.random.default_rng(0)
  w0 = rng.normal(0.0, sigma, 2000).astype(np.float32)
  u = (1e-4 * sigma * rng.uniform(0.5, 1.5, (1000, 2000)) * rng.choice([-1, 1], 2000))
  u = u.astype(np.float32)
  ref = w0.astype(np.float64) + u.astype(np.float64).sum(0)
  drift = np.sqrt(np.mean((ref - w0) ** 2))
  run = jax.jit(bench.accumulate, static_argnums=(0, 1))
  err = {dt: np.sqrt(np.mean((np.asarray(run(dt, "kahan", w0, u), np.float64) - ref) ** 2)) / drift
         for dt in ("float16", "bfloat16")}
  assert err["bfloat16"] < 0.05
  if sigma == 1.0:
    assert err["float16"] < err["bfloat16"]
  else:
    assert err["float16"] > 0.95  # a stall: the whole drift is lost


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(master_dtype=jnp.float16), ValueError,
         r"float16 is not supported.*scale.*subnormal.*master_dtype=jnp.bfloat16"),
        (dict(master_dtype=jnp.int32), ValueError, r"master_dtype must be one of \('float32', 'bfloat16'\).*int32"),
        (dict(master_dtype=jnp.float64), ValueError, r"master_dtype must be one of"),
        (dict(master_dtype="nonsense"), TypeError, r"master_dtype must be one of.*'nonsense'"),
        (dict(master_dtype=None), TypeError, r"master_dtype must be one of"),
        (dict(master_dtype=BF16, rounding="up"), ValueError,
         r"rounding must be one of \('nearest', 'stochastic', 'kahan'\), got 'up'"),
        (dict(master_dtype=BF16, rounding=1), TypeError, r"rounding must be one of"),
        (dict(rounding="stochastic", key=jax.random.key(0)), ValueError,
         r"rounding='stochastic' needs bfloat16 masters.*\('nearest', 'stochastic', 'kahan'\)"),
        (dict(rounding="kahan"), ValueError, r"rounding='kahan' needs bfloat16 masters"),
        (dict(master_dtype=BF16, rounding="stochastic"), ValueError,
         r"needs a PRNG key.*key=jax.random.key\(seed\)"),
        (dict(master_dtype=BF16, rounding="kahan", key=jax.random.key(0)), ValueError,
         r"key is only used with rounding='stochastic'"),
        (dict(master_dtype=BF16, rounding="stochastic", key=0), TypeError,
         r"key must be a JAX PRNG key.*got 0"),
        (dict(master_dtype=BF16, rounding="stochastic", key=jax.random.split(jax.random.key(0))),
         TypeError, r"key must be a JAX PRNG key.*\(2,\) keys"),
        (dict(master_dtype=BF16, rounding="stochastic", key=jnp.zeros(3, jnp.uint32)),
         TypeError, r"key must be a JAX PRNG key.*shape \(3,\) dtype uint32"),
    ],
)
def test_create_refuses_bad_master_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), **kwargs)


def test_apply_updates_refuses_bad_input():
  p = {"w": jnp.ones((2, 3), BF16), "b": jnp.ones(3, BF16)}
  u = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), p)
  with pytest.raises(ValueError, match=r"rounding must be one of \('nearest', 'stochastic', 'kahan'\), got 'sr'"):
    jmp.apply_updates(p, u, rounding="sr")
  with pytest.raises(ValueError, match=r"needs a PRNG key"):
    jmp.apply_updates(p, u, rounding="stochastic")
  with pytest.raises(ValueError, match=r"key is only used with rounding='stochastic', got rounding='nearest'"):
    jmp.apply_updates(p, u, key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"rounding='kahan' needs compensation"):
    jmp.apply_updates(p, u, rounding="kahan")
  with pytest.raises(ValueError, match=r"compensation is only used with rounding='kahan'"):
    jmp.apply_updates(p, u, compensation=p)
  with pytest.raises(ValueError, match=r"compensation must have the tree structure of params"):
    jmp.apply_updates(p, u, rounding="kahan", compensation={"w": jnp.zeros((2, 3), BF16)})
  with pytest.raises(ValueError, match=r"compensation at 'b' must be a bfloat16 array of the param's shape \[3\], got float32\[3\]"):
    jmp.apply_updates(p, u, rounding="kahan", compensation={**p, "b": jnp.zeros(3)})
  with pytest.raises(ValueError, match=r"compensation at 'w' .* got bfloat16\[3, 2\]"):
    jmp.apply_updates(p, u, rounding="kahan", compensation={**p, "w": jnp.zeros((3, 2), BF16)})
  with pytest.raises(ValueError, match=r"updates must have the tree structure of params"):
    jmp.apply_updates(p, {"w": u["w"]})
  with pytest.raises(TypeError, match=r"supports bfloat16 params only, but 'h' is float16"):
    jmp.apply_updates({"h": jnp.ones(2, jnp.float16)}, {"h": jnp.ones(2)}, rounding="stochastic",
                      key=jax.random.key(0))


def test_hand_built_states_are_refused_at_trace_time():
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"), donate=False)
  lean = jmp.TrainState.create(params=make_params(), tx=optax.sgd(0.1), **LEAN[2])
  f32_params = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == BF16 else x, lean.params)
  with pytest.raises(TypeError, match=r"bfloat16 master weights.*'b1' is float32.*master_dtype=jnp.bfloat16"):
    step(lean.replace(params=f32_params, compensation=None, rounding="nearest"), classifier_batch())
  with pytest.raises(ValueError, match=r"compensation must have the tree structure of params"):
    step(lean.replace(compensation={"w1": lean.compensation["w1"]}), classifier_batch())
  with pytest.raises(ValueError, match=r"state.rounding_key is missing"):
    step(lean.replace(rounding="stochastic", compensation=None), classifier_batch())
  with pytest.raises(ValueError, match=r"state.compensation is only used with rounding='kahan'"):
    step(lean.replace(rounding="nearest"), classifier_batch())
  with pytest.raises(ValueError, match=r"rounding must be one of"):
    step(lean.replace(rounding="Kahan"), classifier_batch())
  f32 = jmp.TrainState.create(params=make_params(), tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"rounding='kahan' needs bfloat16 masters"):
    step(f32.replace(rounding="kahan"), classifier_batch())

"""gradient_report, nonfinite_paths and the underflow example."""

import importlib
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import optax
import pytest

import jmp_lite as jmp

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_grad_report")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
F16_MAX = 65504.0


def hand_built():
  """2^-30 and -2^-30 flush in f16 at scale 1; 7e4 overflows f16."""
  return {
      "a": jnp.array([2.0**-30, 1.0, 0.0, -(2.0**-30)], jnp.float32),
      "b": {"c": jnp.array([[7e4, 3.0]], jnp.float32)},
      "n": jnp.arange(3),  # Not floating: ignored.
  }


def report_fn(maybe_jit, dtype):
  return maybe_jit(lambda g, s: jmp.gradient_report(g, dtype=dtype, loss_scale=s))


def test_exact_fractions_f16_scale_1(maybe_jit):
  r = report_fn(maybe_jit, jnp.float16)(hand_built(), 1.0)
  assert set(r.per_leaf) == {"a", "b/c"}
  a, c = r.per_leaf["a"], r.per_leaf["b/c"]
  # "a": 3 non-zero elements, 2 of them flush; "b/c": 2 non-zero, 7e4 overflows.
  assert float(a.underflow_fraction) == pytest.approx(2 / 3)
  assert float(a.overflow_fraction) == 0.0
  assert float(a.zero_fraction) == pytest.approx(1 / 4)
  assert float(a.max_abs) == 1.0
  assert float(c.underflow_fraction) == 0.0
  assert float(c.overflow_fraction) == pytest.approx(1 / 2)
  assert float(c.max_abs) == 7e4
  # Overall: denominators are the 5 non-zero elements.
  assert float(r.underflow_fraction) == pytest.approx(2 / 5)
  assert float(r.overflow_fraction) == pytest.approx(1 / 5)
  assert float(r.zero_fraction) == pytest.approx(1 / 6)
  assert float(r.max_abs) == 7e4
  assert r.underflow_fraction.dtype == jnp.float32
  assert r.dtype == np.dtype(jnp.float16)


def test_scale_2_pow_10_rescues_2_pow_minus_30(maybe_jit):
  r = report_fn(maybe_jit, jnp.float16)(hand_built(), jnp.float32(2.0**10))
  assert float(r.per_leaf["a"].underflow_fraction) == 0.0
  assert float(r.per_leaf["b/c"].overflow_fraction) == pytest.approx(1 / 2)  # 7e4 still does.
  assert float(r.loss_scale) == 2.0**10


def test_nothing_under_or_overflows_in_bf16(maybe_jit):
  for scale in (1.0, 2.0**10):
    r = report_fn(maybe_jit, jnp.bfloat16)(hand_built(), scale)
    assert float(r.underflow_fraction) == 0.0
    assert float(r.overflow_fraction) == 0.0
    assert all(float(s.underflow_fraction) == 0 and float(s.overflow_fraction) == 0
               for s in r.per_leaf.values())


def test_f16_threshold_is_half_the_smallest_subnormal(maybe_jit):
  # Round to nearest even: 2^-25 ties to 0, anything above it rounds to 2^-24.
  g = {"g": jnp.array([2.0**-25, 2.0**-25 * 1.5, 2.0**-24], jnp.float32)}
  r = report_fn(maybe_jit, jnp.float16)(g, 1.0)
  assert float(r.underflow_fraction) == pytest.approx(1 / 3)


def test_nonfinite_inputs_count_as_overflow_and_stay_out_of_the_histogram(maybe_jit):
  g = {"g": jnp.array([jnp.nan, jnp.inf, -1.0, 0.0, 2.0**-30], jnp.float32)}
  r = report_fn(maybe_jit, jnp.float16)(g, 1.0)
  assert float(r.overflow_fraction) == pytest.approx(2 / 4)
  assert float(r.underflow_fraction) == pytest.approx(1 / 4)
  assert float(r.max_abs) == 1.0  # The largest finite |g|.
  hist, edges = np.asarray(r.histogram), r.bin_edges
  assert hist.sum() == 2 and len(edges) == len(hist) + 1
  assert hist[list(edges).index(0)] == 1 and hist[list(edges).index(-30)] == 1


def test_histogram_bins_are_floor_log2(maybe_jit):
  g = {"x": jnp.array([1.0, 1.5, 1.999, 2.0, 0.75, 7e4], jnp.float32)}
  r = report_fn(maybe_jit, jnp.float16)(g, 1.0)
  hist, edges = np.asarray(r.histogram), list(r.bin_edges)
  assert hist[edges.index(0)] == 3 and hist[edges.index(1)] == 1
  assert hist[edges.index(-1)] == 1 and hist[edges.index(16)] == 1
  assert hist.sum() == 6 and r.histogram.dtype == jnp.int32


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("max_abs", [7e4, 1.0, 3.0, 2.0**-30, 123.456])
def test_suggested_scale_is_the_largest_power_of_two_with_headroom(maybe_jit, dtype, max_abs):
  g = {"w": jnp.array([max_abs, -max_abs / 3, 2.0**-30], jnp.float32)}
  r = report_fn(maybe_jit, dtype)(g, 1.0)
  s = float(r.suggested_loss_scale)
  fmax = float(jnp.finfo(dtype).max)
  assert np.log2(s) == int(np.log2(s))
  assert max_abs * s * 2 <= fmax
  assert s == 2.0**126 or fmax < max_abs * (2 * s) * 2  # Largest, up to the 2**126 clamp.
  at_s = jmp.gradient_report(g, dtype=dtype, loss_scale=s)
  assert float(at_s.overflow_fraction) == 0.0
  assert float(at_s.underflow_fraction) <= float(r.underflow_fraction)


def test_suggested_scale_for_7e4_in_f16():
  r = jmp.gradient_report({"g": jnp.array([7e4])})
  assert float(r.suggested_loss_scale) == 0.25


def test_all_zero_gradients():
  r = jmp.gradient_report({"g": jnp.zeros(3), "h": jnp.zeros((0,))})
  assert float(r.underflow_fraction) == 0.0 and float(r.overflow_fraction) == 0.0
  assert float(r.per_leaf["h"].zero_fraction) == 0.0
  assert float(r.zero_fraction) == 1.0
  assert float(r.suggested_loss_scale) == 2.0**126


def test_f16_gradient_leaves():
  g = {"g": jnp.array([2.0**-20, 1.0], jnp.float16)}
  r = jmp.gradient_report(g, loss_scale=2.0**-5)
  assert float(r.underflow_fraction) == pytest.approx(1 / 2)


@pytest.mark.parametrize("grads", [{}, {"n": jnp.arange(3)}, None, [None]])
def test_no_floating_leaf_is_a_value_error(grads):
  with pytest.raises(ValueError, match="floating"):
    jmp.gradient_report(grads)


def test_bad_dtype():
  with pytest.raises(TypeError, match="int32"):
    jmp.gradient_report({"g": jnp.ones(2)}, dtype=jnp.int32)


def test_report_is_a_pytree_with_static_names():
  r = jax.jit(jmp.gradient_report)(hand_built())
  leaves, treedef = jax.tree.flatten(r)
  assert all(isinstance(x, jax.Array) for x in leaves)
  again = jax.tree.unflatten(treedef, leaves)
  assert isinstance(again, jmp.GradientReport) and again.dtype == r.dtype
  assert set(again.per_leaf) == {"a", "b/c"}
  assert isinstance(again.per_leaf["a"], jmp.LeafStats)


def test_plot_writes_a_real_png(tmp_path):
  path = tmp_path / "hist.png"
  jmp.gradient_report(hand_built(), loss_scale=2.0**10).plot(path)
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
  assert image.shape[2] in (3, 4)
  assert image[..., :3].std() > 0.05  # Not a blank canvas.


def test_plot_into_axes():
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots()
  try:
    out = jmp.gradient_report(hand_built()).plot(ax=ax)
    assert out is fig
    assert "underflow 40.0%" in ax.get_title() and "overflow 20.0%" in ax.get_title()
  finally:
    plt.close(fig)


def test_plot_without_matplotlib(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match=r"examples"):
    jmp.gradient_report(hand_built()).plot(tmp_path / "x.png")


def test_summary_lists_the_worst_leaves_first():
  text = jmp.gradient_report(hand_built()).summary()
  lines = text.splitlines()
  assert "underflow 40.00%" in lines[0] and "overflow 20.00%" in lines[0]
  assert "suggested loss scale 2^-2" in lines[1]
  assert lines[2].split() == ["leaf", "underflow", "overflow", "zero", "max|g|"]
  assert lines[3].split()[:3] == ["b/c", "0.00%", "50.00%"]  # Overflow ranks first.
  assert lines[4].split()[:3] == ["a", "66.67%", "0.00%"]
  top1 = jmp.gradient_report(hand_built()).summary(top=1).splitlines()
  assert top1[-1] == "... 1 more leaves" and len(top1) == 5
  with pytest.raises(ValueError, match="top"):
    jmp.gradient_report(hand_built()).summary(top=0)


# --- nonfinite_paths --------------------------------------------------------


def test_nonfinite_paths_through_the_train_step():
  def loss_fn(params, batch):
    p = params["params"]
    # sqrt'(0) = inf: only "params/Dense_1/kernel" gets a non-finite gradient.
    return jnp.sum(p["Dense_0"]["kernel"] * batch) + jnp.sum(jnp.sqrt(p["Dense_1"]["kernel"]))

  params = {"params": {"Dense_0": {"kernel": jnp.ones(3)},
                       "Dense_1": {"kernel": jnp.array([0.0, 1.0])},
                       "count": jnp.int32(0)}}
  tx = jmp.static_loss_scaling(optax.sgd(0.1), 1.0)
  state = jmp.TrainState.create(params=params, tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), track_nonfinite=True, donate=False)
  _, metrics = step(state, jnp.array([1.0, 2.0, 3.0]))
  assert not bool(metrics["grads_finite"])
  assert jmp.nonfinite_paths(metrics["nonfinite"]) == ["params/Dense_1/kernel"]
  state = state.replace(params={**params, "params": {**params["params"],
                                                    "Dense_1": {"kernel": jnp.ones(2)}}})
  _, metrics = step(jmp.TrainState.create(params=state.params, tx=tx), jnp.ones(3))
  assert jmp.nonfinite_paths(metrics["nonfinite"]) == []


def test_nonfinite_paths_rejects_non_bool():
  assert jmp.nonfinite_paths({"a": np.array([False, True]), "b": False}) == ["a"]
  with pytest.raises(TypeError, match="'a'"):
    jmp.nonfinite_paths({"a": jnp.ones(2)})


# --- the underflow example --------------------------------------------------


@pytest.fixture(scope="module")
def underflow(request):
  sys.path.insert(0, str(EXAMPLES))
  request.addfinalizer(lambda: sys.path.remove(str(EXAMPLES)))
  return importlib.import_module("underflow")


def test_underflow_rescue(underflow):
  data = underflow.make_data()
  plain = underflow.train("f16, no scaling", data, steps=100, chunk=100)
  dynamic = underflow.train("f16, dynamic", data, steps=100, chunk=100)
  assert plain.losses[0] == dynamic.losses[0]  # The same start.
  # Without scaling every f16 gradient is zero and the loss stays put.
  assert plain.zero_first > 0.95 and plain.zero_last > 0.95
  assert plain.losses[-20:].mean() > 0.8 * plain.losses[0]
  # With dynamic scaling it trains.
  assert dynamic.zero_first < 0.75  # Only the zero-initialised layer's inputs.
  assert dynamic.losses[-20:].mean() < 0.2 * dynamic.losses[0]
  assert dynamic.final_scale >= 2.0**15 and dynamic.skipped == 0


@pytest.mark.slow
def test_underflow_example_smoke():
  proc = subprocess.run([sys.executable, str(EXAMPLES / "underflow.py"), "--smoke"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "f16, no scaling" in proc.stdout and "f16, dynamic" in proc.stdout
  assert "digits CNN" in proc.stdout and "output features 10" in proc.stdout


# --- issue 11: colliding paths, float8, complex, bad arguments ----------------


def test_colliding_joined_paths_stay_separate_leaves():
  grads = {"x": {"0": jnp.array([1.0, 2.0])}, "x/0": jnp.array([jnp.nan, 1.0])}
  report = jmp.gradient_report(grads)
  assert set(report.per_leaf) == {"['x']['0']", "['x/0']"}
  assert float(report.per_leaf["['x/0']"].overflow_fraction) == 0.5
  assert float(report.per_leaf["['x']['0']"].overflow_fraction) == 0.0
  assert float(report.overflow_fraction) == 0.25
  assert jmp.nonfinite_paths({"x": {"0": True}, "x/0": False}) == ["['x']['0']"]


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_float8_and_complex_leaves(promotion):
  grads = {"f8": jnp.array([1.0, 2.0**-12], jnp.float8_e4m3fn),
           "c": jnp.array([1 + 2j, 0j], jnp.complex64)}
  with jax.numpy_dtype_promotion(promotion):
    report = jmp.gradient_report(grads)
  # f8: 2^-12 survives f16 (normal min 2^-14); complex: parts 1, 2, 0, 0.
  assert float(report.per_leaf["f8"].underflow_fraction) == 0.0
  assert float(report.per_leaf["c"].zero_fraction) == 0.5
  assert float(report.max_abs) == 2.0


@pytest.mark.parametrize("scale,exc,match", [
    (jnp.ones(2), ValueError, r"loss_scale must be a scalar, got shape \(2,\)"),
    (0.0, ValueError, r"loss_scale must be finite and > 0, got 0\.0"),
    (-1.0, ValueError, r"loss_scale must be finite and > 0, got -1\.0"),
    (-1, ValueError, r"loss_scale must be finite and > 0, got -1$"),
    (float("inf"), ValueError, r"loss_scale must be finite and > 0, got inf"),
    (float("nan"), ValueError, r"loss_scale must be finite and > 0, got nan"),
    (jnp.float32(0.0), ValueError, r"loss_scale must be finite and > 0, got Array\(0\., dtype=float32\)"),
    ("8", TypeError, r"loss_scale must be a real number, got '8'"),
])
def test_bad_loss_scale(scale, exc, match):
  with pytest.raises(exc, match=match):
    jmp.gradient_report({"w": jnp.ones(2)}, loss_scale=scale)


def test_summary_top_must_be_an_int():
  report = jmp.gradient_report({"w": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"top must be an int >= 1, got '3'"):
    report.summary(top="3")
  with pytest.raises(ValueError, match=r"top must be an int >= 1, got 0"):
    report.summary(top=0)


def test_nonfinite_paths_names_the_leaves_of_an_overflowing_norm():
  # Every leaf is finite, and so is each leaf's own sum of squares (2.25e38), but
  # their total overflows float32: the step is skipped, and the report names
  # the leaves that made it overflow.
  def loss_fn(params, batch):
    return jnp.sum(params["a"] * batch["x"]) + jnp.sum(params["b"] * batch["x"]) + params["c"][0]

  params = {"a": jnp.zeros(1), "b": jnp.zeros(1), "c": jnp.zeros(1)}
  state = jmp.TrainState.create(params=params, tx=optax.sgd(1.0))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), track_nonfinite=True)
  state, metrics = step(state, {"x": jnp.full(1, 1.5e19)})
  assert not bool(metrics["grads_finite"])
  assert jmp.nonfinite_paths(metrics["nonfinite"]) == ["a", "b"]


# ------------------------------------------- bad input: messages name the value and what is allowed


@pytest.mark.parametrize("tree", [{}, None, [], {"n": jnp.arange(3)}, (1, 2)],
                         ids=["dict", "None", "list", "ints-only", "python-ints"])
def test_gradient_report_on_an_empty_tree(tree):
  with pytest.raises(ValueError, match=r"gradient_report needs a pytree with floating array leaves, got"):
    jmp.gradient_report(tree)


# --- issue 22 (hardening, round 3) -------------------------------------------


def test_float64_max_abs_is_kept_and_an_overflow_is_never_grown_into():
  """Item 3: max_abs lives in the leaves' own wide dtype; a float32 max_abs was inf."""
  with jax.enable_x64(True):
    r = jmp.gradient_report({"w": jnp.array([1e300, 1.0], jnp.float64)})  # float16 at scale 1
    assert float(r.overflow_fraction) == 0.5
    assert r.max_abs.dtype == jnp.float64 and float(r.max_abs) == 1e300
    assert float(r.per_leaf["w"].max_abs) == 1e300
    # 1e300 overflows float16 at every float32 scale: the smallest one, not 2^14.
    assert float(r.suggested_loss_scale) == 2.0**-126
    r32 = jmp.gradient_report({"w": jnp.array([1e39, 1.0], jnp.float64)}, dtype=jnp.float32)
    assert float(r32.max_abs) == 1e39 and float(r32.overflow_fraction) == 0.5
    assert float(r32.suggested_loss_scale) == 0.125  # 1e39 * 0.125 * 2 <= 3.4e38 < 1e39 * 0.5
    at_s = jmp.gradient_report({"w": jnp.array([1e39, 1.0], jnp.float64)}, dtype=jnp.float32,
                               loss_scale=0.125)
    assert float(at_s.overflow_fraction) == 0.0


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_a_suggestion_never_grows_a_scale_that_overflows(maybe_jit, bad, dtype):
  """Finite values that fit would suggest more; a non-finite element caps it at loss_scale / 2."""
  g = {"w": jnp.array([bad, 1.0, 2.0**-20], jnp.float32)}
  r = report_fn(maybe_jit, dtype)(g, 2.0**4)
  assert float(r.overflow_fraction) == pytest.approx(1 / 3)
  assert float(r.suggested_loss_scale) == 2.0**3
  # Without the bad element the same values suggest growing.
  clean = report_fn(maybe_jit, dtype)({"w": g["w"][1:]}, 2.0**4)
  assert float(clean.overflow_fraction) == 0.0 and float(clean.suggested_loss_scale) > 2.0**4


def test_the_largest_suggestion_is_the_largest_usable_scale():
  """2**126, as for the scalers: 1 / 2**127 flushes to 0 (item 2)."""
  assert float(jmp.gradient_report({"g": jnp.zeros(3)}).suggested_loss_scale) == 2.0**126
  r = jmp.gradient_report({"g": jnp.array([2.0**-100])}, dtype=jnp.float32)
  assert float(r.suggested_loss_scale) == 2.0**126

"""jmp-compatible loss scales, all_finite and select_tree (issue 2)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jmp_lite


# ---------------------------------------------------------------- NoOp / Static


def test_noop_and_static_have_no_leaves():
  for ls in (jmp_lite.NoOpLossScale(), jmp_lite.StaticLossScale(2.0**10)):
    leaves, treedef = jax.tree.flatten(ls)
    assert leaves == []
    assert jax.tree.unflatten(treedef, []) == ls


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_static_matches_jmp(dtype, maybe_jit):
  tree = {"g": jnp.array([0.5, -3.0], dtype), "n": jnp.int32(3)}
  # A Python-number scale keeps each leaf's dtype (jmp's weak typing); an
  # array scale promotes like jmp's x * loss_scale.
  for ours, theirs in [
      (jmp_lite.StaticLossScale(128.0), jmp.StaticLossScale(128.0)),
      (jmp_lite.StaticLossScale(jnp.float32(128.0)), jmp.StaticLossScale(jnp.float32(128.0))),
  ]:
    scaled = maybe_jit(ours.scale)(tree)
    expected = theirs.scale(tree["g"])
    assert scaled["g"].dtype == expected.dtype
    np.testing.assert_array_equal(scaled["g"], expected)
    assert scaled["n"] is tree["n"] or int(scaled["n"]) == 3
    unscaled = maybe_jit(ours.unscale)(scaled)["g"]
    assert unscaled.dtype == theirs.unscale(expected).dtype
    np.testing.assert_array_equal(unscaled, theirs.unscale(expected))
  ours = jmp_lite.StaticLossScale(128.0)
  assert float(ours.loss_scale) == 128.0 and ours.adjust(jnp.array(False)) is ours


def test_noop():
  ls = jmp_lite.NoOpLossScale()
  x = {"a": jnp.ones(2, jnp.float16)}
  assert ls.scale(x) is x and ls.unscale(x) is x and ls.adjust(False) is ls
  assert float(ls.loss_scale) == 1.0


# ---------------------------------------------------------------- Dynamic


def test_dynamic_leaves_are_the_arrays():
  ls = jmp_lite.DynamicLossScale(2.0**15, counter=3, period=7, factor=4, min_loss_scale=0.25)
  leaves = jax.tree.leaves(ls)
  assert len(leaves) == 3
  assert ls.loss_scale.dtype == jnp.float32 and not ls.loss_scale.weak_type
  assert ls.counter.dtype == jnp.int32
  mapped = jax.tree.map(lambda x: x, ls)
  assert mapped.period == 7 and mapped.factor == 4 and float(mapped.min_loss_scale) == 0.25


def test_min_loss_scale_survives_jit(maybe_jit):
  ls = jmp_lite.DynamicLossScale(jnp.float32(8.0), period=5, min_loss_scale=jnp.float32(4.0))
  for _ in range(3):
    ls = maybe_jit(lambda s: s.adjust(jnp.array(False)))(ls)
  assert float(ls.min_loss_scale) == 4.0
  assert float(ls.loss_scale) == 4.0  # Floored, not 1.0 as jmp gives after a jitted adjust.
  assert ls.period == 5


def test_eval_shape_and_aot_compile():
  ls = jmp_lite.DynamicLossScale(jnp.float32(2.0**15), period=3)
  f = lambda s, finite: s.adjust(finite)
  shapes = jax.eval_shape(f, ls, jnp.array(True))
  assert shapes.loss_scale.shape == () and shapes.loss_scale.dtype == jnp.float32
  compiled = jax.jit(f).lower(ls, jnp.array(True)).compile()
  out = compiled(ls, jnp.array(True))
  assert int(out.counter) == 1
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ls)
  from_abstract = jax.jit(f).lower(abstract, jax.ShapeDtypeStruct((), jnp.bool_)).compile()
  grown = from_abstract(dataclasses.replace(ls, counter=jnp.int32(2)), jnp.array(True))
  assert (float(grown.loss_scale), int(grown.counter)) == (2.0**16, 0)
  assert float(grown.min_loss_scale) == 1.0 and grown.period == 3


def test_float16_loss_scale_adjusts_without_crash_or_inf(maybe_jit):
  ls = jmp_lite.DynamicLossScale(jnp.float16(2.0**15), period=1)
  ls = maybe_jit(lambda s: s.adjust(jnp.array(True)))(ls)
  assert ls.loss_scale.dtype == jnp.float16
  assert float(ls.loss_scale) == 2.0**15  # 2**16 is inf in f16: growth is refused.
  ls = maybe_jit(lambda s: s.adjust(jnp.array(False)))(ls)
  assert float(ls.loss_scale) == 2.0**14
  with jax.numpy_dtype_promotion("strict"):
    assert ls.adjust(jnp.array(True)).loss_scale.dtype == jnp.float16


def test_growth_stops_at_2_to_the_126(maybe_jit):
  """Issue 22 item 2: jmp grows to 2**127, whose reciprocal XLA flushes to 0."""
  adjust = maybe_jit(lambda s: s.adjust(jnp.array(True)))
  for start in (2.0**125, 1.5 * 2.0**125, 2.0**126):  # 1.5 * 2**126 would be finite: clipped.
    ls = jmp_lite.DynamicLossScale(jnp.float32(start), period=1)
    scales = []
    for _ in range(3):
      ls = adjust(ls)
      scales.append(float(ls.loss_scale))
    assert scales == [2.0**126] * 3, start
  grads = {"w": jnp.array([0.5, -3.0, 1e-3], jnp.float32)}
  np.testing.assert_array_equal(maybe_jit(ls.unscale)(ls.scale(grads))["w"], grads["w"])
  # A growth that overflows to inf still keeps the scale, as jmp's does.
  ls = jmp_lite.DynamicLossScale(jnp.float32(2.0**120), period=1, factor=2.0**10)
  assert float(adjust(ls).loss_scale) == 2.0**120


@pytest.mark.parametrize("finites", [[True] * 5 + [False] + [True] * 4, [False] * 3 + [True] * 6])
def test_dynamic_matches_jmp(finites, maybe_jit):
  ours = jmp_lite.DynamicLossScale(jnp.float32(2.0**4), period=2, factor=2)
  theirs = jmp.DynamicLossScale(jnp.float32(2.0**4), period=2, factor=2)
  adjust = maybe_jit(lambda s, f: s.adjust(f))
  for finite in finites:
    ours, theirs = adjust(ours, jnp.array(finite)), theirs.adjust(jnp.array(finite))
    assert float(ours.loss_scale) == float(theirs.loss_scale)
    assert int(ours.counter) == int(theirs.counter)
  grads = {"w": jnp.array([3.0, -1.0], jnp.float16)}
  np.testing.assert_array_equal(ours.unscale(ours.scale(grads))["w"], theirs.unscale(theirs.scale(grads["w"])))


def test_dynamic_is_frozen_dataclass():
  ls = jmp_lite.DynamicLossScale(2.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    ls.counter = 1  # type: ignore[misc]


# ---------------------------------------------------------------- all_finite / select_tree


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("make", [np.asarray, jnp.asarray], ids=["np", "jnp"])
def test_all_finite(dtype, make, maybe_jit):
  good = {"a": make(np.ones(3), dtype=dtype), "i": jnp.arange(3), "k": jax.random.key(0)}
  out = maybe_jit(jmp_lite.all_finite)(good)
  assert out.shape == () and out.dtype == jnp.bool_ and bool(out)
  for bad_value in (np.inf, -np.inf, np.nan):
    bad = dict(good, b=make(np.array([1.0, bad_value]), dtype=dtype))
    assert not bool(maybe_jit(jmp_lite.all_finite)(bad))


def test_all_finite_empty():
  for tree in (None, {}, [], {"i": jnp.arange(2)}):
    out = jmp_lite.all_finite(tree)
    assert out.shape == () and bool(out)


def test_select_tree(maybe_jit):
  a = {"x": jnp.ones(2), "i": jnp.int32(1)}
  b = {"x": jnp.zeros(2), "i": jnp.int32(2)}
  select = maybe_jit(jmp_lite.select_tree)
  assert int(select(jnp.array(True), a, b)["i"]) == 1
  np.testing.assert_array_equal(select(jnp.array(False), a, b)["x"], b["x"])
  assert int(jmp_lite.select_tree(True, a, b)["i"]) == 1


# ---------------------------------------------------------------- issue 11 (hardening, round 2)


def test_complex_leaves_are_checked_scaled_and_unscaled(maybe_jit):
  z = jnp.array([1 + 2j, -3j], jnp.complex64)
  assert not bool(maybe_jit(jmp_lite.all_finite)({"z": z.at[1].set(complex(0, jnp.nan))}))
  assert not bool(jmp_lite.all_finite({"z": z.at[0].set(complex(jnp.inf, 0))}))
  assert bool(jmp_lite.all_finite({"z": z}))
  for ls in (jmp_lite.DynamicLossScale(jnp.float32(4.0)), jmp_lite.StaticLossScale(4.0),
             jmp_lite.StaticLossScale(jnp.float32(4.0))):
    scaled = maybe_jit(ls.scale)({"z": z})["z"]
    assert scaled.dtype == jnp.complex64
    np.testing.assert_array_equal(scaled, 4 * z)
    np.testing.assert_array_equal(maybe_jit(ls.unscale)({"z": scaled})["z"], z)


@pytest.mark.parametrize("promotion", ["standard", "strict"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_scale_and_unscale_half_and_float8_leaves(promotion, dtype):
  tree = {"g": jnp.array([0.5, -2.0], dtype)}
  for ls, expected_dtype in [
      (jmp_lite.StaticLossScale(8.0), dtype),  # A Python scale keeps the leaf dtype.
      (jmp_lite.StaticLossScale(jnp.float32(8.0)), jnp.float32),
      (jmp_lite.DynamicLossScale(jnp.float32(8.0)), jnp.float32),
  ]:
    with jax.numpy_dtype_promotion(promotion):
      scaled = ls.scale(tree)["g"]
      unscaled = ls.unscale({"g": scaled})["g"]
    assert scaled.dtype == unscaled.dtype == expected_dtype
    np.testing.assert_array_equal(scaled.astype(jnp.float32), [4.0, -16.0])
    np.testing.assert_array_equal(unscaled.astype(jnp.float32), [0.5, -2.0])


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(loss_scale=float("inf")), ValueError, r"loss_scale must be finite and > 0, got inf"),
    (dict(loss_scale=float("nan")), ValueError, r"loss_scale must be finite and > 0, got nan"),
    (dict(loss_scale=np.float32(-2.0)), ValueError, r"loss_scale must be finite and > 0, got np\.float32\(-2\.0\)"),
    (dict(loss_scale=True), TypeError, r"loss_scale must be a real number, got True"),
    (dict(loss_scale=2.0, min_loss_scale=float("nan")), ValueError,
     r"min_loss_scale must be finite and >= 0, got nan"),
    (dict(loss_scale=2.0, period=2.5), TypeError, r"period must be an int >= 1, got 2\.5"),
    (dict(loss_scale=2.0, factor=np.float32(0.5)), ValueError,
     r"factor must be finite and > 1, got np.float32\(0\.5\)"),
    (dict(loss_scale=2.0, factor="2"), TypeError, r"factor must be a real number, got '2'"),
    (dict(loss_scale=2.0, counter=-1), ValueError, r"counter must be an int >= 0, got -1"),
    (dict(loss_scale=jnp.float32(2.0**15), period=0), ValueError, r"period must be an int >= 1, got 0"),
    (dict(loss_scale=jnp.float32(2.0**15), factor=1), ValueError, r"factor must be finite and > 1, got 1"),
    (dict(loss_scale=jnp.float32(2.0**15), factor=0.5), ValueError, r"factor must be finite and > 1, got 0\.5"),
])
def test_dynamic_rejects_bad_python_values(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    jmp_lite.DynamicLossScale(**kwargs)


def test_dynamic_int_scale_warns_like_jmp_and_then_works():
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int32"):
    ls = jmp_lite.DynamicLossScale(jnp.asarray(4, jnp.int32), period=1)
  assert ls.loss_scale.dtype == jnp.float32
  ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
  assert float(ls.loss_scale) == 8.0


@pytest.mark.parametrize("counter", [3, 5, 7])
def test_counter_at_or_past_period_follows_jmp(counter):
  ours = jmp_lite.DynamicLossScale(jnp.float32(8.0), jnp.int32(counter), period=3)
  theirs = jmp.DynamicLossScale(jnp.float32(8.0), jnp.int32(counter), period=3)
  for _ in range(7):
    ours, theirs = ours.adjust(jnp.array(True)), theirs.adjust(jnp.array(True))
    assert (float(ours.loss_scale), int(ours.counter)) == (
        float(theirs.loss_scale), int(theirs.counter))
  assert float(ours.loss_scale) > 8.0  # It grew, as jmp's does.


@pytest.mark.parametrize("a,b,match", [
    ({"x": jnp.ones(2, jnp.float16)}, {"x": jnp.ones(2, jnp.float32)},
     r"leaf 'x' differs.*dtype float16 vs shape \(2,\) dtype float32"),
    ({"y": jnp.ones((1, 8))}, {"y": jnp.ones(8)}, r"leaf 'y' differs.*shape \(1, 8\).*\(8,\)"),
])
def test_select_tree_neither_broadcasts_nor_promotes(a, b, match):
  with pytest.raises(TypeError, match=match):
    jmp_lite.select_tree(jnp.array(True), a, b)


def test_static_from_a_traced_value_like_jmp():
  @jax.jit
  def f(scale, x):
    ls = jmp_lite.StaticLossScale(scale)
    return ls.unscale(ls.scale(x) + 1.0)

  np.testing.assert_allclose(f(jnp.float32(4.0), jnp.float32(2.0)), 2.25)


# ------------------------------------------- bad input: messages name the value and what is allowed


@pytest.mark.parametrize("value,exc,match", [
    (0.0, ValueError, r"loss_scale must be finite and > 0, got 0\.0"),
    (0, ValueError, r"loss_scale must be finite and > 0, got 0$"),
    (-1.0, ValueError, r"loss_scale must be finite and > 0, got -1\.0"),
    (math.inf, ValueError, r"loss_scale must be finite and > 0, got inf"),
    (math.nan, ValueError, r"loss_scale must be finite and > 0, got nan"),
    (True, TypeError, r"loss_scale must be a real number, got True"),
    ("4", TypeError, r"loss_scale must be a real number, got '4'"),
])
def test_static_rejects_bad_scale(value, exc, match):
  with pytest.raises(exc, match=match):
    jmp_lite.StaticLossScale(value)


@pytest.mark.parametrize("pred,exc,match", [
    (jnp.array([True, False]), ValueError, r"pred must be a scalar, got shape \(2,\)"),
    (jnp.float32(1.0), TypeError, r"pred must be a bool, got dtype float32"),
    (1, TypeError, r"pred must be a bool, got dtype int32"),
], ids=["vector", "float32", "python-int"])
def test_select_tree_rejects_bad_pred(pred, exc, match):
  a = {"x": jnp.ones(2)}
  with pytest.raises(exc, match=match):
    jmp_lite.select_tree(pred, a, a)


# ---------------------------------------------------------------- issue 22 (hardening, round 3)


BAD_CONCRETE = [np.inf, -np.inf, np.nan, 0.0, -2.0]


@pytest.mark.parametrize("make", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("value", BAD_CONCRETE, ids=str)
def test_concrete_jax_scales_are_checked(value, make):
  """Item 11: a concrete jax array is as checkable as a NumPy number."""
  match = r"loss_scale must be finite and > 0, got Array\("
  with pytest.raises(ValueError, match=match):
    jmp_lite.DynamicLossScale(make(value))
  with pytest.raises(ValueError, match=match):
    jmp_lite.StaticLossScale(make(value))
  if value != 0.0:
    with pytest.raises(ValueError, match=r"min_loss_scale must be finite and >= 0, got Array\("):
      jmp_lite.DynamicLossScale(jnp.float32(2.0), min_loss_scale=make(value))
  with pytest.raises(ValueError, match=r"counter must be an int >= 0, got Array\(-1"):
    jmp_lite.DynamicLossScale(jnp.float32(2.0), counter=jnp.int32(-1))


@pytest.mark.parametrize("value", [2.0**127, 2.0**-127, np.float32(2.0**127)], ids=str)
def test_scales_whose_reciprocal_is_not_normal_are_refused(value):
  """Item 2: 1 / 2**127 is a float32 subnormal, which XLA flushes to 0."""
  match = r"loss_scale must be in \[2\*\*-126, 2\*\*126\].*so that 1/loss_scale is a normal float32"
  for make in (lambda v: v, jnp.float32):
    with pytest.raises(ValueError, match=match):
      jmp_lite.DynamicLossScale(make(value))
    with pytest.raises(ValueError, match=match):
      jmp_lite.StaticLossScale(make(value))
  with pytest.raises(ValueError, match=r"min_loss_scale must be at most 2\*\*126"):
    jmp_lite.DynamicLossScale(2.0, min_loss_scale=2.0**127)


def test_traced_scales_are_not_checked_and_rebuilds_are_not_validated():
  """Only tracers skip the check; pytree rebuilds (jit outputs, tree maps) are not constructions."""
  inf = jnp.float32(np.inf)
  assert np.isinf(float(jax.jit(lambda s: jmp_lite.DynamicLossScale(s).loss_scale)(inf)))
  assert np.isinf(float(jax.jit(lambda s: jmp_lite.StaticLossScale(s).scale(s))(inf)))
  ls = jmp_lite.DynamicLossScale(jnp.float32(8.0), counter=jnp.int32(3), period=5,
                                 min_loss_scale=jnp.float32(0.5))
  zeros = jax.tree.map(jnp.zeros_like, ls)  # Not a ValueError: a rebuild is not a construction.
  assert float(zeros.loss_scale) == 0.0 and zeros.period == 5
  same = jax.tree.unflatten(jax.tree.structure(ls), jax.tree.leaves(ls))
  assert [float(x) for x in jax.tree.leaves(same)] == [8.0, 3.0, 0.5]
  assert jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(ls)[0][2][0]) == ".min_loss_scale"
  # adjust does not re-validate either: with a floor of 0 the scale may underflow to 0
  # (a configuration jmp allows), eagerly as under jit.
  tiny = jmp_lite.DynamicLossScale(jnp.float32(2.0**-126), factor=2.0**10, min_loss_scale=0.0)
  assert float(tiny.adjust(jnp.array(False)).loss_scale) == 0.0

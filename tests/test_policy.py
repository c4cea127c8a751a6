"""Policies, policy strings and pytree casting (issue 2)."""

import dataclasses
import re
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict

from conftest import Traces
import jmp_lite

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
HALF = jmp_lite.half_dtype()


# ---------------------------------------------------------------- Policy


@pytest.mark.parametrize("dtype", [np.float16, jnp.float16, jnp.dtype("float16"), "float16"])
def test_dtypes_are_normalised(dtype):
  p = jmp_lite.Policy(jnp.float32, dtype, jnp.float32)
  assert p.compute_dtype == F16 and isinstance(p.compute_dtype, np.dtype)
  assert p == jmp_lite.Policy(np.float32, np.float16, "float32")
  assert hash(p) == hash(jmp_lite.Policy(np.float32, np.float16, "float32"))


@pytest.mark.parametrize("bad", [jnp.int32, np.bool_, "int8", jnp.uint8, jnp.complex64, "not-a-dtype"])
def test_non_floating_dtype_is_rejected(bad):
  with pytest.raises(TypeError, match="floating dtype"):
    jmp_lite.Policy(jnp.float32, bad, jnp.float32)


def test_policy_is_frozen_and_a_static_jit_argument():
  p = jmp_lite.get_policy("p=f32,c=bf16,o=f32")
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.compute_dtype = F16  # type: ignore[misc]
  traces = Traces()
  f = jax.jit(traces(lambda x, policy: policy.cast_to_compute(x)), static_argnums=1)
  assert f(jnp.ones(2), p).dtype == BF16
  assert f(jnp.ones(2), jmp_lite.get_policy("p=f32,c=bf16,o=f32")).dtype == BF16
  assert traces.count == 1  # Equal policies hit the same cache entry.


def test_with_methods():
  p = jmp_lite.get_policy("f32")
  assert p.with_param_dtype(jnp.bfloat16).param_dtype == BF16
  assert p.with_compute_dtype(np.float16).compute_dtype == F16
  assert p.with_output_dtype(jnp.bfloat16).output_dtype == BF16
  assert p.param_dtype == p.compute_dtype == p.output_dtype == F32  # Unchanged.
  with pytest.raises(TypeError, match="compute_dtype"):
    p.with_compute_dtype(jnp.int8)


# ---------------------------------------------------------------- get_policy


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", (F32, F32, F32)),
        ("full", (F32, F32, F32)),
        ("bf16", (BF16, BF16, BF16)),
        ("BFloat16", (BF16, BF16, BF16)),
        ("half", (HALF, HALF, HALF)),
        ("f64", (F64, F64, F64)),
        ("p=f32,c=f16,o=f32", (F32, F16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("c=bf16", (F32, BF16, BF16)),
        ("p=f16", (F16, F16, F16)),
        ("p=f32, c=half", (F32, HALF, HALF)),
        ("o=f16", (F32, F32, F16)),
        ("c=f16,o=f32", (F32, F16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
    ],
)
def test_get_policy_grammar(name, expected):
  p = jmp_lite.get_policy(name)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


@pytest.mark.parametrize(
    "name",
    ["f32", "bf16", "f16", "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32", "c=bf16", "o=f16", "half"],
)
def test_same_policy_as_jmp(name):
  ours, theirs = jmp_lite.get_policy(name), jmp.get_policy(name)
  assert ours.param_dtype == theirs.param_dtype
  assert ours.compute_dtype == theirs.compute_dtype
  assert ours.output_dtype == theirs.output_dtype


@pytest.mark.parametrize(
    "p", [jmp_lite.Policy(a, b, c) for a in (F32, BF16) for b in (F16, BF16, F32) for c in (F32, F16)]
)
def test_str_round_trips(p):
  assert jmp_lite.get_policy(str(p)) == p


def test_str_format():
  assert str(jmp_lite.get_policy("mixed_bfloat16")) == "p=f32,c=bf16,o=f32"


@pytest.mark.parametrize(
    "name, quoted",
    [
        ("p=f32;c=f16", "f32;c=f16"),
        ("x=f32", "'x'"),
        ("p=f32=c", "p=f32=c"),
        ("p=", "'p'"),
        ("p=f32,,c=f16", "''"),
        ("c=int32", "int32"),
        ("int8", "int8"),
        ("p=f32,p=f16", "given twice"),
        ("", "empty policy"),
        ("  ", "empty policy"),
        ("c=float17", "float17"),
    ],
)
def test_malformed_strings_raise_with_quote(name, quoted):
  with pytest.raises(ValueError) as info:
    jmp_lite.get_policy(name)
  message = str(info.value)
  assert quoted in message
  assert "allowed" in message or "twice" in message or "key=value" in message or "policy is" in message


def test_unknown_dtype_message_lists_allowed_names():
  with pytest.raises(ValueError, match=r"allowed dtype names: .*bf16.*f16.*f32"):
    jmp_lite.get_policy("c=fp8")


def test_unknown_key_message_lists_allowed_keys():
  with pytest.raises(ValueError, match=r"unknown key 'q'.*allowed keys: c, compute, o, output, p, params"):
    jmp_lite.get_policy("q=f32")


# ---------------------------------------------------------------- casting rules


class Pair(NamedTuple):
  a: object
  b: object


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Holder:
  w: jax.Array
  count: jax.Array


def _mixed_tree(make):
  return {
      "w": make(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)),
      "b16": make(np.array([0.5, 2.0], np.float16)),
      "i": make(np.arange(3, dtype=np.int32)),
      "flag": make(np.array([True, False])),
      "key": jax.random.key(0),
      "raw_key": jax.random.PRNGKey(1),
      "none": None,
      "py": 1.5,
      "obj": "text",
      "np_scalar": np.float32(3.25),
      "np_int_scalar": np.int64(7),
      "pair": Pair(make(np.ones(2, np.float64 if make is np.asarray else np.float32)), 3),
  }


@pytest.mark.parametrize("make", [np.asarray, jnp.asarray], ids=["np", "jnp"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_only_floating_array_leaves_are_cast(make, dtype, maybe_jit):
  tree = _mixed_tree(make)
  policy = jmp_lite.Policy(F32, dtype, F32)
  arrays = {k: v for k, v in tree.items() if k not in ("none", "py", "obj")}
  out = maybe_jit(policy.cast_to_compute)(arrays)
  assert jax.tree.structure(out) == jax.tree.structure(arrays)
  for name in ("w", "b16", "np_scalar"):
    assert out[name].dtype == dtype, name
  assert out["pair"].a.dtype == dtype
  np.testing.assert_allclose(
      np.asarray(out["w"], np.float32), np.asarray(tree["w"], np.float32),
      rtol={F16: 1e-3, BF16: 1e-2, F32: 1e-6}[dtype],
  )
  for name in ("i", "flag", "np_int_scalar"):
    # Under jit, JAX itself canonicalises inputs (int64 -> int32 without x64).
    assert out[name].dtype in (tree[name].dtype, jax.dtypes.canonicalize_dtype(tree[name].dtype))
    np.testing.assert_array_equal(out[name], tree[name])
  assert out["key"].dtype == tree["key"].dtype
  assert out["raw_key"].dtype == jnp.uint32


def test_non_floating_leaves_are_the_same_object():
  tree = _mixed_tree(jnp.asarray)
  out = jmp_lite.get_policy("c=bf16").cast_to_compute(tree)
  for name in ("i", "flag", "key", "raw_key", "py", "obj", "np_int_scalar"):
    assert out[name] is tree[name], name
  assert out["none"] is None and out["pair"].b == 3


def test_numpy_inputs_stay_numpy():
  out = jmp_lite.cast_to_half({"a": np.ones(2, np.float32), "s": np.float32(1)})
  assert isinstance(out["a"], np.ndarray) and out["a"].dtype == HALF
  assert isinstance(out["s"], np.generic) and out["s"].dtype == HALF


def test_already_right_dtype_is_returned_as_is():
  x = jnp.ones(3, jnp.float32)
  assert jmp_lite.cast_to_full({"x": x})["x"] is x


@pytest.mark.parametrize("method, field", [
    ("cast_to_param", "param_dtype"), ("cast_to_compute", "compute_dtype"),
    ("cast_to_output", "output_dtype"),
])
def test_each_cast_uses_its_dtype(method, field):
  p = jmp_lite.Policy(BF16, F16, F64 if jax.config.jax_enable_x64 else F32)
  out = getattr(p, method)(np.ones(2, np.float32))
  assert out.dtype == getattr(p, field)


def test_any_pytree_type():
  frozen = FrozenDict({"k": jnp.ones(2)})
  holder = Holder(w=jnp.ones(2), count=jnp.int32(4))
  out = jmp_lite.cast_to_half([frozen, holder, Pair(jnp.ones(1), None)])
  assert isinstance(out[0], FrozenDict) and out[0]["k"].dtype == HALF
  assert isinstance(out[1], Holder) and out[1].w.dtype == HALF and out[1].count.dtype == jnp.int32
  assert isinstance(out[2], Pair) and out[2].a.dtype == HALF and out[2].b is None


def test_nnx_state():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(3, 4, rngs=rngs)
      self.count = nnx.Variable(jnp.int32(0))
      self.rngs = rngs

  _, state = nnx.split(Model(nnx.Rngs(0)))
  out = jmp_lite.get_policy("c=bf16").cast_to_compute(state)
  assert type(out) is type(state)
  assert out["dense"]["kernel"].get_value().dtype == BF16
  assert out["count"].get_value().dtype == jnp.int32
  assert jnp.issubdtype(out["rngs"]["default"]["key"].get_value().dtype, jax.dtypes.prng_key)


def test_cast_to_full_and_half_match_jmp():
  tree = {"a": np.ones(2, np.float16), "b": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(2)}
  for ours, theirs in ((jmp_lite.cast_to_full, jmp.cast_to_full), (jmp_lite.cast_to_half, jmp.cast_to_half)):
    a, b = ours(tree), theirs(tree)
    assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)


def test_half_dtype_on_cpu():
  assert jmp_lite.half_dtype() == (BF16 if jax.default_backend() == "tpu" else F16)


# ---------------------------------------------------------------- keep rules


def _model_params():
  return {
      "params": {
          "Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
          "LayerNorm_0": {"scale": jnp.ones(4), "bias": jnp.zeros(4)},
          "BatchNorm_0": {"scale": jnp.ones(4)},
          "layer_norm": {"scale": jnp.ones(4)},
      },
      "batch_stats": {"BatchNorm_0": {"mean": jnp.zeros(4)}},
  }


def test_keep_rule_regex(maybe_jit):
  policy = jmp_lite.get_policy("mixed_bfloat16").with_keep_full(".*(LayerNorm|BatchNorm|norm).*")
  out = maybe_jit(policy.cast_to_compute)(_model_params())
  p = out["params"]
  assert p["Dense_0"]["kernel"].dtype == BF16 and p["Dense_0"]["bias"].dtype == BF16
  for name in ("LayerNorm_0", "BatchNorm_0", "layer_norm"):
    assert p[name]["scale"].dtype == F32, name
  assert out["batch_stats"]["BatchNorm_0"]["mean"].dtype == F32


def test_keep_rule_predicate_and_bias_rule():
  policy = jmp_lite.Policy(F32, F16, F32, keep_full=(lambda path, leaf: leaf.ndim == 1,))
  out = policy.cast_to_compute(_model_params())["params"]
  assert out["Dense_0"]["kernel"].dtype == F16
  assert out["Dense_0"]["bias"].dtype == F32 and out["LayerNorm_0"]["scale"].dtype == F32
  only_bias = jmp_lite.Policy(F32, F16, F32, keep_full="bias$")
  out = only_bias.cast_to_compute(_model_params())["params"]
  assert out["Dense_0"]["bias"].dtype == F32 and out["LayerNorm_0"]["scale"].dtype == F16


def test_keep_rule_casts_half_leaf_up_to_f32():
  policy = jmp_lite.Policy(BF16, BF16, BF16, keep_full="norm")
  out = policy.cast_to_param({"norm": jnp.ones(2, jnp.bfloat16), "w": jnp.ones(2)})
  assert out["norm"].dtype == F32 and out["w"].dtype == BF16


def test_a_keep_rule_that_selects_nothing_warns_naming_it():
  from jmp_lite._src import policy as policy_lib

  nnx_params = {"batch_norm": {"scale": jnp.ones(4)}, "linear": {"kernel": jnp.ones((4, 4))},
                "count": jnp.int32(0)}
  with pytest.warns(UserWarning) as record:
    policy_lib.warn_unmatched_keep_rules(
        ("BatchNorm", "kernel", lambda path, leaf: path == "count"),
        {"params": nnx_params, "model_state": None}, "the policy")
  messages = [str(w.message) for w in record]
  assert len(messages) == 2  # "kernel" selects a leaf; the int "count" is no floating leaf.
  assert messages[0] == (
      "keep rule 'BatchNorm' of the policy selects no floating leaf of params or model_state, "
      "so it keeps nothing in float32. It matches ['batch_norm/scale'] ignoring case and "
      "underscores. NNX (and Equinox) names are snake_case attribute names (e.g. 'batch_norm' "
      "or 'bn' rather than 'BatchNorm'); Flax linen names are 'BatchNorm_0'. The floating "
      "leaves are, e.g.: 'batch_norm/scale', 'linear/kernel'")
  assert messages[1].startswith(
      "keep rule test_a_keep_rule_that_selects_nothing_warns_naming_it.<locals>.<lambda> of "
      "the policy selects no floating leaf")
  # Every rule that selects a leaf (in any of the trees): no warning.
  policy_lib.warn_unmatched_keep_rules(
      ("batch_norm", "mean"), {"params": nnx_params, "model_state": {"mean": jnp.zeros(4)}},
      "the policy")


def test_keep_rules_do_not_change_str_and_stay_hashable():
  policy = jmp_lite.get_policy("mixed_float16").with_keep_full("norm", lambda p, x: False)
  assert str(policy) == "p=f32,c=f16,o=f32"
  hash(policy)
  assert len(policy.keep_full) == 2


# ------------------------------------------- bad input: messages name the value and what is allowed


MALFORMED_POLICIES = [
    # (string, exception, regex that the message must match)
    ("p=f32;c=f16", ValueError, r"malformed part 'p=f32;c=f16'.*key=value"),
    ("p=f32=c", ValueError, r"malformed part 'p=f32=c'.*key=value"),
    ("p=f32,,c=f16", ValueError, r"malformed part ''.*'p=f32,,c=f16'"),
    ("x=f32", ValueError, r"unknown key 'x'.*allowed keys: c, compute, o, output, p, params"),
    ("p=f32,param=bf16", ValueError, r"unknown key 'param'.*allowed keys"),
    ("p=", ValueError, r"empty value for key 'p'.*allowed dtype names"),
    ("p=f32,c= ", ValueError, r"empty value for key 'c'.*allowed dtype names"),
    ("p=int32", ValueError, r"'int32'.*'p=int32'.*allowed dtype names: .*bf16"),
    ("c=bool", ValueError, r"'bool'.*allowed dtype names"),
    ("int8", ValueError, r"'int8'.*allowed dtype names"),
    ("f33", ValueError, r"'f33'.*allowed dtype names"),
    ("p=f32,p=f16", ValueError, r"key 'p' is given twice in policy 'p=f32,p=f16'"),
    ("p=f32,params=f16", ValueError, r"key 'params' is given twice"),
    ("", ValueError, r"empty policy string ''.*comma-separated key=value"),
    ("   ", ValueError, r"empty policy string '   '"),
    # Strings that numpy's dtype parser itself chokes on must still give our message.
    (",", ValueError, r"','.*allowed"),
    ("1;", ValueError, r"'1;'.*allowed"),
    ("f4,f4", ValueError, r"'f4,f4'.*allowed"),
]


@pytest.mark.parametrize("text,exc,match", MALFORMED_POLICIES, ids=[repr(m[0]) for m in MALFORMED_POLICIES])
def test_malformed_policy_strings(text, exc, match):
  with pytest.raises(exc, match=match):
    jmp_lite.get_policy(text)


@pytest.mark.parametrize("value", [None, 3, jnp.float16, ["p=f32"], b"p=f32"])
def test_get_policy_rejects_non_strings(value):
  got = re.escape(repr(value))
  with pytest.raises(TypeError, match=rf"get_policy expects a string, got {got}.*key=value"):
    jmp_lite.get_policy(value)


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [jnp.int32, np.int8, jnp.bool_, "uint8", jnp.complex64])
def test_policy_rejects_non_floating_dtypes(field, dtype):
  kwargs = dict(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
  kwargs[field] = dtype
  with pytest.raises(TypeError, match=rf"{field} must be a floating dtype.*float32.*got"):
    jmp_lite.Policy(**kwargs)
  base = jmp_lite.get_policy("mixed_float16")
  method = {"param_dtype": base.with_param_dtype, "compute_dtype": base.with_compute_dtype,
            "output_dtype": base.with_output_dtype}[field]
  with pytest.raises(TypeError, match=rf"{field} must be a floating dtype"):
    method(dtype)


def test_policy_rejects_non_dtypes():
  with pytest.raises(TypeError, match=r"compute_dtype must be a floating dtype, got 'nonsense'"):
    jmp_lite.Policy(jnp.float32, "nonsense", jnp.float32)


@pytest.mark.parametrize("add_rule", [
    lambda rule: jmp_lite.Policy(F32, F16, F32, keep_full=(rule,)),
    lambda rule: jmp_lite.get_policy("mixed_float16").with_keep_full(rule),
], ids=["Policy", "with_keep_full"])
@pytest.mark.parametrize("rule, exc, match", [
    ("(", ValueError, r"keep rule '\(' is not a valid regular expression"),
    ("(unclosed", ValueError, r"keep rule '\(unclosed' is not a valid regular expression"),
    (3, TypeError, r"keep rule must be a regex string or a callable.*got 3"),
])
def test_bad_keep_rules(add_rule, rule, exc, match):
  with pytest.raises(exc, match=match):
    add_rule(rule)


@pytest.mark.parametrize("text,suggestion", [
    ("mixed_fp16", "'mixed_float16'"),
    ("mixed_bf16", "'mixed_bfloat16'"),
    ("flaot16", "'float16'"),
    ("p=f32,c=bfloat", "'bfloat16'"),
])
def test_get_policy_suggests_the_closest_names(text, suggestion):
  with pytest.raises(ValueError, match=rf"Unknown dtype .*did you mean {suggestion}") as e:
    jmp_lite.get_policy(text)
  if "=" not in text:  # A bare name also gets the grammar, Keras names included.
    assert "mixed_float16" in str(e.value) and "p=f32,c=bf16,o=f32" in str(e.value)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: jmp_lite.Policy(None, jnp.float16, jnp.float32), TypeError,
     r"param_dtype must be a floating dtype .*got None"),
    (lambda: jmp_lite.get_policy("float128"), ValueError, r"Unknown dtype 'float128'"),
    (lambda: jmp_lite.Policy(np.longdouble, jnp.float16, jnp.float32), TypeError,
     r"param_dtype must be a floating dtype"),
])
def test_policy_rejects_none_and_unsupported_dtypes(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


# ------------------------------------------------ properties: casting (issue 7)

FLOAT_DTYPES = [np.float16, jnp.bfloat16, np.float32, np.float64]
CAST_DTYPES = [np.float16, jnp.bfloat16, np.float32, jnp.float8_e4m3fn]


@st.composite
def floating_leaves(draw):
  dtype = np.dtype(draw(st.sampled_from(FLOAT_DTYPES)))
  shape = draw(st.sampled_from([(), (3,), (2, 2)]))
  values = np.asarray(
      draw(st.lists(st.floats(-1e3, 1e3, width=16), min_size=int(np.prod(shape)),
                    max_size=int(np.prod(shape)))), np.float32
  ).reshape(shape)
  kind = draw(st.sampled_from(["jax", "numpy", "numpy-scalar"]))
  if kind == "jax" and dtype != np.float64:
    return jnp.asarray(values, dtype)
  if kind == "numpy-scalar":
    return dtype.type(values.reshape(-1)[0] if values.size else 1.5)
  return values.astype(dtype)


def other_leaves():
  return st.sampled_from([
      lambda: jnp.arange(3, dtype=jnp.int32),
      lambda: np.arange(4, dtype=np.int64),
      lambda: jnp.array([True, False]),
      lambda: np.uint8(7),
      lambda: jax.random.key(0),
      lambda: 3,
      lambda: 2.5,  # Python floats are not arrays: passed through
      lambda: "name",
      lambda: object(),
  ]).map(lambda make: make())


def trees():
  leaves = floating_leaves() | other_leaves() | st.none()
  return st.recursive(
      leaves,
      lambda children: st.lists(children, max_size=3)
      | st.tuples(children, children)
      | st.dictionaries(st.sampled_from("abcde"), children, max_size=3),
      max_leaves=8,
  )


def policy_casts():
  dtypes = st.sampled_from(CAST_DTYPES)

  def make(p, c, o, which):
    policy = jmp_lite.Policy(p, c, o)
    dtype = {"param": p, "compute": c, "output": o}[which]
    return getattr(policy, f"cast_to_{which}"), np.dtype(dtype)

  return st.one_of(
      st.just((jmp_lite.cast_to_full, np.dtype(np.float32))),
      st.just((jmp_lite.cast_to_half, np.dtype(jmp_lite.half_dtype()))),
      st.builds(make, dtypes, dtypes, dtypes, st.sampled_from(["param", "compute", "output"])),
  )


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(tree=trees(), cast=policy_casts(), jit=st.booleans())
def test_casting_keeps_structure_and_non_floating_leaves(tree, cast, jit):
  cast_fn, dtype = cast
  out = cast_fn(tree)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
    is_float = isinstance(before, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        before.dtype, jnp.floating
    )
    if is_float:
      assert after.dtype == dtype
      assert np.shape(after) == np.shape(before)
    else:
      assert after is before
  if jit:  # Under jit, with the array leaves as arguments.
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray))
              and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != np.float64]
    jitted = jax.jit(cast_fn)(arrays)
    assert [a.dtype for a in jitted] == [dtype] * len(arrays)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("as_numpy", [False, True], ids=["jnp", "np"])
def test_round_trip_within_dtype_precision(dtype, as_numpy, maybe_jit):
  info = jnp.finfo(dtype)
  max_value = float(info.max)

  # Under jit every new list length compiles again: keep the examples few, do not shrink.
  @hypothesis.settings(
      max_examples=10,
      deadline=None,
      suppress_health_check=[hypothesis.HealthCheck.too_slow],
      phases=[hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate],
  )
  @hypothesis.given(st.lists(st.floats(-max_value, max_value, width=32), min_size=1, max_size=16))
  def check(values):
    x = np.asarray(values, np.float32)
    x = x if as_numpy else jnp.asarray(x)
    policy = jmp_lite.Policy(jnp.float32, dtype, jnp.float32)
    half = maybe_jit(policy.cast_to_compute)({"x": x})
    assert half["x"].dtype == dtype
    back = maybe_jit(jmp_lite.cast_to_full)(half)["x"]
    assert back.dtype == jnp.float32
    back, x = np.asarray(back, np.float64), np.asarray(x, np.float64)
    assert np.isfinite(back).all()
    # Round to nearest: relative error <= eps / 2 for normal numbers; below the
    # normal range the error is at most half the smallest subnormal (or a
    # flush to zero of float32 subnormals).
    bound = np.maximum(np.abs(x) * float(info.eps) / 2,
                       max(float(info.smallest_subnormal), float(np.finfo(np.float32).tiny)))
    assert (np.abs(back - x) <= bound).all(), (x, back)

  check()


# ------------------------------------------------ properties: policy strings (issue 7)

POLICY_DTYPES = [
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.float8_e4m3fn, jnp.float8_e5m2,
]
ALIASES = {
    np.dtype(jnp.float16): ["f16", "float16", "F16"],
    np.dtype(jnp.bfloat16): ["bf16", "bfloat16", "BF16"],
    np.dtype(jnp.float32): ["f32", "float32", "full"],
    np.dtype(jnp.float64): ["f64", "float64"],
    np.dtype(jnp.float8_e4m3fn): ["float8_e4m3fn"],
    np.dtype(jnp.float8_e5m2): ["float8_e5m2"],
}


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    p=st.sampled_from(POLICY_DTYPES), c=st.sampled_from(POLICY_DTYPES),
    o=st.sampled_from(POLICY_DTYPES),
)
def test_get_policy_of_str_round_trips(p, c, o):
  policy = jmp_lite.Policy(p, c, o)
  assert jmp_lite.get_policy(str(policy)) == policy
  assert hash(jmp_lite.get_policy(str(policy))) == hash(policy)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(data=st.data())
def test_get_policy_accepts_every_spelling(data):
  keys = {"param_dtype": ["p", "params"], "compute_dtype": ["c", "compute"],
          "output_dtype": ["o", "output"]}
  given = data.draw(st.dictionaries(st.sampled_from(list(keys)), st.sampled_from(POLICY_DTYPES)))
  order = data.draw(st.permutations(list(given)))
  parts = []
  for field in order:
    key = data.draw(st.sampled_from(keys[field]))
    name = data.draw(st.sampled_from(ALIASES[np.dtype(given[field])]))
    pad = data.draw(st.sampled_from(["", " "]))
    parts.append(f"{pad}{key}{pad}={pad}{name}{pad}")
  text = ",".join(parts)
  hypothesis.assume(text)
  p = given.get("param_dtype", jnp.float32)
  c = given.get("compute_dtype", p)
  o = given.get("output_dtype", c)
  assert jmp_lite.get_policy(text) == jmp_lite.Policy(p, c, o)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(text=st.text(alphabet="pcof=,;123648b_ex ", max_size=14) | st.text(max_size=8))
def test_get_policy_fuzz_returns_a_policy_or_raises_value_error(text):
  try:
    policy = jmp_lite.get_policy(text)
  except ValueError as e:
    assert repr(text) in str(e)  # the message quotes the string it rejects
  else:
    assert isinstance(policy, jmp_lite.Policy)
    assert jmp_lite.get_policy(str(policy)) == policy


@pytest.mark.parametrize("name", ["A", "a", "p=a", "c=f32,o=a"])
def test_numpy_deprecated_alias_is_a_value_error_not_a_warning(name):
  # numpy 2 warns for the alias "a"; with warnings as errors (this project's
  # pytest config, and any user's -W error) that warning escaped get_policy.
  with pytest.raises(ValueError, match="Unknown dtype"):
    jmp_lite.get_policy(name)

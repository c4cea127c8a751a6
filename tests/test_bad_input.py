"""Bad input everywhere (issue 7): every message names the bad value and what is allowed."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp

# ----------------------------------------------------------- policy strings

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
    jmp.get_policy(text)


@pytest.mark.parametrize("value", [None, 3, jnp.float16, ["p=f32"], b"p=f32"])
def test_get_policy_rejects_non_strings(value):
  with pytest.raises(TypeError, match=r"get_policy expects a string, got .*key=value"):
    jmp.get_policy(value)


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [jnp.int32, np.int8, jnp.bool_, "uint8", jnp.complex64])
def test_policy_rejects_non_floating_dtypes(field, dtype):
  kwargs = dict(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
  kwargs[field] = dtype
  with pytest.raises(TypeError, match=rf"{field} must be a floating dtype.*float32.*got"):
    jmp.Policy(**kwargs)
  base = jmp.get_policy("mixed_float16")
  method = {"param_dtype": base.with_param_dtype, "compute_dtype": base.with_compute_dtype,
            "output_dtype": base.with_output_dtype}[field]
  with pytest.raises(TypeError, match=rf"{field} must be a floating dtype"):
    method(dtype)


def test_policy_rejects_non_dtypes():
  with pytest.raises(TypeError, match=r"compute_dtype must be a floating dtype, got 'nonsense'"):
    jmp.Policy(jnp.float32, "nonsense", jnp.float32)


def test_bad_keep_rules():
  with pytest.raises(ValueError, match=r"keep rule '\(' is not a valid regular expression"):
    jmp.get_policy("mixed_float16").with_keep_full("(")
  with pytest.raises(TypeError, match=r"keep rule must be a regex string or a callable.*got 3"):
    jmp.get_policy("mixed_float16").with_keep_full(3)


# ----------------------------------------------------------- scaler configs

BAD_SCALER_CONFIGS = [
    (dict(init_scale=0.0), ValueError, r"init_scale must be finite and > 0.*got 0\.0"),
    (dict(init_scale=-4.0), ValueError, r"init_scale must be finite and > 0.*got -4\.0"),
    (dict(init_scale=math.inf), ValueError, r"init_scale must be finite and > 0.*got inf"),
    (dict(init_scale=math.nan), ValueError, r"init_scale must be finite and > 0.*got nan"),
    (dict(init_scale="big"), TypeError, r"init_scale must be a real number, got 'big'"),
    (dict(growth_factor=1.0), ValueError, r"growth_factor must be finite and > 1, got 1\.0"),
    (dict(growth_factor=0.5), ValueError, r"growth_factor must be finite and > 1, got 0\.5"),
    (dict(growth_factor=math.nan), ValueError, r"growth_factor must be finite and > 1, got nan"),
    (dict(growth_factor=math.inf), ValueError, r"growth_factor must be finite and > 1, got inf"),
    (dict(backoff_factor=0.0), ValueError, r"backoff_factor must be in the open interval \(0, 1\), got 0\.0"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in the open interval \(0, 1\), got 1\.0"),
    (dict(backoff_factor=2.0), ValueError, r"backoff_factor .*\(0, 1\), got 2\.0"),
    (dict(backoff_factor=-0.5), ValueError, r"backoff_factor .*\(0, 1\), got -0\.5"),
    (dict(backoff_factor=math.nan), ValueError, r"backoff_factor .*\(0, 1\), got nan"),
    (dict(growth_interval=0), ValueError, r"growth_interval must be .*1.*got 0"),
    (dict(growth_interval=-3), ValueError, r"growth_interval must be .*1.*got -3"),
    (dict(growth_interval=2.5), TypeError, r"growth_interval must be an int >= 1, got 2\.5"),
    (dict(growth_interval=True), TypeError, r"growth_interval must be an int >= 1, got True"),
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), ValueError,
     r"min_scale must be <= max_scale, got min_scale=8\.0 > max_scale=4\.0"),
    (dict(min_scale=0.0), ValueError, r"min_scale must be finite and > 0.*got 0\.0"),
    (dict(max_scale=math.nan), ValueError, r"max_scale .*got nan"),
    (dict(init_scale=2.0**30), ValueError, r"init_scale must be in \[min_scale, max_scale\].*got 1073741824\.0"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_SCALER_CONFIGS, ids=[str(c[0]) for c in BAD_SCALER_CONFIGS])
def test_bad_scaler_configs(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    jmp.dynamic_loss_scaling(optax.adam(1e-3), **kwargs)


@pytest.mark.parametrize("scale,exc,match", [
    (0.0, ValueError, r"scale must be finite and > 0.*got 0\.0"),
    (-1.0, ValueError, r"scale must be finite and > 0.*got -1\.0"),
    (math.inf, ValueError, r"scale must be finite and > 0.*got inf"),
    (math.nan, ValueError, r"scale must be finite and > 0.*got nan"),
    ("x", TypeError, r"scale must be a real number, got 'x'"),
])
def test_bad_static_scale(scale, exc, match):
  with pytest.raises(exc, match=match):
    jmp.static_loss_scaling(optax.adam(1e-3), scale)


@pytest.mark.parametrize("kwargs,match", [
    (dict(period=0), r"period must be an int >= 1, got 0"),
    (dict(factor=1), r"factor must be finite and > 1, got 1"),
    (dict(factor=0.5), r"factor must be finite and > 1, got 0\.5"),
])
def test_bad_jmp_dynamic_loss_scale(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jmp.DynamicLossScale(jnp.float32(2.0**15), **kwargs)


@pytest.mark.parametrize("value", [0.0, -2.0, math.inf, math.nan])
def test_bad_jmp_static_loss_scale(value):
  with pytest.raises(ValueError, match=rf"loss_scale must be finite and > 0, got {value!r}"):
    jmp.StaticLossScale(value)


# ----------------------------------------------------------- non-transformations


@pytest.mark.parametrize("inner", [optax.adam, "adam", None, (optax.sgd(0.1),)],
                         ids=["uncalled-factory", "string", "None", "tuple"])
def test_non_transformation_inner(inner):
  with pytest.raises(TypeError, match=r"inner must be an optax transformation .*got"):
    jmp.dynamic_loss_scaling(inner)
  with pytest.raises(TypeError, match=r"inner must be an optax transformation"):
    jmp.static_loss_scaling(inner, 2.0)


def test_train_state_rejects_non_transformation():
  with pytest.raises(TypeError, match=r"tx must be an optax transformation, got"):
    jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.adam)


def test_make_train_step_rejects_bad_arguments():
  with pytest.raises(TypeError, match=r"policy must be a jmp_lite.Policy, got 'mixed_float16'"):
    jmp.make_train_step(lambda p, b: 0.0, "mixed_float16")
  with pytest.raises(TypeError, match=r"loss_fn must be callable, got 3"):
    jmp.make_train_step(3, jmp.get_policy("f32"))


def test_select_tree_rejects_bad_predicates():
  with pytest.raises(TypeError, match=r"pred must be a bool, got dtype float32"):
    jmp.select_tree(jnp.float32(1.0), 1.0, 2.0)
  with pytest.raises(ValueError, match=r"pred must be a scalar, got shape \(2,\)"):
    jmp.select_tree(jnp.array([True, False]), 1.0, 2.0)


# ----------------------------------------------------------- the train step


def _state():
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2), "b": jnp.full((2,), 0.1)}
  return jmp.TrainState.create(params=params, tx=jmp.dynamic_loss_scaling(optax.sgd(0.1)))


def _batch():
  x = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)
  return {"x": x, "y": jnp.cos(x[:, :2])}


def _pred(params, batch):
  return batch["x"] @ params["w"] + params["b"]


BAD_LOSSES = {
    "vector": (lambda p, b: (_pred(p, b) - b["y"]) ** 2, False),
    "matrix-f16": (lambda p, b: ((_pred(p, b) - b["y"]) ** 2).astype(jnp.float16), False),
    "integer": (lambda p, b: jnp.sum(_pred(p, b)).astype(jnp.int32), False),
    "bool": (lambda p, b: jnp.sum(_pred(p, b)) > 0, False),
    "complex": (lambda p, b: jnp.sum(_pred(p, b)).astype(jnp.complex64), False),
    "tuple-without-has_aux": (lambda p, b: (jnp.sum(_pred(p, b)), {}), False),
    "vector-with-aux": (lambda p, b: (_pred(p, b), {"n": 1}), True),
}


@pytest.mark.parametrize("name", list(BAD_LOSSES))
def test_non_scalar_or_non_float_loss(name):
  loss_fn, has_aux = BAD_LOSSES[name]
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), has_aux=has_aux, donate=False)
  with pytest.raises((TypeError, ValueError), match=r"scalar"):
    step(_state(), _batch())


def test_has_aux_without_a_pair():
  step = jmp.make_train_step(
      lambda p, b: jnp.mean(_pred(p, b)), jmp.get_policy("f32"), has_aux=True, donate=False
  )
  with pytest.raises(TypeError, match=r"has_aux=True .*\(loss, aux\) pair"):
    step(_state(), _batch())


def _loss(params, batch):
  return jnp.mean((_pred(params, batch).astype(jnp.float32) - batch["y"]) ** 2)


def test_batch_structure_change_between_calls():
  step = jmp.make_train_step(_loss, jmp.get_policy("mixed_float16"), donate=False)
  state, _ = step(_state(), _batch())
  bad = dict(_batch(), extra=jnp.ones(3))
  with pytest.raises(ValueError, match=r"(?s)batch tree changed structure.*expected.*received"):
    step(state, bad)
  with pytest.raises(ValueError, match=r"batch tree changed structure"):
    step(state, [_batch()["x"], _batch()["y"]])
  # The step still works with the original structure.
  state, metrics = step(state, _batch())
  assert bool(metrics["grads_finite"])


def test_params_structure_change_between_calls():
  step = jmp.make_train_step(_loss, jmp.get_policy("mixed_float16"), donate=False)
  state, _ = step(_state(), _batch())
  extra = dict(state.params, extra=jnp.ones(2))
  with pytest.raises(ValueError, match=r"(?s)params tree changed structure.*expected.*received"):
    step(state.replace(params=extra), _batch())


def test_train_step_rejects_a_non_train_state():
  step = jmp.make_train_step(_loss, jmp.get_policy("f32"), donate=False)
  with pytest.raises(TypeError, match=r"state must be a jmp_lite.TrainState.*got dict"):
    step({"params": _state().params}, _batch())


# ----------------------------------------------------------- diagnostics


@pytest.mark.parametrize("tree", [{}, None, [], {"n": jnp.arange(3)}, (1, 2)],
                         ids=["dict", "None", "list", "ints-only", "python-ints"])
def test_gradient_report_on_an_empty_tree(tree):
  with pytest.raises(ValueError, match=r"gradient_report needs a pytree with floating array leaves, got"):
    jmp.gradient_report(tree)


# ----------------------------------------------------------- issue 11, items 13 and 14


@pytest.mark.parametrize("make,exc,match", [
    (lambda: jmp.Policy(None, jnp.float16, jnp.float32), TypeError,
     r"param_dtype must be a floating dtype .*got None"),
    (lambda: jmp.get_policy("float128"), ValueError, r"Unknown dtype 'float128'"),
    (lambda: jmp.Policy(np.longdouble, jnp.float16, jnp.float32), TypeError,
     r"param_dtype must be a floating dtype"),
    (lambda: jmp.make_train_step(lambda p, b: 0.0, jmp.get_policy("f32"), donate="no"),
     TypeError, r"donate must be True or False, got 'no'"),
    (lambda: jmp.make_train_step(lambda p, b: 0.0, jmp.get_policy("f32"), has_aux=1),
     TypeError, r"has_aux must be True or False, got 1"),
    (lambda: jmp.StaticLossScale(True), TypeError, r"loss_scale must be a real number, got True"),
])
def test_more_bad_arguments(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


@pytest.mark.parametrize("text,suggestion", [
    ("mixed_fp16", "'mixed_float16'"),
    ("mixed_bf16", "'mixed_bfloat16'"),
    ("flaot16", "'float16'"),
    ("p=f32,c=bfloat", "'bfloat16'"),
])
def test_get_policy_suggests_the_closest_names(text, suggestion):
  with pytest.raises(ValueError, match=rf"Unknown dtype .*did you mean {suggestion}") as e:
    jmp.get_policy(text)
  if "=" not in text:  # A bare name also gets the grammar, Keras names included.
    assert "mixed_float16" in str(e.value) and "p=f32,c=bf16,o=f32" in str(e.value)


def test_a_pair_without_has_aux_suggests_has_aux():
  step = jmp.make_train_step(lambda p, b: (jnp.sum(p["w"]), 1), jmp.get_policy("f32"))
  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"it returned a pair.*has_aux=True"):
    step(state, {})

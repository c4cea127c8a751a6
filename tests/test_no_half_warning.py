"""make_train_step warns when a half policy runs (almost) no matmul in half (issue 42 item 6).

flax's wmt example, with its config's dtype left float32 as shipped, ran all
135 matmuls in float32 under mixed_float16, and nothing in training showed it.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp


class _Mlp(nn.Module):
  """Two Dense layers built with a config's dtype, as flax's wmt builds its layers."""

  dtype: object
  width: int = 32

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, dtype=self.dtype)(nn.relu(nn.Dense(self.width, dtype=self.dtype)(x)))


def _problem(dtype, traces=None):
  model = _Mlp(dtype)
  x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(params, batch):
    if traces is not None:
      traces.append(1)
    return jnp.mean(model.apply({"params": params}, batch["x"]).astype(jnp.float32) ** 2)

  return loss_fn, jmp.TrainState.create(params=params, tx=optax.sgd(0.1)), {"x": x}


def _calls(step, state, batch, n=2):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(n):
      state, _ = step(state, batch)
  return [w for w in caught if issubclass(w.category, jmp.NothingInHalfWarning)]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_model_pinned_to_float32_warns_once_with_the_cause(policy):
  loss_fn, state, batch = _problem(jnp.float32)
  caught = _calls(jmp.make_train_step(loss_fn, jmp.get_policy(policy)), state, batch)
  assert len(caught) == 1  # At the first call only.
  message = str(caught[0].message)
  half = jnp.dtype(jmp.get_policy(policy).compute_dtype).name
  assert message.startswith(f"the policy computes in {half}, but 0% of the step's matmul")
  # 2 forward, 3 backward (the batch is not differentiated).
  assert "(0 of 5 operations, forward and backward)" in message
  assert "a layer pins its dtype" in message and f"set the layer's dtype to {half}" in message
  assert "warn_no_half=False" in message
  assert caught[0].filename == __file__  # Points at the user's call.


def test_the_warning_can_be_turned_off():
  loss_fn, state, batch = _problem(jnp.float32)
  f16 = jmp.get_policy("mixed_float16")
  step = jmp.make_train_step(loss_fn, f16, warn_no_half=False, donate=False)
  assert _calls(step, state, batch) == []
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=jmp.NothingInHalfWarning)
    jmp.make_train_step(loss_fn, f16, donate=False)(state, batch)  # Silent under "error".
  with pytest.raises(TypeError, match="warn_no_half must be True or False, got 1"):
    jmp.make_train_step(loss_fn, f16, warn_no_half=1)


def test_no_warning_where_half_runs_or_float32_is_the_policy():
  traces = []
  loss_fn, state, batch = _problem(jnp.float16, traces)
  assert _calls(jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16")), state, batch) == []
  assert len(traces) == 1  # The check reads the step's own trace: nothing traced twice.
  loss_fn, state, batch = _problem(jnp.float32)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("full"), donate=False)
  assert _calls(step, state, batch) == []
  # Autocast runs the pinned layers' matmuls in half.
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"), autocast=True)
  assert _calls(step, state, batch) == []


@pytest.mark.parametrize("width, warns", [(8, False), (4, True)])
def test_the_bar_is_a_tenth_of_the_matmul_flops(width, warns):
  # A float32 head beside a half body: the share of FLOPs decides, not the count.
  body = nn.Dense(width)
  x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
  params = {"body": body.init(jax.random.key(0), x)["params"],
            "head": jnp.ones((64, 64), jnp.float32)}

  def loss_fn(params, batch):
    h = body.apply({"params": params["body"]}, batch["x"])  # half: 2 * 8 * 64 * width
    pinned = batch["x"].astype(jnp.float32) @ params["head"].astype(jnp.float32)  # 2 * 8 * 64 * 64
    return jnp.mean(h.astype(jnp.float32) ** 2) + jnp.mean(pinned ** 2)

  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.1))
  caught = _calls(jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16")), state, {"x": x})
  # Half FLOPs: 2 * 8 * 64 * width forward, as many for the body's weight gradient; float32:
  # 2 * 8 * 64 * 64 each. Width 8 is 11.1% in half (no warning), width 4 is 5.9%.
  assert len(caught) == warns
  if warns:
    assert "but 6% of the step's matmul" in str(caught[0].message)

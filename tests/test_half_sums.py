"""The step names a sum by scatter that loss_fn runs in half under the plain policy.

``jnp.sum`` of a half array accumulates in float32 by itself; a scatter-add
(``jax.ops.segment_sum``, ``.at[].add``) accumulates in its dtype, so a float16
sum of many terms stops growing. Autocast accumulates it in float32; the plain
policy leaves ``loss_fn`` as written and says so with a ``HalfSumWarning``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jmp

_N, _SEGMENTS = 4096, 4


def _segment_loss(params, batch):
  h = batch["x"] @ params["w"]
  sums = jax.ops.segment_sum(h, batch["segment"], num_segments=_SEGMENTS)
  return jnp.mean(sums.astype(jnp.float32) ** 2)


def _embedding_loss(params, batch):
  """A row lookup, whose gradient JAX writes as a scatter-add of the cotangents."""
  return jnp.mean(params["table"][batch["ids"]].astype(jnp.float32) ** 2)


def _state_and_batch():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((8, 16)) * 0.1, jnp.float32),
            "table": jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)}
  batch = {"x": jnp.ones((_N, 8)), "segment": jnp.arange(_N) % _SEGMENTS,
           "ids": jnp.arange(64) % 32}
  return jmp.TrainState.create(params=params, tx=optax.sgd(1e-3)), batch


def _run(loss_fn, policy, **options):
  state, batch = _state_and_batch()
  step = jmp.make_train_step(loss_fn, jmp.get_policy(policy), **options)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      state, _ = step(state, batch)
  return [w for w in caught if issubclass(w.category, jmp.HalfSumWarning)]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_half_segment_sum_warns_once_with_its_line(policy):
  found = _run(_segment_loss, policy)
  assert len(found) == 1
  text = str(found[0].message)
  assert "scatter-add" in text and "autocast=True" in text
  assert "test_half_sums.py" in text  # The user's line, not the library's.
  assert ("float16" if policy == "mixed_float16" else "bfloat16") in text


@pytest.mark.parametrize("policy, options", [
    ("mixed_float16", {"autocast": True}),   # Autocast accumulates it in float32.
    ("full", {}),                             # Nothing is half.
])
def test_no_warning_where_the_sum_runs_in_float32(policy, options):
  assert _run(_segment_loss, policy, **options) == []


def test_an_embeddings_gradient_does_not_warn():
  assert _run(_embedding_loss, "mixed_float16") == []


def test_under_autocast_the_segment_sum_is_float32s():
  policy = jmp.get_policy("mixed_float16")
  state, batch = _state_and_batch()
  batch = {**batch, "x": jnp.full((_N * 25, 8), 8.0), "segment": jnp.zeros(_N * 25, jnp.int32)}
  params = {"w": jnp.eye(8, 16)}
  exact = float(jax.ops.segment_sum(batch["x"] @ params["w"], batch["segment"],
                                    num_segments=_SEGMENTS)[0, 0])
  half_params, half_batch = policy.cast_to_compute((params, batch))
  plain = jax.ops.segment_sum(half_batch["x"] @ half_params["w"], half_batch["segment"],
                              num_segments=_SEGMENTS)[0, 0]
  cast = jmp.autocast(lambda p, b: jax.ops.segment_sum(b["x"] @ p["w"], b["segment"],
                                                       num_segments=_SEGMENTS)[0, 0],
                      jnp.float16)(half_params, half_batch)
  assert exact == 8.0 * _N * 25
  assert float(plain) < exact / 10               # Why the warning exists.
  assert float(cast) == pytest.approx(exact, rel=1e-3)

"""benchmarks.residuals: the bytes the backward pass keeps (issue 29 item 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jmp
from benchmarks import residuals


def test_residual_bytes_are_the_pullbacks_leaves_with_the_policy_cast_inside():
  f = lambda w, b: jnp.sum(jnp.tanh(b["x"] @ w))
  w, b = jnp.ones((4, 3)), {"x": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)}

  def kept(dtype):  # the definition, run: the leaves of the pullback jax.vjp returns
    cast = lambda t: t.astype(dtype)
    _, pullback = jax.vjp(lambda q: f(cast(q), {"x": cast(b["x"])}), w)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(pullback))

  fp32 = residuals.residual_bytes(f, w, b, jmp.get_policy("f32"), False)
  half = residuals.residual_bytes(f, w, b, jmp.get_policy("mixed_bfloat16"), False)
  assert fp32 == {"float32": kept(jnp.float32)} and half == {"bfloat16": kept(jnp.bfloat16)}
  assert fp32["float32"] == 2 * half["bfloat16"] >= 4 * 8 * 4  # at least x, for dw


def test_bf16_autocast_keeps_at_most_the_bar_and_no_float32_activation():
  rows = residuals.run(list(residuals.MODELS), ["fp32", "bf16_autocast"], "smoke")
  assert [r["model"] for r in rows] == list(residuals.MODELS)
  bars = residuals.bars(rows, meaningful=False)
  assert [b["model"] for b in bars] == list(residuals.BAR_MODELS)
  for b in bars:
    assert b["passed"] and b["value"] <= residuals.BAR, b
  for r in rows:
    auto = r["variants"]["bf16_autocast"]
    assert auto["by_dtype"].get("float32", 0) < 0.01 * auto["bytes"], r["model"]
    assert r["variants"]["fp32"]["vs_fp32"] == 1.0

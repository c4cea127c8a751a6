"""The benchmark models: sizes and leaf counts that the benchmarks rely on."""

from __future__ import annotations

import jax
import pytest

from benchmarks import models


def test_deep_transformer_has_hundreds_of_leaves_and_is_not_in_all():
  # Two layers here (initialising 24 takes 20 s); the preset has 24.
  problem = models.build_problem("deep_transformer", "cpu", layers=2)
  # Each block has 16 leaves (2 LayerNorms, 4 attention projections and 2
  # Dense layers, each with a bias); then embedding, positions, final
  # LayerNorm and head: 24 * 16 + 6 = 390 leaves at the preset's depth.
  assert len(jax.tree.leaves(problem.params)) == 2 * 16 + 6
  assert models.PRESETS["cpu"]["deep_transformer"]["layers"] == 24
  assert problem.config["hidden"] == 64
  assert "deep_transformer" in models.MODELS
  assert "deep_transformer" not in models.DEFAULT_MODELS


def test_bad_sizes_are_refused():
  with pytest.raises(ValueError, match="multiple of heads"):
    models.build_problem("deep_transformer", "smoke", hidden=15)
  with pytest.raises(ValueError, match="model must be one of"):
    models.build_problem("deeper", "cpu")

"""Shared fixtures: run numeric checks both eagerly and under jax.jit."""

import jax
import pytest


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """``maybe_jit(f)`` is ``f`` itself or ``jax.jit(f)``."""
  return jax.jit if request.param else (lambda f: f)

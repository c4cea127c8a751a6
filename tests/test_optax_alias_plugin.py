"""The plugin that runs optax's alias tests through ``quantize_state`` wraps where it should, only there."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lite as jmp
import optax_alias_quantized as plugin


def _coded_leaves(state):
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jmp.QuantizedArray))
  return [leaf for leaf in leaves if isinstance(leaf, jmp.QuantizedArray)]


@pytest.mark.parametrize("fmt", ["int8", "float8", "int4"])
def test_alias_test_copy_builds_quantized_optimizers(fmt):
  module = plugin.load_alias_test(fmt)
  assert module.__name__ == f"optax_alias_test_{fmt}"
  params = jnp.array([1.0, -2.0])
  # The three ways alias_test builds its optimizers: _get_opt, alias.<name>, inject_hyperparams.
  by_name = module._get_opt(None, "adam")(learning_rate=0.1).init(params)
  direct = module.alias.sgd(0.1, momentum=0.9).init(params)
  injected = module._inject.inject_hyperparams(module._get_opt(None, "adam"))(
      learning_rate=0.1).init(params)
  for state in (by_name, direct, injected.inner_state):
    assert isinstance(state, jmp.QuantizedState)
    assert {leaf.format for leaf in _coded_leaves(state)} == {fmt}


def test_optax_and_the_unwrapped_copy_are_untouched():
  params = jnp.array([1.0, -2.0])
  plugin.load_alias_test("int8")
  unwrapped = plugin.load_alias_test("unwrapped")
  assert not isinstance(optax.adam(0.1).init(params), jmp.QuantizedState)
  assert not isinstance(unwrapped._get_opt(None, "adam")(learning_rate=0.1).init(params),
                        jmp.QuantizedState)

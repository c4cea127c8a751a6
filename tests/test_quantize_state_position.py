"""``"int4"`` codes a state leaf that sets the params' position in 8 bits (``position.py``).

madgrad and cocob set their params from running sums of gradients; coded in
4 bits they ended at 6-9x float32's loss (``tests/test_contrib_quantized.py``
measures it, and fails if the sums go back to 4 bits). Here: which leaves
the measurement finds, on optimizers that step and on ones that set a
position, and that ``quantize_state`` uses it the same under ``jit``.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
from optax import contrib
import pytest

from conftest import Traces
import jmp_lite as jmp
from jmp_lite._src.optim import position

PARAMS = {"w": 0.3 * jnp.ones((8, 16)), "b": 0.1 * jnp.ones(16)}

# Optimizers that step: no leaf of theirs sets a position.
STEPPERS = {
    "adam": lambda: optax.adam(1e-3), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9), "lion": lambda: optax.lion(1e-3),
    "adagrad": lambda: optax.adagrad(0.1), "adadelta": lambda: optax.adadelta(0.1),
    "rmsprop": lambda: optax.rmsprop(1e-3), "yogi": lambda: optax.yogi(1e-3),
    "sm3": lambda: optax.sm3(0.1), "adan": lambda: optax.adan(1e-3),
    "novograd": lambda: optax.novograd(1e-3), "amsgrad": lambda: optax.amsgrad(1e-3),
    "prodigy": contrib.prodigy, "dadapt_adamw": contrib.dadapt_adamw,
    "ademamix": lambda: contrib.ademamix(1e-2),
    "schedule_free_adamw": lambda: contrib.schedule_free_adamw(1e-2),
    "multi_steps_adam": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
}


def _formats(state):
  """Each coded leaf's format, by its path in the state."""
  return {jax.tree_util.keystr(k): leaf.format for k, leaf in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, jmp.QuantizedArray))
          if isinstance(leaf, jmp.QuantizedArray)}


def _found(tx):
  state = tx.init(PARAMS)
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(state)]
  flags = position.position_leaves(tx.init, tx.update, PARAMS, len(paths))
  assert flags is not None
  return {p for p, f in zip(paths, flags) if f}


@pytest.mark.parametrize("name", STEPPERS)
def test_no_leaf_of_an_optimizer_that_steps_sets_a_position(name):
  assert _found(STEPPERS[name]()) == set()


def test_madgrad_and_cocob_set_positions_from_their_sums():
  assert {p for p in _found(contrib.madgrad(1e-2)) if "x0" not in p} == {"[1].s['b']", "[1].s['w']"}
  cocob = {p.split(".")[1].split("[")[0] for p in _found(contrib.cocob())}
  assert {"cumulative_gradients", "scale", "reward"} <= cocob


@pytest.mark.parametrize("under_jit", [False, True])
def test_int4_codes_madgrads_sums_in_int8_and_says_so(under_jit):
  tx = jmp.quantize_state(contrib.madgrad(1e-2), "int4", min_size=0)
  init = jax.jit(tx.init) if under_jit else tx.init
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = init(PARAMS)
  said = [str(w.message) for w in caught if "in 'int8', not 'int4'" in str(w.message)]
  assert len(said) == 1 and "1/s/b, 1/s/w" in said[0], said
  formats = _formats(state)
  assert formats == {".inner[1].grad_sum_sq['b']": "int4", ".inner[1].grad_sum_sq['w']": "int4",
                     ".inner[1].s['b']": "int8", ".inner[1].s['w']": "int8"}, formats
  # The update keeps each leaf's format, and the second call does not retrace.
  traces = Traces()
  step = jax.jit(traces(tx.update))
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  _, state = step(grads, state, PARAMS)
  _, state = step(grads, state, PARAMS)
  assert traces.count == 1
  assert _formats(state) == formats


def test_the_8bit_formats_and_adam_in_int4_are_left_alone():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    adam = jmp.quantize_state(optax.adam(1e-3), "int4", min_size=0).init(PARAMS)
    madgrad8 = jmp.quantize_state(contrib.madgrad(1e-2), "int8", min_size=0).init(PARAMS)
  assert set(_formats(adam).values()) == {"int4"}
  assert set(_formats(madgrad8).values()) == {"int8"}


def test_an_update_that_cannot_be_measured_makes_no_claim():
  # momo needs the loss value as an extra argument: no measurement, no leaf moved.
  tx = contrib.momo()
  n = len(jax.tree.leaves(tx.init(PARAMS)))
  assert position.position_leaves(tx.init, tx.update, PARAMS, n) is None
  # A state whose structure is not the one the caller has: no claim either.
  madgrad = contrib.madgrad(1e-2)
  n = len(jax.tree.leaves(madgrad.init(PARAMS)))
  assert position.position_leaves(madgrad.init, madgrad.update, PARAMS, n) is not None
  assert position.position_leaves(madgrad.init, madgrad.update, PARAMS, n + 1) is None


@pytest.mark.xfail(strict=True, reason=(
    "known limit of position.py: the gain is measured per step, and madgrad's momentum of "
    "0.99 on its position lowers it under 2 (nothing is moved to int8; its int4 loss is 1.8x "
    "float32's, int8's 1.00x). A fix must find s here and make this pass."))
def test_madgrad_with_a_heavy_momentum_converges_in_int4():
  import test_contrib_quantized as contrib_test  # its regression problem and training loop
  make = lambda: contrib.madgrad(1e-2, momentum=0.99)
  reference = float(contrib_test._train(make(), "madgrad")[1])
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    tx = jmp.quantize_state(make(), "int4", min_size=0)
  assert float(contrib_test._train(tx, "madgrad")[1]) <= contrib_test.FACTOR * reference

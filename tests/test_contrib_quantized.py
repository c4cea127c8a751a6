"""Every optimizer in ``optax.contrib`` through ``jmp.quantize_state(..., min_size=0)``.

optax's own tests (``tests/optax_alias_quantized.py``) cover the optimizers in
``optax``; this file covers ``optax.contrib``, found by listing the module: a
public function there is an optimizer under test (``OPTIMIZERS`` says how to
build it), a building block of one (``scale_by_<name>``, the state-holding
part of ``<name>``, which is tested), or one of ``NOT_OPTIMIZERS``, with the
reason. ``test_every_contrib_function_is_accounted_for`` fails on a name that
a new optax adds, until someone places it.

The problem: a linear regression (8 inputs, 16 outputs, noisy targets) trained
on random batches of 32 of its 256 rows for 300 steps, one ``lax.scan``. From
a first loss of 2.57, each optimizer in float32 ends between 0.0095 and 0.06
(the noise floor is 0.01). Wrapped in ``quantize_state`` with every state leaf
coded (``min_size=0``), in each format, its final full-data loss must be
within ``FACTOR`` of its float32 one, with finite params.
"""

import functools
import warnings
import inspect

import jax
import jax.numpy as jnp
import optax
from optax import contrib
import pytest

import jmp_lite as jmp

STEPS = 300
BATCH = 32
FACTOR = 1.5  # the coded optimizer's final loss over the float32 one's, at most
FORMATS = ("int8", "float8", "int4")


def _adam():
  return optax.adam(1e-2)


# How to build each optimizer: hyperparameters that reach the noise floor in float32.
OPTIMIZERS = {
    "acprop": lambda: contrib.acprop(1e-2),
    "ademamix": lambda: contrib.ademamix(1e-2),
    "adopt": lambda: contrib.adopt(1e-2),
    "cocob": contrib.cocob,
    "dadapt_adamw": contrib.dadapt_adamw,
    "dog": contrib.dog,
    "dowg": contrib.dowg,
    "dpsgd": lambda: contrib.dpsgd(0.05, l2_norm_clip=10.0, noise_multiplier=0.01, seed=0,
                                   momentum=0.9),
    "galore": lambda: contrib.galore(1e-2, rank=4, update_proj_gap=50),
    "madgrad": lambda: contrib.madgrad(1e-2),
    "mechanize": lambda: contrib.mechanize(_adam()),
    "momo": contrib.momo,
    "momo_adam": contrib.momo_adam,
    "muon": lambda: contrib.muon(1e-2),
    "prodigy": contrib.prodigy,
    "sam": lambda: contrib.sam(_adam(), optax.sgd(1e-2), opaque_mode=False),
    "schedule_free": lambda: contrib.schedule_free(optax.sgd(1e-1), 1e-1),
    "schedule_free_adamw": lambda: contrib.schedule_free_adamw(1e-2),
    "schedule_free_sgd": lambda: contrib.schedule_free_sgd(0.1),
    "simplified_ademamix": lambda: contrib.simplified_ademamix(3e-3, b1=0.9),  # 0.99: 0.46
    "sophia": lambda: contrib.sophia(1e-2),
    "split_real_and_imaginary": lambda: contrib.split_real_and_imaginary(_adam()),
}

# Public functions of optax.contrib that are not optimizers, and why.
NOT_OPTIMIZERS = {
    "differentially_private_aggregate": "clips and noises per-example gradients; its state is a "
                                        "PRNG key; dpsgd, tested, is it followed by sgd",
    "hutchinson_estimator_diag_hessian": "estimates a Hessian diagonal for sophia, tested",
    "normalize": "divides the gradients by their norm; no state",
    "reduce_on_plateau": "scales the updates by a factor from the loss; its state is scalars",
    "schedule_free_eval_params": "a function of a schedule-free state, not a transformation",
}

# The per-example gradients dpsgd aggregates (a leading batch axis on every leaf).
PER_EXAMPLE = frozenset({"dpsgd"})
# optax 0.2.8's dpsgd passes differentially_private_aggregate the seed that it deprecates.
MARKS = {"dpsgd": [pytest.mark.filterwarnings('ignore:"seed" is deprecated:DeprecationWarning')]}
# Extra arguments of update: the loss for momo's, the batch's objective for sophia's.
# (Only to these: sam's transparent update takes no extra arguments at all.)
EXTRA_ARGS = {"momo": ("value",), "momo_adam": ("value",), "sophia": ("obj_fn",)}


def _public_functions():
  return {name for name, obj in vars(contrib).items()
          if not name.startswith("_") and inspect.isfunction(obj)}


def test_every_contrib_function_is_accounted_for():
  functions = _public_functions()
  blocks = {n for n in functions if n.startswith("scale_by_")}
  assert {n[len("scale_by_"):] for n in blocks} <= set(OPTIMIZERS)  # each block's optimizer runs
  assert functions - blocks - set(NOT_OPTIMIZERS) == set(OPTIMIZERS)
  assert not set(NOT_OPTIMIZERS) & set(OPTIMIZERS)


def _problem():
  kx, kw, kb, kn, k1, k2 = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(kx, (256, 8))
  y = (x @ (jax.random.normal(kw, (8, 16)) / jnp.sqrt(8.0)) + jax.random.normal(kb, (16,))
       + 0.1 * jax.random.normal(kn, (256, 16)))
  params = {"w": 0.3 * jax.random.normal(k1, (8, 16)), "b": 0.1 * jax.random.normal(k2, (16,))}
  return x, y, params


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _train(tx, name):
  """Final params and full-data loss after ``STEPS`` steps of ``tx`` on random batches."""
  x, y, params = _problem()

  def step(carry, key):
    params, state = carry
    rows = jax.random.choice(key, x.shape[0], (BATCH,), replace=False)
    objective = functools.partial(_loss, x=x[rows], y=y[rows])
    value, grads = jax.value_and_grad(objective)(params)
    if name in PER_EXAMPLE:
      one = lambda p, xi, yi: _loss(p, xi[None], yi[None])
      grads = jax.vmap(jax.grad(one), (None, 0, 0))(params, x[rows], y[rows])
    extra = {"value": value, "obj_fn": objective}
    extra = {k: extra[k] for k in EXTRA_ARGS.get(name, ())}
    updates, state = tx.update(grads, state, params, **extra)
    return (optax.apply_updates(params, updates), state), None

  @jax.jit
  def train(params):
    keys = jax.random.split(jax.random.key(1), STEPS)
    (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), keys)
    return params, _loss(params, x, y)

  return train(params)


@functools.cache
def _float32_loss(name):
  _, loss = _train(OPTIMIZERS[name](), name)
  return float(loss)


# Known failures, as strict xfails (a fix must remove the entry). None since stop 50 in 8
# bits (D-Adaptation, whose step-size estimate reads the coded moments' sums, ended at 0.152
# against float32's 0.060 with int8's coarser non-negative code, and passes with the finer
# one), and since stop 56 in 4 bits: madgrad and cocob, whose params are set by running sums
# of gradients (a dual average), ended at 0.059 and 0.084 against float32's 0.0095 when
# those sums were coded in 4 bits; quantize_state now finds such leaves on the update
# (position.py) and codes them in 8 bits, with a warning (POSITION_WARNED).
OPEN: dict[tuple[str, str], str] = {}
# The optimizers whose "int4" state quantize_state codes partly in "int8", and says so.
POSITION_WARNED = {"madgrad", "cocob"}


@pytest.mark.parametrize("name,fmt", [
    pytest.param(n, f, id=f"{n}-{f}",
                 marks=[pytest.mark.xdist_group(f"contrib_{n}"), *MARKS.get(n, []),
                        *([pytest.mark.xfail(strict=True, reason=OPEN[n, f])]
                          if (n, f) in OPEN else [])])
    for n in OPTIMIZERS for f in FORMATS])
def test_contrib_optimizer_converges_with_coded_state(name, fmt):
  reference = _float32_loss(name)
  assert reference < 0.1, f"{name} in float32 ends at {reference:.3g}: retune OPTIMIZERS"
  tx = jmp.quantize_state(OPTIMIZERS[name](), fmt, min_size=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params, loss = _train(tx, name)
    state_shapes = jax.eval_shape(tx.init, _problem()[2])
  nothing_coded = [w for w in caught if "codes no leaf" in str(w.message)]
  in_int8 = [w for w in caught if "in 'int8', not 'int4'" in str(w.message)]
  for w in caught:
    if w not in nothing_coded + in_int8:  # any other warning fails, as the suite's filter would
      raise AssertionError(f"{name} {fmt}: unexpected warning {w.message}")
  assert bool(in_int8) == (fmt == "int4" and name in POSITION_WARNED), (name, fmt, in_int8)
  coded = [x for x in jax.tree.leaves(state_shapes,
                                      is_leaf=lambda v: isinstance(v, jmp.QuantizedArray))
           if isinstance(x, jmp.QuantizedArray)]
  # The warning says the truth: it fires exactly when the state holds no coded leaf
  # (dog, dowg and schedule-free keep only copies of the params and scalars).
  assert bool(nothing_coded) == (not coded), (name, fmt, len(nothing_coded), len(coded))
  for leaf in jax.tree.leaves(params):
    assert bool(jnp.all(jnp.isfinite(leaf))), f"{name} {fmt}: non-finite params"
  assert float(loss) <= FACTOR * reference, (
      f"{name} {fmt}: final loss {float(loss):.3g}, float32 {reference:.3g}")

"""The train-step variants the benchmarks compare, and their shared settings.

Every variant trains the same model on the same batch with the same Adam, and
is jitted with its state donated:

  fp32_highest  GPU only: fp32 under ``jax.default_matmul_precision("highest")``.
  fp32          plain optax: grad, adam, apply (default matmul precision).
  bf16          jmp_lite ``make_train_step``, ``mixed_bfloat16``, Adam wrapped in
                ``static_loss_scaling(.., 1.0)`` (the cheap skip-on-non-finite).
  f16_dynamic   jmp_lite ``make_train_step``, ``mixed_float16``,
                ``dynamic_loss_scaling(adam)``.
  f16_autocast  the same with ``make_train_step(..., autocast=True)``: matmuls
                in float16, the float32-list ops (softmax, normalisation
                statistics, the loss...) in float32. Not in the default set;
                name it: ``--variants f16_dynamic,f16_autocast``.
  bf16_autocast ``bf16`` with ``make_train_step(..., autocast=True)``.
  bf16_fp8      the same with ``fp8=Float8Recipe(min_size=0)``: every matmul on
                float8 operands, whatever its size (per-tensor current
                scaling), compared to ``bf16_autocast``.
                Without a GPU with FP8 tensor cores XLA emulates the float8
                dots, so on a CPU it is slower, not faster. Not in the default
                set; name it: ``--variants bf16_autocast,bf16_fp8``.
  bf16_fp8_rowwise  ``bf16_fp8`` with ``Float8Recipe(min_size=0, scaling="rowwise")``: a scale
                per row of each operand. Not in the default set.
  bf16_fp8_amaxes  ``bf16_fp8`` with ``TrainState.create(weight_amaxes=True)``: the
                weights' amaxes kept in the state, written with the masters,
                instead of taken from the weights at the top of each step.
                Not in the default set.
  fp32_step     jmp_lite ``make_train_step`` with the ``float32`` policy and plain
                ``adam``: the library's step with no mixed precision, against
                ``fp32``. Not in the default set.
  bf16_lean     ``bf16`` with bfloat16 master weights
                (``TrainState.create(master_dtype=jnp.bfloat16,
                rounding="stochastic")``): 6 bytes per Adam parameter instead
                of 12. Not in the default set.
  f16_noscale   the overhead baseline, written by hand with no loss scaling and
                no skip logic at all: cast to f16, grad, adam, apply.
  jmp_dynamic   the classic hand-written jmp step: ``jmp.DynamicLossScale``,
                scale, grad, unscale, ``all_finite``, ``adjust``, ``select_tree``
                over params and optimizer state.
  flax_dynamic  ``flax.training.dynamic_scale.DynamicScale.value_and_grad``,
                then ``jnp.where`` over params and optimizer state.

The four dynamic-scaling variants use the same init scale (2**15), growth
interval (2000), factors (2, 0.5), model, f16 policy and Adam.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from benchmarks import models

VARIANTS = (
    "fp32_highest",
    "fp32",
    "bf16",
    "f16_dynamic",
    "f16_autocast",
    "bf16_autocast",
    "bf16_fp8",
    "bf16_fp8_rowwise",
    "bf16_fp8_amaxes",
    "fp32_step",
    "bf16_lean",
    "f16_noscale",
    "jmp_dynamic",
    "flax_dynamic",
)
LABELS = {
    "fp32_highest": "fp32, precision=highest (optax)",
    "fp32": "fp32 (optax)",
    "bf16": "jmp_lite bf16",
    "f16_dynamic": "jmp_lite f16 + dynamic scaling",
    "f16_autocast": "jmp_lite f16 + dynamic scaling, autocast",
    "bf16_autocast": "jmp_lite bf16, autocast",
    "bf16_fp8": "jmp_lite bf16, autocast + FP8 matmuls",
    "bf16_fp8_rowwise": "jmp_lite bf16, autocast + FP8 matmuls, rowwise scales",
    "bf16_fp8_amaxes": "jmp_lite bf16, autocast + FP8 matmuls, amaxes in the state",
    "fp32_step": "jmp_lite fp32 policy, plain adam",
    "bf16_lean": "jmp_lite bf16, bf16 masters (stochastic)",
    "f16_noscale": "f16, no scaling (hand-written)",
    "jmp_dynamic": "jmp f16 + dynamic (hand-written)",
    "flax_dynamic": "Flax DynamicScale f16",
}

# What ``--variants all`` runs (``fp32_highest`` only on a GPU).
ONLY_WHEN_NAMED = ("f16_autocast", "bf16_autocast", "bf16_fp8", "bf16_fp8_rowwise",
                   "bf16_fp8_amaxes", "fp32_step", "bf16_lean")
DEFAULT_VARIANTS = tuple(n for n in VARIANTS if n not in ONLY_WHEN_NAMED)

LEARNING_RATE = 1e-3
INIT_SCALE = 2.0**15
GROWTH_INTERVAL = 2000


@dataclasses.dataclass
class Variant:
  """One way of writing the train step.

  Attributes:
    name: the key in :data:`VARIANTS`.
    fn: the jitted ``step(state, batch) -> (state, out)``, state donated.
    init: returns a fresh state (its own copy of the initial params).
    scale_of: the current loss scale in a state, or None (no scaling).
  """

  name: str
  fn: Callable[[Any, Any], Any]
  init: Callable[[], Any]
  scale_of: Callable[[Any], Any] | None = None


def copy_tree(tree: Any) -> Any:
  """A copy of every array leaf, so that donating it leaves ``tree`` intact.

  Examples:
    >>> import jax.numpy as jnp
    >>> a = {"w": jnp.ones(2)}
    >>> b = copy_tree(a)
    >>> b["w"] is a["w"], bool((b["w"] == a["w"]).all())
    (False, True)
  """
  return jax.tree.map(jnp.array, tree)


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts the floating leaves of ``tree`` to ``dtype``; other leaves pass through.

  Examples:
    >>> import jax.numpy as jnp
    >>> out = cast_floating({"x": jnp.ones(2), "y": jnp.arange(2)}, jnp.float16)
    >>> out["x"].dtype, out["y"].dtype
    (dtype('float16'), dtype('int32'))
  """
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )


def plain_step(loss_fn, tx, compute_dtype=None, precision=None):
  """fp32 (compute_dtype None) or the hand-written f16 step without scaling."""

  def step(state, batch):
    params, opt_state = state
    if compute_dtype is not None:
      batch = cast_floating(batch, compute_dtype)

    def f(p):
      if compute_dtype is not None:
        p = cast_floating(p, compute_dtype)
      return loss_fn(p, batch).astype(jnp.float32)

    if precision is None:
      loss, grads = jax.value_and_grad(f)(params)
    else:
      with jax.default_matmul_precision(precision):
        loss, grads = jax.value_and_grad(f)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def jmp_step(loss_fn, tx):
  """The classic hand-written jmp pattern (jmp's README / examples).

  The scale travels as two arrays and is rebuilt into a ``jmp.DynamicLossScale``
  inside the step: jmp 0.0.4's pytree flattening breaks ``jit(...).lower()``
  on current JAX, which the compiled-memory measurement needs.

  Returns:
    ``(step, init_scale)``.
  """
  import jmp  # pylint: disable=import-outside-toplevel

  policy = jmp.get_policy("params=float32,compute=float16,output=float32")

  def step(state, batch):
    params, opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter, period=GROWTH_INTERVAL, factor=2)
    batch = policy.cast_to_compute(batch)

    def f(p):
      loss = policy.cast_to_output(loss_fn(policy.cast_to_compute(p), batch))
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(f, has_aux=True)(params)
    grads = loss_scale.unscale(policy.cast_to_param(grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

  def init_scale():
    return (jnp.asarray(INIT_SCALE, jnp.float32), jnp.zeros((), jnp.int32))

  return step, init_scale


def flax_step(loss_fn, tx):
  """Flax's DynamicScale pattern (flax.training.dynamic_scale docstring).

  Returns:
    ``(step, init_scale)``.
  """

  def step(state, batch):
    params, opt_state, dyn_scale = state
    batch = cast_floating(batch, jnp.float16)

    def f(p):
      return loss_fn(cast_floating(p, jnp.float16), batch).astype(jnp.float32)

    dyn_scale, finite, loss, grads = dyn_scale.value_and_grad(f)(params)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jnp.where, finite)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return (params, opt_state, dyn_scale), loss

  def init_scale():
    from flax.training import dynamic_scale  # pylint: disable=import-outside-toplevel

    return dynamic_scale.DynamicScale(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=GROWTH_INTERVAL,
        fin_steps=jnp.zeros((), jnp.int32),
        scale=jnp.asarray(INIT_SCALE, jnp.float32),
    )

  return step, init_scale


def make_variant(name: str, problem: models.Problem) -> Variant:
  """Builds variant ``name`` for ``problem``.

  Args:
    name: one of :data:`VARIANTS`.
    problem: the model, its initial params, its batch and its loss.

  Returns:
    The :class:`Variant`; its ``init`` copies ``problem.params``.

  Raises:
    ValueError: for an unknown ``name``.
  """
  import jmp_lite  # pylint: disable=import-outside-toplevel

  tx = optax.adam(LEARNING_RATE)
  params = problem.params
  jit = functools.partial(jax.jit, donate_argnums=(0,))

  def plain_init():
    p = copy_tree(params)
    return (p, tx.init(p))

  if name in ("fp32", "fp32_highest", "f16_noscale"):
    step = plain_step(
        problem.loss_fn,
        tx,
        compute_dtype=jnp.float16 if name == "f16_noscale" else None,
        precision="highest" if name == "fp32_highest" else None,
    )
    return Variant(name, jit(step), plain_init)
  if name == "fp32_step":
    return Variant(
        name,
        jmp_lite.make_train_step(problem.loss_fn, jmp_lite.get_policy("float32")),
        lambda: jmp_lite.TrainState.create(params=copy_tree(params), tx=tx),
    )
  if name in ("bf16", "f16_dynamic", "f16_autocast", "bf16_autocast", "bf16_fp8", "bf16_fp8_rowwise",
              "bf16_fp8_amaxes", "bf16_lean"):
    if name.startswith("bf16"):
      policy = jmp_lite.get_policy("mixed_bfloat16")
      lib_tx = jmp_lite.static_loss_scaling(tx, 1.0)
    else:
      policy = jmp_lite.get_policy("mixed_float16")
      lib_tx = jmp_lite.dynamic_loss_scaling(
          tx, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
      )
    # Every matmul in FP8 (min_size=0): the steps measure all-FP8 training, whatever the sizes.
    fp8_recipes = {"bf16_fp8": jmp_lite.Float8Recipe(min_size=0),
                   "bf16_fp8_rowwise": jmp_lite.Float8Recipe(min_size=0, scaling="rowwise"),
                   "bf16_fp8_amaxes": jmp_lite.Float8Recipe(min_size=0)}
    create_options: dict[str, Any] = {}  # TrainState.create's, beyond params and tx.
    if name == "bf16_lean":
      create_options = dict(master_dtype=jnp.bfloat16, rounding="stochastic", key=jax.random.key(0))
    elif name == "bf16_fp8_amaxes":
      create_options = dict(weight_amaxes=True)
    return Variant(
        name,
        # Jitted, donates the state.
        jmp_lite.make_train_step(problem.loss_fn, policy, autocast="autocast" in name or "fp8" in name,
                                 fp8=fp8_recipes.get(name)),
        lambda: jmp_lite.TrainState.create(params=copy_tree(params), tx=lib_tx, **create_options),
        lambda s: jmp_lite.loss_scale_of(s.opt_state),
    )
  if name in ("jmp_dynamic", "flax_dynamic"):
    step, init_scale = (jmp_step if name == "jmp_dynamic" else flax_step)(problem.loss_fn, tx)

    def init():
      p, opt_state = plain_init()
      return (p, opt_state, init_scale())

    if name == "jmp_dynamic":
      scale_of = lambda s: s[2][0]  # noqa: E731
    else:
      scale_of = lambda s: s[2].scale  # noqa: E731
    return Variant(name, jit(step), init, scale_of)
  raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")


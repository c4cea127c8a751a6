"""The optimizers compared, on two sides, and how each side trains a problem.

The JAX side runs optax transformations (float32, or wrapped in
``jmp.quantize_state``), one jitted update per step. The torch side
runs ``torch.optim.AdamW`` and torchao's ``AdamW8bit``, ``AdamWFp8`` and ``AdamW4bit``
eagerly (``torch.compile``, which torchao calls in each step, replaced by the
identity), fed each step the gradients of its own parameters by the same
jitted JAX function of the same loss and batch: both sides train the same
function, from the same weights, on the same batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp
from benchmarks.optim_oracle import problems as problems_lib

INSTALL = "pip install torch torchao"
PROG = "python -m benchmarks.optim_oracle"

# ``after_step(t, params)``: called by the trainers after step ``t``'s update.
AfterStep = Callable[[int, dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One optimizer of the comparison.

  Attributes:
    side: ``"jax"`` or ``"torch"``.
    family: ``"adamw"``, ``"lion"`` or ``"sgdm"``.
    format: ``None`` (float32 state), ``"int8"``, ``"float8"`` or ``"int4"``.
    what: the call, for people.
    rival: the torchao optimizer it is compared with, if any.
  """

  side: str
  family: str
  format: str | None
  what: str
  rival: str | None = None


VARIANTS = {
    "optax_adamw": Variant("jax", "adamw", None, "optax.adamw, float32 state"),
    "jmp_int8": Variant("jax", "adamw", "int8", "jmp.quantize_state(optax.adamw, 'int8')",
                        "torchao_adamw8bit"),
    "jmp_float8": Variant("jax", "adamw", "float8", "jmp.quantize_state(optax.adamw, 'float8')",
                          "torchao_adamwfp8"),
    "jmp_int4": Variant("jax", "adamw", "int4", "jmp.quantize_state(optax.adamw, 'int4')",
                        "torchao_adamw4bit"),
    "torch_adamw": Variant("torch", "adamw", None, "torch.optim.AdamW, float32 state"),
    "torchao_adamw8bit": Variant("torch", "adamw", "int8", "torchao.optim.AdamW8bit"),
    "torchao_adamwfp8": Variant("torch", "adamw", "float8", "torchao.optim.AdamWFp8"),
    "torchao_adamw4bit": Variant("torch", "adamw", "int4", "torchao.optim.AdamW4bit"),
    "optax_lion": Variant("jax", "lion", None, "optax.lion (lr / 10), float32 state"),
    "jmp_lion_int8": Variant("jax", "lion", "int8", "jmp.quantize_state(optax.lion, 'int8')"),
    "jmp_lion_float8": Variant("jax", "lion", "float8",
                               "jmp.quantize_state(optax.lion, 'float8')"),
    "jmp_lion_int4": Variant("jax", "lion", "int4", "jmp.quantize_state(optax.lion, 'int4')"),
    "optax_sgdm": Variant("jax", "sgdm", None, "optax.sgd(10 lr, momentum=0.9), float32 state"),
    "jmp_sgdm_int8": Variant("jax", "sgdm", "int8",
                             "jmp.quantize_state(optax.sgd(momentum=0.9), 'int8')"),
    "jmp_sgdm_float8": Variant("jax", "sgdm", "float8",
                               "jmp.quantize_state(optax.sgd(momentum=0.9), 'float8')"),
    "jmp_sgdm_int4": Variant("jax", "sgdm", "int4",
                             "jmp.quantize_state(optax.sgd(momentum=0.9), 'int4')"),
}
RIVALS = {n: v.rival for n, v in VARIANTS.items() if v.rival is not None}


def reference(name: str) -> str:
  """The float32 variant of ``name``'s side and family, which its drift is measured from."""
  v = VARIANTS[name]
  return next(n for n, r in VARIANTS.items()
              if (r.side, r.family, r.format) == (v.side, v.family, None))


def import_torch() -> tuple[Any, Any]:
  """``(torch, torchao.optim)``, or a ``SystemExit`` that says how to install them.

  torch is set to one thread: its eager steps on these small tensors gain
  nothing from more, and its OpenMP threads, spinning between ops while JAX's
  threads compute the gradients, made torchao's steps 20x slower.
  """
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import torchao.optim  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SystemExit(f"{PROG} compares against torchao and needs torch and torchao, which are "
                     f"not installed ({e}). Install them with `{INSTALL}` (or `pip install -e "
                     f"'.[oracle]'`), in a separate environment if you like.") from e
  torch.set_num_threads(1)
  return torch, torchao.optim


@contextlib.contextmanager
def eager_torch_compile(torch: Any) -> Iterator[None]:
  """``torch.compile`` as the identity while torchao steps: it runs eagerly on the CPU."""
  original = torch.compile
  torch.compile = lambda fn=None, **kwargs: fn
  try:
    yield
  finally:
    torch.compile = original


# ------------------------------------------------------------------ the JAX side


def make_tx(name: str, lr: optax.ScalarOrSchedule, weight_decay: float
            ) -> optax.GradientTransformation:
  """``name``'s optax transformation (lion at ``lr / 10``, sgd at ``10 lr``).

  Raises:
    ValueError: ``lr`` is a schedule and ``name`` is not an AdamW.
  """
  v = VARIANTS[name]
  if callable(lr) and v.family != "adamw":
    raise ValueError(f"a learning-rate schedule is for the AdamW variants, got {name!r}")
  if v.family == "adamw":
    tx = optax.adamw(lr, weight_decay=weight_decay)
  elif v.family == "lion":
    tx = optax.lion(lr / 10, weight_decay=weight_decay)
  else:
    tx = optax.sgd(10 * lr, momentum=0.9)
  return tx if v.format is None else jmp.quantize_state(tx, v.format)


def coded_leaves(state: Any, params: dict[str, Any]) -> list[str]:
  """The parameters whose state ``quantize_state`` coded (a ``QuantizedArray`` under their key)."""
  found = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, jmp.QuantizedArray))[0]:
    if isinstance(leaf, jmp.QuantizedArray):
      where = jax.tree_util.keystr(path)
      found |= {k for k in params if where.endswith(f"[{k!r}]")}
  return sorted(found)


def grad_function(problem: problems_lib.Problem) -> Callable[..., Any]:
  """``grads(params, x, y, idx)``: the gradient on the batch ``x[idx], y[idx]``, jitted.

  Both sides call this one compiled function every step, so their gradients of
  the same parameters are the same bits.
  """
  loss = problems_lib.make_loss(problem)
  return jax.jit(lambda p, x, y, idx: jax.grad(loss)(p, x[idx], y[idx]))


def jax_trainer(name: str, problem: problems_lib.Problem, grads: Callable[..., Any],
                lr: optax.ScalarOrSchedule | None = None,
                tx: optax.GradientTransformation | None = None) -> Callable[..., Any]:
  """``train(instance, x, y, after_step=None) -> (final params, coded leaves)``, ``x, y`` the pool.

  The update is compiled once and reused for each seed; the steps run in a
  Python loop, which compiles far less than a ``lax.scan`` of the whole step
  for every variant would (the gradient is compiled once per problem).

  Args:
    name: the variant.
    problem: the problem (its lr, unless ``lr``, and its weight decay).
    grads: :func:`grad_function`'s function.
    lr: a learning rate or optax schedule in place of the problem's; a
      schedule gets the count of earlier updates, so step ``t`` uses
      ``lr(t)``.
    tx: a transformation in place of ``name``'s (a study's variant of it).

  ``after_step(t, params)``, if given, is called after step ``t``'s update
  with the parameters as JAX arrays.
  """
  if tx is None:
    tx = make_tx(name, problem.lr if lr is None else lr, problem.weight_decay)

  @jax.jit
  def update(p: Any, s: Any, g: Any) -> Any:
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def train(inst: problems_lib.Instance, x: Any, y: Any, after_step: AfterStep | None = None
            ) -> tuple[dict[str, np.ndarray], list[str]]:
    params = {k: jnp.asarray(v) for k, v in inst.params.items()}
    state = tx.init(params)  # outside any jit: init may read the values it is given
    coded = coded_leaves(state, params)
    p = params
    for t, idx in enumerate(inst.batches):
      p, state = update(p, state, grads(p, x, y, idx))
      if after_step is not None:
        after_step(t, p)
    return {k: np.asarray(v) for k, v in p.items()}, coded

  return train


# ------------------------------------------------------------------ the torch side


def torch_optimizer(name: str, params: list[Any], lr: float, weight_decay: float) -> Any:
  """``name``'s torch optimizer over ``params`` (betas, eps: the defaults, as optax's)."""
  torch, ao = import_torch()
  make = {"torch_adamw": torch.optim.AdamW, "torchao_adamw8bit": ao.AdamW8bit,
          "torchao_adamwfp8": ao.AdamWFp8, "torchao_adamw4bit": ao.AdamW4bit}[name]
  return make(params, lr=lr, weight_decay=weight_decay)


def torch_coded(opt: Any, params: dict[str, Any]) -> list[str]:
  """The parameters whose ``exp_avg`` the torch optimizer holds as a torchao subclass."""
  torch, _ = import_torch()
  return sorted(k for k, p in params.items()
                if type(opt.state[p].get("exp_avg")) not in (torch.Tensor, type(None)))


def set_lr(opt: Any, lr: float) -> None:
  """Sets every param group's learning rate to ``lr`` for the next ``opt.step()``.

  ``torch.optim.AdamW`` keeps a Python float in ``group["lr"]``; torchao's
  optimizers turn it into a float32 tensor when the group is added, pass that
  tensor into each step and raise if it is replaced by a float, so theirs is
  filled in place.
  """
  torch, _ = import_torch()
  for group in opt.param_groups:
    if isinstance(group["lr"], torch.Tensor):
      group["lr"].fill_(lr)
    else:
      group["lr"] = lr


def torch_train(name: str, problem: problems_lib.Problem, inst: problems_lib.Instance,
                grads: Callable[..., Any], x: Any, y: Any, lrs: Sequence[float] | None = None,
                after_step: AfterStep | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
  """Trains ``inst`` with ``name``, fed by :func:`grad_function` ``grads`` on the pool ``x, y``.

  Args:
    name: the variant.
    problem: the problem (its lr, unless ``lrs``, and its weight decay).
    inst: the instance: initial weights and batches.
    grads: :func:`grad_function`'s function.
    x, y: the training pool, on the device.
    lrs: step ``t``'s learning rate is ``lrs[t]`` (set by :func:`set_lr`
      before each step), in place of the problem's.
    after_step: called as ``after_step(t, params)`` after step ``t``, with the
      parameters as NumPy views (valid until the next step).

  Returns:
    The final parameters and the names of those whose state torchao coded.
  """
  torch, _ = import_torch()
  p = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in inst.params.items()}
  opt = torch_optimizer(name, list(p.values()), problem.lr, problem.weight_decay)
  with eager_torch_compile(torch):
    for t, idx in enumerate(inst.batches):
      g = grads({k: v.detach().numpy().copy() for k, v in p.items()}, x, y, idx)
      for k, v in p.items():
        v.grad = torch.from_numpy(np.array(g[k]))
      if lrs is not None:
        set_lr(opt, float(lrs[t]))
      opt.step()
      if after_step is not None:
        after_step(t, {k: v.detach().numpy() for k, v in p.items()})
  return {k: v.detach().numpy().copy() for k, v in p.items()}, torch_coded(opt, p)

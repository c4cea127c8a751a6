"""The mixed-magnitude sweep: Adam's largest step when one block holds gradients of 1 and ``ratio``.

For each ratio (log-spaced from 1 to 1e-8), ``rows`` blocks of 256: even
columns see gradients of 1, odd columns of ``ratio``, each times uniform noise
in [0.5, 1.5] drawn anew every step (the same noise for every optimizer).
All ratios are one ``(ratios, rows, 256)`` parameter: both
``quantize_state`` and torchao put each row in a block of its own (two of
128 in 4 bits), so the ratios never share a block. Each optimizer runs Adam (no weight decay) for
``steps`` steps at ``lr``; the result is its largest update, per ratio, over
the same side's float32 Adam's.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp
from benchmarks.optim_oracle import variants as variants_lib

NAMES = ("optax_adamw", "jmp_int8", "jmp_float8", "jmp_int4", "torch_adamw",
         "torchao_adamw8bit", "torchao_adamwfp8", "torchao_adamw4bit")
BLOCK = 256
MIN_ELEMENTS = 4096  # torchao's threshold, and quantize_state's default min_size

Stepper = Callable[[np.ndarray], None]


def ratios(n: int) -> np.ndarray:
  """``n`` ratios log-spaced from 1 to 1e-8.

  Examples:
    >>> r = ratios(33)
    >>> float(r[0]), float(r[4]), float(r[-1])
    (1.0, 0.1, 1e-08)
  """
  return np.logspace(0.0, -8.0, n)


def magnitudes(rs: np.ndarray, rows: int) -> np.ndarray:
  """``(ratios, rows, 256)``: 1 in even columns, the ratio in odd ones."""
  odd = (np.arange(BLOCK) % 2 == 1)[None, None, :]
  return np.where(odd, rs[:, None, None], 1.0).repeat(rows, axis=1).astype(np.float32)


def gradients(mags: np.ndarray, seed: int, step: int) -> np.ndarray:
  """Step ``step``'s gradients: ``mags`` times uniform noise in [0.5, 1.5]."""
  noise = np.random.default_rng([seed, step]).uniform(0.5, 1.5, mags.shape)
  return (mags * noise).astype(np.float32)


def jax_stepper(name: str, params: np.ndarray, lr: float) -> tuple[Stepper, Callable[[], Any]]:
  """``(step(grads), largest())`` for the JAX variant ``name``: largest |update| per ratio."""
  fmt = variants_lib.VARIANTS[name].format
  tx = optax.adam(lr)
  tx = tx if fmt is None else jmp.quantize_state(tx, fmt)
  p = jnp.asarray(params)
  carry = [p, tx.init(p), jnp.zeros(params.shape[0], jnp.float32)]

  @jax.jit
  def step(p: Any, s: Any, top: Any, g: Any) -> Any:
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, jnp.maximum(top, jnp.abs(u).max(axis=(1, 2)))

  def run(g: np.ndarray) -> None:
    carry[:] = step(*carry, g)

  return run, lambda: np.asarray(carry[2])


def torch_stepper(name: str, params: np.ndarray, lr: float) -> tuple[Stepper, Callable[[], Any]]:
  """The same for a torch optimizer, stepped eagerly; the update is ``p_after - p_before``."""
  torch, _ = variants_lib.import_torch()
  p = torch.nn.Parameter(torch.tensor(params))
  opt = variants_lib.torch_optimizer(name, [p], lr, 0.0)
  top = torch.zeros(params.shape[0])

  def run(g: np.ndarray) -> None:
    before = p.detach().clone()
    p.grad = torch.from_numpy(g)
    with variants_lib.eager_torch_compile(torch):
      opt.step()
    torch.maximum(top, (p.detach() - before).abs().amax(dim=(1, 2)), out=top)

  return run, lambda: top.numpy().copy()


def run_sweep(names: list[str], n_ratios: int, rows: int, steps: int, lr: float, seed: int
              ) -> dict[str, Any]:
  """Every variant in ``names`` on the sweep, stepped together on the same gradients.

  Returns:
    A JSON-ready dict: the ratios, and per variant its largest update per
    ratio (``largest``) and that over its side's float32 Adam's (``vs_fp32``).
  """
  if n_ratios * rows * BLOCK < MIN_ELEMENTS:
    raise ValueError(f"the sweep's parameter must hold at least {MIN_ELEMENTS} elements, or "
                     f"neither side codes it; got {n_ratios} ratios x {rows} rows of {BLOCK}")
  start = time.perf_counter()
  rs = ratios(n_ratios)
  mags = magnitudes(rs, rows)
  params0 = (0.1 * np.random.default_rng(seed).standard_normal(mags.shape)).astype(np.float32)
  runners = {n: (jax_stepper if variants_lib.VARIANTS[n].side == "jax" else torch_stepper)(
      n, params0, lr) for n in names}
  for t in range(steps):
    g = gradients(mags, seed, t)
    for step, _ in runners.values():
      step(g)
  largest = {n: largest() for n, (_, largest) in runners.items()}
  out = {n: dict(largest=[float(x) for x in v],
                 vs_fp32=[float(x) for x in v / largest[variants_lib.reference(n)]])
         for n, v in largest.items()}
  return dict(ratios=[float(r) for r in rs], rows=rows, steps=steps, lr=lr, variants=out,
              seconds=time.perf_counter() - start)

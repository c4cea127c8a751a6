"""The cooldown stress test: a warmup-stable-decay schedule to lr 0, on the oracle's Transformer.

A coded optimizer state is hardest to trust at the end of a run: the learning
rate falls, each step should only settle the weights, and an error in the
moments that the peak lr hid can still push the loss up. The issue's test: the
held-out loss never rises more than 1% while the lr falls to 0.

The problem is the matrix's ``transformer_gelu`` (weight decay 1e-2), run for
``steps`` (1,000 by default, 5x the matrix's 200) at a peak lr of
:data:`PEAK_LR`, 3x the matrix's constant 1e-3. The schedule, for ``steps``
steps ``t = 0 .. steps - 1`` (:func:`lr_values`)::

  warmup = max(1, round(0.05 steps)); start = steps - max(2, round(0.10 steps))
  lr(t) = PEAK_LR * t / warmup                        for t < warmup
        = PEAK_LR                                     for warmup <= t < start
        = PEAK_LR * (steps - 1 - t) / (steps - 1 - start)  for t >= start (0 at the last step)

Both sides take step ``t`` at the same float32 ``lr(t)``, one table of
values: the JAX side hands ``optax.adamw`` a schedule that reads it at optax's
count (the updates before the step, :func:`schedule`); the torch side sets
each param group's lr to it before its ``t``-th ``step()``
(:func:`.variants.set_lr`). Not optax's ``join_schedules`` of
``linear_schedule``s: jitted, XLA turns their division by the number of steps
into a multiplication by its float32 reciprocal, so the decay ends near
±1e-11 instead of 0 (-8.9e-11 for a decay of 4 steps, 2.8e-12 for 100) and
other steps differ from their eager values in the last bit.

Both start from the same weights and get the same jitted gradient on the same
batches, as in the matrix (:mod:`.variants`).

Measured (:func:`run_variant`): the held-out loss when the decay starts and
after 11 steps evenly spaced from its first step to the last
(:func:`eval_points`). Per seed (:func:`seed_numbers`): the largest rise, the
most a loss rose over the lowest seen before it in the decay
(:func:`largest_rise`); the final loss, also over the same side's float32
AdamW's; and whether it diverged (:func:`diverged`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.optim_oracle import problems as problems_lib
from benchmarks.optim_oracle import variants as variants_lib

PROBLEM = "transformer_gelu"
STEPS = 1000
# 3x transformer_gelu's constant 1e-3 in the matrix: a harder schedule, whose
# stable phase moves the weights further and whose decay falls from higher.
PEAK_LR = 3e-3
WARMUP_FRACTION = 0.05
DECAY_FRACTION = 0.10
DECAY_POINTS = 11  # evaluations from the decay's first step to the last, besides its start
DIVERGED_FACTOR = 2.0  # a decay loss above this times the decay start's has diverged
NAMES = ("optax_adamw", "jmp_int8", "jmp_float8", "jmp_int4", "torch_adamw",
         "torchao_adamw8bit", "torchao_adamwfp8", "torchao_adamw4bit")
MIN_STEPS = 20


def variant_names(formats: Sequence[str]) -> list[str]:
  """The variants the part runs in ``formats``, with both float32 references."""
  return [n for n in NAMES if variants_lib.VARIANTS[n].format in (None, *formats)]


def phases(steps: int) -> tuple[int, int]:
  """``(warmup, start)``: the warmup's steps and the decay's first step.

  Raises:
    ValueError: fewer than :data:`MIN_STEPS` steps.

  Examples:
    >>> phases(1000)
    (50, 900)
  """
  if steps < MIN_STEPS:
    raise ValueError(f"the cooldown needs at least {MIN_STEPS} steps, got {steps}")
  return max(1, round(WARMUP_FRACTION * steps)), steps - max(2, round(DECAY_FRACTION * steps))


def lr_values(steps: int) -> np.ndarray:
  """``lr(t)`` for ``t = 0 .. steps - 1`` (the module's pseudocode), in float64, rounded to float32.

  Examples:
    >>> lrs = lr_values(1000)
    >>> (1000 * lrs[[0, 25, 50, 899, 900, 999]]).round(6).tolist()  # in units of 1e-3
    [0.0, 1.5, 3.0, 3.0, 3.0, 0.0]
  """
  warmup, start = phases(steps)
  t = np.arange(steps, dtype=np.float64)
  lr = np.where(t < start, np.minimum(t / warmup, 1.0), (steps - 1 - t) / (steps - 1 - start))
  return (PEAK_LR * lr).astype(np.float32)


def schedule(lrs: np.ndarray) -> optax.Schedule:
  """An optax schedule that reads ``lrs[count]`` (the last value past the end), eager or jitted."""
  table = jnp.asarray(lrs, jnp.float32)
  return lambda count: table[jnp.clip(count, 0, len(lrs) - 1)]


def eval_points(steps: int) -> list[int]:
  """The update counts after which the loss is measured: the decay's start, then 11 of its steps.

  Examples:
    >>> eval_points(1000)
    [900, 901, 911, 921, 931, 941, 951, 960, 970, 980, 990, 1000]
  """
  _, start = phases(steps)
  after = np.round(np.linspace(start, steps - 1, DECAY_POINTS)).astype(int) + 1
  return [start, *sorted(set(after.tolist()))]


def largest_rise(losses: Sequence[float]) -> float:
  """The largest ``loss[i] / min(loss[:i + 1]) - 1``: how far a loss rose over the lowest before it.

  NaN if a loss is not finite.

  Examples:
    >>> round(largest_rise([1.0, 0.9, 0.95, 0.8]), 4)
    0.0556
  """
  a = np.asarray(losses, np.float64)
  if not np.all(np.isfinite(a)):
    return float("nan")
  return float(np.max(a / np.minimum.accumulate(a)) - 1.0)


def diverged(losses: Sequence[float]) -> bool:
  """A loss that is not finite, or above :data:`DIVERGED_FACTOR` times the first one.

  Examples:
    >>> diverged([1.0, 1.9]), diverged([1.0, 2.1]), diverged([1.0, float("nan")])
    (False, True, True)
  """
  a = np.asarray(losses, np.float64)
  return bool(not np.all(np.isfinite(a)) or np.any(a > DIVERGED_FACTOR * a[0]))


def run_variant(name: str, seeds: list[int], steps: int = STEPS) -> dict[str, Any]:
  """``name`` through the schedule at each seed: its held-out losses at :func:`eval_points`.

  Returns:
    A JSON-ready dict: the variant, steps, peak lr, the points, ``losses``
    (one list per seed), ``coded`` (the parameters whose state was coded) and
    the seconds it took.
  """
  began = time.perf_counter()
  problem = problems_lib.PROBLEMS[PROBLEM]
  lrs = lr_values(steps)
  points = eval_points(steps)
  eval_loss = jax.jit(problems_lib.make_loss(problem))
  grads = variants_lib.grad_function(problem)
  jax_side = variants_lib.VARIANTS[name].side == "jax"
  train = variants_lib.jax_trainer(name, problem, grads, schedule(lrs)) if jax_side else None
  losses, coded = [], []
  for seed in seeds:
    inst = problems_lib.instance(problem, seed, steps)
    x, y = jax.device_put(inst.x), jax.device_put(inst.y)
    ex, ey = jax.device_put(inst.eval_x), jax.device_put(inst.eval_y)
    seen: dict[int, float] = {}

    def after_step(t: int, params: dict[str, Any], seen: dict[int, float] = seen,
                   ex: Any = ex, ey: Any = ey) -> None:
      if t + 1 in points:
        seen[t + 1] = float(eval_loss(params, ex, ey))

    if train is not None:
      _, coded = train(inst, x, y, after_step)
    else:
      _, coded = variants_lib.torch_train(name, problem, inst, grads, x, y, lrs, after_step)
    losses.append([seen[k] for k in points])
  return dict(variant=name, steps=steps, peak_lr=PEAK_LR, weight_decay=problem.weight_decay,
              points=points, seeds=seeds, losses=losses, coded=coded,
              seconds=time.perf_counter() - began)


def seed_numbers(losses: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
  """One seed's numbers from its losses at the points and its float32 reference's."""
  return dict(rise=largest_rise(losses), final=float(losses[-1]),
              vs_fp32=float(losses[-1] / reference[-1]), diverged=diverged(losses))


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Per variant, from :func:`run_variant`'s results: its seeds' numbers, worst and median.

  Returns:
    A JSON-ready dict: the problem, steps, peak lr (and the matrix's lr),
    the phases, points and seeds; per variant its ``by_seed``
    :func:`seed_numbers`, the worst and the median rise, the median final
    loss, the median and worst final loss over float32's, the seeds that
    diverged, the median loss at each point (``curve``) and what it coded.
  """
  first = next(iter(runs.values()))
  variants = {}
  for n, run in runs.items():
    ref = runs[variants_lib.reference(n)]["losses"]
    by_seed = [seed_numbers(ls, r) for ls, r in zip(run["losses"], ref)]
    rises = [s["rise"] for s in by_seed]
    vs = [s["vs_fp32"] for s in by_seed]
    variants[n] = dict(by_seed=by_seed, rise_worst=float(np.max(rises)),
                       rise_median=float(np.median(rises)),
                       final=float(np.median([s["final"] for s in by_seed])),
                       vs_fp32_median=float(np.median(vs)), vs_fp32_worst=float(np.max(vs)),
                       diverged=[seed for seed, s in zip(run["seeds"], by_seed) if s["diverged"]],
                       curve=[float(x) for x in np.median(run["losses"], axis=0)],
                       coded=run["coded"])
  return dict(problem=PROBLEM, steps=first["steps"], peak_lr=first["peak_lr"],
              matrix_lr=problems_lib.PROBLEMS[PROBLEM].lr, weight_decay=first["weight_decay"],
              phases=list(phases(first["steps"])), points=first["points"], seeds=first["seeds"],
              variants=variants, seconds=float(sum(r["seconds"] for r in runs.values())))

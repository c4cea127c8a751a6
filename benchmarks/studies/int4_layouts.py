"""Screens int4 layouts of Adam's moments on the optim_oracle matrix, the JAX side only.

    python -m benchmarks.studies.int4_layouts                        # the layouts below, about 4 minutes
    python -m benchmarks.studies.int4_layouts --layouts rank1_v --problems gelu_deep_fast
    python -m benchmarks.studies.int4_layouts --smoke                # one problem, one seed, 5 steps

Each layout trains every problem of ``benchmarks.optim_oracle`` (``--seeds``
seeds) with AdamW whose new ``mu`` and ``nu`` are coded and decoded after
each update (a fake quantisation: what ``quantize_state`` stores is what the
next update reads, so this is the same computation). ``mu`` and ``nu`` of
leaves of at least 4,096 elements are coded, as in the oracle. Drift is
measured as the oracle does, from the same side's float32 AdamW, and divided
by torchao ``AdamW4bit``'s drift from the committed oracle run
(``--reference``, same problems and seeds), so no torch is needed.

Layouts (``mu`` with bfloat16 scales unless said; bytes per parameter with
bf16 masters):

- ``stop53``: both moments in blocks of 128, float32 scales (3.06; the layout
  until stop 54, and torchao ``AdamW4bit``'s;
  ``quantize_state(..., "int4", block_size=128)``).
- ``stop54``: ``mu`` in blocks of 64, ``nu`` in blocks of 128 with float32
  scales (3.06; stop 54's default).
- ``default``: ``mu`` in blocks of 32, ``nu`` in blocks of 256 with float32
  scales (3.08; ``quantize_state(..., "int4")`` since stop 55).
- ``m32_v128``: ``mu`` in blocks of 32, ``nu`` in blocks of 128 with float32
  scales (3.09).
- ``m32_v128bf16``: the same with bfloat16 scales for ``nu`` (3.08).
- ``rank1_v``: ``mu`` as ``stop54``; ``nu`` of a matrix (a leaf as rows of
  its last axis) normalised rank-1, each element by the smaller of its row's
  and its column's largest ``nu`` (Li, Chen and Zhu, NeurIPS 2023), coded with
  the same 4-bit non-negative code: no block scales (row and column maxima
  instead, a few bytes per row). Not a layout of ``quantize_state``: on
  XLA:GPU the column maxima of the new ``nu`` (a reduction over its leading
  axis) are computed from a float32 copy of it.
- ``rank1_v_m32``: ``rank1_v`` with ``mu`` in blocks of 32 (3.06).
- ``geo_pre`` / ``geo120_pre``: ``nu`` in blocks of 256 on 15 geometric
  levels 1.25x (1.2x) apart below the block's largest, every smaller non-zero
  ``nu`` rounded up to the lowest (``benchmarks.studies.int4_sweep.geometric_v``);
  ``mu`` coded in blocks of 32 as ``mu / sqrt(nu_coded)`` and decoded by
  multiplying back (preconditioner space). Not a layout of ``quantize_state``:
  the sweep's 1.5x bar bought with range (``docs/optimizer_state.md``).

The fake quantisation reproduces ``quantize_state`` (``stop54`` against the
oracle at b12a3bc: 73.54% drift on gelu_deep_fast, as the oracle;
``tests/test_benchmarks.py`` checks ``default`` against ``quantize_state``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.optim_oracle import drift as drift_lib
from benchmarks.optim_oracle import problems as problems_lib
from benchmarks.optim_oracle import variants as variants_lib
from benchmarks.studies import int4_sweep
from jmp_lite._src.optim import coded
from jmp_lite._src.optim import codes4

# name -> (mu's block, its scales' dtype, nu's block, "rank1" or a geometric spacing (float: mu
# coded through nu), its scales' dtype)
LAYOUTS: dict[str, tuple[Any, ...]] = {
    "stop53": (128, jnp.float32, 128, jnp.float32),
    "stop54": (64, jnp.bfloat16, 128, jnp.float32),
    "default": (32, jnp.bfloat16, 256, jnp.float32),
    "m32_v128": (32, jnp.bfloat16, 128, jnp.float32),
    "m32_v128bf16": (32, jnp.bfloat16, 128, jnp.bfloat16),
    "rank1_v": (64, jnp.bfloat16, "rank1", jnp.float32),
    "rank1_v_m32": (32, jnp.bfloat16, "rank1", jnp.float32),
    "geo_pre": (32, jnp.bfloat16, 1.25, jnp.float32),
    "geo120_pre": (32, jnp.bfloat16, 1.2, jnp.float32),
}
REFERENCE = pathlib.Path("benchmarks/results/optim-oracle-int4-cpu-x86_64-2026-11-29.json")
MIN_SIZE = 4096  # the oracle's coded leaves (torchao's threshold)
_U24 = 2.0**-24


def _blocks(x: jax.Array, block: int, leaf: int, count: jax.Array, never_zero: bool,
            scale_dtype: Any) -> jax.Array:
  return coded.quantize(x, "int4", block, leaf, count, never_zero, None, scale_dtype).dequantize()


def rank1(x: jax.Array, leaf: int, count: jax.Array) -> jax.Array:
  """Non-negative ``x`` coded in 4 bits against ``min(row max, column max)``, then decoded.

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[4.0, 1.0], [1.0, 0.25]])
    >>> rank1(x, 0, jnp.int32(0)).tolist()  # each on a level of its own scale
    [[4.0, 1.0], [1.0, 0.25]]
  """
  rows = x.reshape(-1, x.shape[-1])
  scale = jnp.minimum(rows.max(1, keepdims=True), rows.max(0, keepdims=True))
  y = jnp.where(scale > 0, rows / jnp.where(scale > 0, scale, 1.0), 0.0)
  u = (coded.dither(rows.shape, leaf, count) >> 8).astype(jnp.float32) * _U24
  q = codes4.encode(y, jnp.array(False), u, True)
  return (codes4._NON_NEGATIVE.level(q) * scale).reshape(x.shape)  # pylint: disable=protected-access


def coder(layout: str) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
  """``(code_mu, code_nu)``: ``f(x, leaf, count)`` -> ``x`` coded and decoded in ``layout``."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
  mu_block, mu_scales, nu_block, nu_scales = LAYOUTS[layout]
  code_mu = lambda x, i, c: _blocks(x, mu_block, i, c, False, mu_scales)
  if isinstance(nu_block, float):
    return code_mu, lambda x, i, c: int4_sweep.geometric_v(x, c, nu_block, 256, i)
  if nu_block != "rank1":
    return code_mu, lambda x, i, c: _blocks(x, nu_block, i, c, True, nu_scales)
  return code_mu, lambda x, i, c: rank1(x, i, c) if x.ndim >= 2 else _blocks(
      x, 128, i, c, True, jnp.float32)


def fake_quantized_adamw(layout: str, lr: float, weight_decay: float, draws: int = 0
                         ) -> optax.GradientTransformation:
  """optax AdamW whose new moments are coded and decoded in ``layout`` after each update.

  ``draws`` other than 0 shifts the coded leaves' numbers, so their rounding
  draws another sequence: how much a result owes to the draws.
  """
  inner = optax.adamw(lr, weight_decay=weight_decay)
  code_mu, code_nu = coder(layout)
  through_nu = isinstance(LAYOUTS[layout][2], float)

  def update(grads: Any, state: Any, params: Any = None) -> Any:
    updates, state = inner.update(grads, state, params)
    adam = state[0]
    # Coded leaves numbered as quantize_state numbers them (its draws): mu's, then nu's.
    big = [k for k in sorted(adam.mu) if adam.mu[k].size >= MIN_SIZE]
    count = adam.count - 1  # quantize_state codes update t with draws t (its own step)
    first = 1000 * draws
    nu = {**adam.nu, **{k: code_nu(adam.nu[k], first + len(big) + i, count)
                        for i, k in enumerate(big)}}
    # A geometric nu: mu in preconditioner space, mu / sqrt(nu_coded) coded, multiplied back.
    mu = {**adam.mu, **{k: int4_sweep.through_v(lambda x, i=i: code_mu(x, first + i, count),
                                                adam.mu[k], nu[k]) if through_nu
                        else code_mu(adam.mu[k], first + i, count) for i, k in enumerate(big)}}
    return updates, (adam._replace(mu=mu, nu=nu),) + tuple(state[1:])

  return optax.GradientTransformation(inner.init, update)


def screen(layout: str, problem: problems_lib.Problem, seeds: int, steps: int | None,
           reference: dict[str, list[float]], draws: int = 0) -> dict[str, Any]:
  """``layout`` on ``problem``: its mean drift, over ``AdamW4bit``'s, and its loss over float32's."""
  grads = variants_lib.grad_function(problem)
  loss = jax.jit(problems_lib.make_loss(problem))
  coded_tx = fake_quantized_adamw(layout, problem.lr, problem.weight_decay, draws)
  trainers = {"optax_adamw": variants_lib.jax_trainer("optax_adamw", problem, grads),
              "jmp_int4": variants_lib.jax_trainer("jmp_int4", problem, grads, tx=coded_tx)}
  drifts, losses = [], []
  for seed in range(seeds):
    inst = problems_lib.instance(problem, seed, steps)
    x, y = jax.device_put(inst.x), jax.device_put(inst.y)
    finals = {n: t(inst, x, y)[0] for n, t in trainers.items()}
    drifts.append(drift_lib.seed_drifts(finals, inst.params)["jmp_int4"])
    losses.append(float(loss(finals["jmp_int4"], inst.eval_x, inst.eval_y))
                  / float(loss(finals["optax_adamw"], inst.eval_x, inst.eval_y)))
  torchao = [] if steps is not None else reference.get(problem.name, [])[:seeds]
  return dict(layout=layout, problem=problem.name, drift=float(np.mean(drifts)),
              vs_adamw4bit=float(np.mean(drifts) / np.mean(torchao)) if torchao else None,
              loss_vs_fp32=float(np.mean(losses)))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.studies.int4_layouts",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS) + " (default: %(default)s)")
  p.add_argument("--problems", default="all", help="comma-separated oracle problems, or all (default: %(default)s)")
  p.add_argument("--seeds", type=int, default=4, help="seeds per problem (default: %(default)s)")
  p.add_argument("--reference", type=pathlib.Path, default=REFERENCE,
                 help="an optim_oracle JSON with torchao_adamw4bit's drifts (default: %(default)s)")
  p.add_argument("--draws", default="0", help="comma-separated draw sequences (0: quantize_state's; "
                 "others shift the coded leaves' numbers), each a row (default: %(default)s)")
  p.add_argument("--smoke", action="store_true", help="one problem, one seed, 5 steps")
  args = p.parse_args(argv)
  names = list(problems_lib.PROBLEMS) if args.problems == "all" else args.problems.split(",")
  unknown = [n for n in names if n not in problems_lib.PROBLEMS]
  if unknown:
    p.error(f"unknown problems {unknown}; choose from {', '.join(problems_lib.PROBLEMS)}")
  seeds, steps = (1, 5) if args.smoke else (args.seeds, None)
  names = names[:1] if args.smoke else names
  ref = json.loads(args.reference.read_text()) if args.reference.exists() else {"problems": []}
  reference = {q["problem"]: [s["torchao_adamw4bit"]["drift"] for s in q["by_seed"]]
               for q in ref["problems"] if "torchao_adamw4bit" in q["by_seed"][0]}
  print("| layout | draws | problem | drift | / AdamW4bit's | loss / float32's |\n"
        "|---|---|---|---|---|---|")
  for layout in args.layouts.split(","):
    for draws in (int(d) for d in args.draws.split(",")):
      ratios = []
      for name in names:
        r = screen(layout, problems_lib.PROBLEMS[name], seeds, steps, reference, draws)
        ratios.append(r["vs_adamw4bit"])
        ratio = "-" if r["vs_adamw4bit"] is None else f"{r['vs_adamw4bit']:.3f}x"
        print(f"| {layout} | {draws} | {name} | {r['drift']:.2%} | {ratio} | "
              f"{r['loss_vs_fp32']:.4f} |", flush=True)
      known = [x for x in ratios if x is not None]
      if len(known) > 1:
        print(f"| {layout} | {draws} | **median, worst** | | {np.median(known):.3f}x, "
              f"{max(known):.3f}x | |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

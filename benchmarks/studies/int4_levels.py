"""How far apart an unbiased code's levels of ``v`` may be for the sweep's 1.5x bar, and why.

    python -m benchmarks.studies.int4_levels                  # the table below, about 2 minutes
    python -m benchmarks.studies.int4_levels --rhos 1.2 --b2s 0.999 --steps 500
    python -m benchmarks.studies.int4_levels --smoke          # two spacings, 50 steps

Adam (``int4_sweep.adam``: lr 1e-3, ``b1`` 0.9) on the sweep's ratio-1 row
(``benchmarks.optim_oracle.sweep``: 4 blocks of 256 gradients of 1 times
uniform noise in [0.5, 1.5]), with ``v`` coded after each update on an
unbounded grid of levels ``rho**k``, rounded without bias with
:func:`jmp_lite._src.optim.coded.dither`'s draws,
as ``quantize_state`` rounds. No block scale and no range limit: the grid is
as fine as ``rho`` everywhere, which no 16-level code over a range of
``2**8`` is (15 steps of 1.2 span only 15x). ``m`` is exact, or coded as
int4 codes it in preconditioner space (``m / sqrt(v)`` with the signed
4-bit code in blocks of 32, the best ``m`` of ``benchmarks.studies.int4_sweep``).

The result is the coded run's largest step over float32 Adam's, as the
oracle's sweep reports it, and next to it the fraction of element-steps
whose coded ``v`` lies under half of float32's (a step at least 1.41x as large).
One column draws independently at every update (``b2`` 0.99, where 3,000
steps reach the stationary state), to check the balance below.

**Why the spacing, and not ``b2``, sets it.** Once ``(1 - b2) g**2`` is small
against the gap between levels, a coded ``v`` at level ``L`` moves only to
its neighbours: up with probability ``(1 - b2) (g**2 - L)+ / gap`` per update,
down with ``(1 - b2) (L - g**2)+ / gap``. In the stationary state the flow
between levels ``L_k`` and ``L_{k+1}`` balances, so

    P(L_{k+1}) / P(L_k) = E[(g**2 - L_k)+] / E[(L_{k+1} - g**2)+]

with ``b2`` and the gap cancelled: how many levels below the mean the coded
``v`` wanders is set by the gradients' spread against the spacing alone,
and a longer average (larger ``b2``) does not narrow it. The draws are a
Weyl sequence, not independent, so the balance holds only roughly; the table
measures it.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.optim_oracle import sweep as sweep_lib
from benchmarks.studies import int4_sweep

RHOS = "1.05,1.1,1.2,1.3,1.41,2"
B2S = "0.99,0.999"


def _iid(y: jax.Array, lo: jax.Array, hi: jax.Array, count: jax.Array) -> jax.Array:
  """``int4_sweep.rounded`` with draws independent across updates."""
  u = jax.random.uniform(jax.random.fold_in(jax.random.key(7), count), y.shape)
  return int4_sweep.rounded(y, lo, hi, u)


def grid(rho: float, iid: bool = False) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """``(v, count) -> v`` on the levels ``rho**k``, rounded without bias.

  The draws are ``quantize_state``'s (a Weyl sequence along the updates), or
  with ``iid`` independent at every update, as the balance assumes.

  Examples:
    >>> import jax.numpy as jnp
    >>> code = grid(2.0)
    >>> code(jnp.array([0.0, 1.0, 4.0]), jnp.int32(0)).tolist()  # on levels: unchanged
    [0.0, 1.0, 4.0]
  """
  log_rho = float(np.log(rho))
  rounded = _iid if iid else int4_sweep._unbiased

  def code(v: jax.Array, count: jax.Array) -> jax.Array:
    k = jnp.floor(jnp.log(jnp.maximum(v, 1e-38)) / log_rho)
    lo, hi = jnp.exp(k * log_rho), jnp.exp((k + 1) * log_rho)
    lo = jnp.minimum(lo, v)  # exp(log(v)) may land a hair above v
    return jnp.where(v > 0, rounded(v, lo, hi, count), 0.0)

  return code


def balanced_low(rho: float, below: float = 0.5) -> float:
  """The stationary probability, by the balance above, of a coded ``v`` under ``below`` of its mean.

  For the ratio-1 row's gradients (uniform in [0.5, 1.5]) on the levels
  ``rho**k``: the distribution over levels that the balance gives, its mass
  under ``below * E[g**2]``.

  Examples:
    >>> round(balanced_low(2.0), 3), balanced_low(1.05) < 1e-6
    (0.211, True)
  """
  g2 = np.linspace(0.5, 1.5, 100_001) ** 2
  mean = g2.mean()
  # The chain never leaves the levels from the highest at or under min(g**2) to the lowest
  # at or over max(g**2): beyond them the flow outwards is 0.
  k = np.arange(np.floor(np.log(g2[0]) / np.log(rho)), np.ceil(np.log(g2[-1]) / np.log(rho)) + 1)
  levels = rho**k
  up = np.array([np.maximum(g2 - x, 0.0).mean() for x in levels[:-1]])
  down = np.array([np.maximum(x - g2, 0.0).mean() for x in levels[1:]])
  p = np.concatenate([[1.0], np.cumprod(up / down)])
  return float(p[levels < below * mean].sum() / p.sum())


def run(rho: float, b2: float, code_m: bool, steps: int, iid: bool = False, seed: int = 0
        ) -> tuple[float, float]:
  """(largest step over float32 Adam's, share of element-steps with ``v`` < half float32's)."""
  mags = sweep_lib.magnitudes(np.array([1.0]), 4)
  code_v = grid(rho, iid)

  @jax.jit
  def step(carry: Any, g: jax.Array, count: jax.Array) -> Any:
    m, v, m32, v32 = carry
    m, v, coded = int4_sweep.adam(m, v, g, count, b2)
    m32, v32, exact = int4_sweep.adam(m32, v32, g, count, b2)
    v = code_v(v, count)
    if code_m:
      m = int4_sweep.through_v(lambda x: int4_sweep._lib_m(x, count), m, v)
    low = jnp.mean((v < 0.5 * v32).astype(jnp.float32))
    return (m, v, m32, v32), jnp.abs(coded).max(), jnp.abs(exact).max(), low

  zeros = jnp.zeros(mags.shape, jnp.float32)
  carry = (zeros, zeros, zeros, zeros)
  top = top32 = low_sum = 0.0
  for t in range(steps):
    carry, a, b, low = step(carry, jnp.asarray(sweep_lib.gradients(mags, seed, t)), jnp.int32(t))
    top, top32, low_sum = max(top, float(a)), max(top32, float(b)), low_sum + float(low)
  return top / top32, low_sum / steps


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.studies.int4_levels",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--rhos", default=RHOS, help="level spacings (default: %(default)s)")
  p.add_argument("--b2s", default=B2S, help="Adam's b2 values (default: %(default)s)")
  p.add_argument("--steps", type=int, default=3000, help="Adam steps (default: %(default)s)")
  p.add_argument("--smoke", action="store_true", help="spacings 1.2 and 2, b2 0.999, 50 steps")
  args = p.parse_args(argv)
  rhos = [float(r) for r in args.rhos.split(",")]
  b2s = [float(b) for b in args.b2s.split(",")]
  steps = args.steps
  if args.smoke:
    rhos, b2s, steps = [1.2, 2.0], [0.999], 50
  print(f"Largest step over float32 Adam's (fraction of element-steps with coded v under half "
        f"of float32's), ratio-1 row of the sweep, {steps} steps.\n")
  cols = [(b2, m) for b2 in b2s for m in (False, True)]
  print("| levels rho | balance: P(v < half) | independent draws: b2 0.99, m exact | " + " | ".join(
      f"b2 {b2:g}, m {'int4 (pre)' if m else 'exact'}" for b2, m in cols) + " |")
  print("|---" * (len(cols) + 3) + "|")
  for rho in rhos:
    cells = [run(rho, 0.99, False, steps, iid=True)] + [run(rho, b2, m, steps) for b2, m in cols]
    print(f"| {rho:g} | {balanced_low(rho):.2%} | "
          + " | ".join(f"{r:.2f} ({low:.1%})" for r, low in cells) + " |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

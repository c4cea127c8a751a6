"""Where int4's largest mixed-magnitude step comes from: each moment's code apart, and two ideas.

    python -m benchmarks.studies.int4_sweep                   # the codings below, about 3 minutes
    python -m benchmarks.studies.int4_sweep --codings lib,pre_adapt --ratios 1,0.178
    python -m benchmarks.studies.int4_sweep --smoke           # two codings, two ratios, 20 steps

The oracle's sweep (``benchmarks.optim_oracle.sweep``: even columns see
gradients of 1, odd ones of the ratio, times uniform noise in [0.5, 1.5],
Adam at lr 1e-3 for 3,000 steps), run as a fake quantisation: Adam in
float32 whose new ``m`` and ``v`` are coded and decoded after each update,
which is what ``quantize_state`` stores and the next update reads. The
result per ratio is the coded run's largest step over the float32 run's,
as the oracle reports it (``--rows`` blocks of 256 a ratio: more rows, more
draws, a larger largest step; the oracle uses 4).

Codings (``m``'s, then ``v``'s):

- ``lib``: both as ``quantize_state(..., "int4")`` codes them (``m`` in
  blocks of 32 with bfloat16 scales, ``v`` in 256).
- ``m_only`` / ``v_only``: one moment coded so, the other exact.
- ``pre``: ``m`` coded in preconditioner space, as ``m / sqrt(v_coded)``
  with the signed code (unbiased in ``m``: the decode multiplies back by the
  same ``sqrt(v_coded)``); ``v`` as ``lib``.
- ``adapt``: ``v``'s levels per block: 15 geometric levels from the block's
  smallest non-zero ``v`` to its largest when they are at most ``2**8``
  apart (else ``lib``'s levels); ``m`` as ``lib``. The range would cost a
  few bits of each scale.
- ``pre_adapt``: both.
- ``v_linear``: ``v`` on 15 linear levels ``k / 15`` of its block's largest
  with the floor ``1/15`` (torchao ``AdamW4bit``'s map, rounded without
  bias here), ``m`` exact: what a fine top costs in range.
- ``geo`` / ``geo_pre``: ``v`` on 15 geometric levels ``1.25**-k`` of its
  block's largest (256), every smaller non-zero ``v`` rounded up to
  ``1.25**-15`` (0.035); ``m`` as ``lib`` / as ``pre``. Fine steps everywhere,
  bought with range (``benchmarks.studies.int4_levels``). ``geo120_pre``:
  levels ``1.2**-k`` (floor 0.065).
- ``v_nearest``: ``v`` on ``lib``'s levels and blocks, rounded to the nearest
  level (biased, with fixed points: what issue 43 forbade), ``m`` as ``lib``.

Not a layout of ``quantize_state``; a screen for the next one.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.optim_oracle import sweep as sweep_lib
from jmp_lite._src.optim import coded
from jmp_lite._src.optim import codes4

CODINGS = ("lib", "m_only", "v_only", "pre", "adapt", "pre_adapt", "v_linear", "geo", "geo_pre",
           "geo120_pre", "v_nearest")
PRE = ("pre", "pre_adapt", "geo_pre", "geo120_pre")  # m coded as m / sqrt(v_coded)
RATIOS = "1,0.562,0.316,0.178,0.1,0.0316,0.01,0.001,1e-4,1e-6,1e-8"
_B1, _B2, _EPS, _LR = 0.9, 0.999, 1e-8, 1e-3
_RANGE = 2.0**8  # adapt: the widest block coded on its own geometric levels
_U24 = 2.0**-24


def _lib_m(x: jax.Array, count: jax.Array) -> jax.Array:
  return coded.quantize(x, "int4", 32, 0, count, False, None, jnp.bfloat16).dequantize()


def _lib_v(x: jax.Array, count: jax.Array) -> jax.Array:
  return coded.quantize(x, "int4", 256, 1, count, True, None, jnp.float32).dequantize()


def rounded(y: jax.Array, lo: jax.Array, hi: jax.Array, u: jax.Array) -> jax.Array:
  """``lo`` or ``hi`` per element: ``hi`` where draw ``u`` is under the share that keeps ``y``."""
  return jnp.where(u < (y - lo) / jnp.where(hi > lo, hi - lo, 1.0), hi, lo)


def _unbiased(y: jax.Array, lo: jax.Array, hi: jax.Array, count: jax.Array, leaf: int = 1
              ) -> jax.Array:
  """:func:`rounded` with ``quantize_state``'s draws (:func:`jmp_lite._src.optim.coded.dither`)."""
  return rounded(y, lo, hi, (coded.dither(y.shape, leaf, count) >> 8).astype(jnp.float32) * _U24)


def _blockwise(x: jax.Array, code: Callable[[jax.Array], jax.Array], block: int = 256
               ) -> jax.Array:
  """``code`` of ``x``'s elements flattened into zero-padded blocks, back in ``x``'s shape."""
  flat = x.reshape(-1)
  out = code(jnp.pad(flat, (0, -flat.size % block)).reshape(-1, block))
  return out.reshape(-1)[:flat.size].reshape(x.shape)


def through_v(code_m: Callable[[jax.Array], jax.Array], m: jax.Array, v: jax.Array) -> jax.Array:
  """``m`` coded in preconditioner space: ``code_m(m / sqrt(v))`` times ``sqrt(v)``."""
  root = jnp.sqrt(v)
  return code_m(m / jnp.where(root > 0, root, 1.0)) * root


def adapt_v(x: jax.Array, count: jax.Array) -> jax.Array:
  """``v`` in blocks of 256 on geometric levels over each block's own range (else ``lib``)."""
  blocks = x.reshape(-1, 256)
  top = blocks.max(-1, keepdims=True)
  top = jnp.where(top > 0, top, 1.0)
  low = jnp.where(blocks > 0, blocks, jnp.inf).min(-1, keepdims=True)
  spread = jnp.clip(top / low, 1.001, _RANGE)
  y = blocks / top
  step = jnp.clip(jnp.floor(jnp.log(jnp.maximum(y, 1e-30)) / jnp.log(spread) * 14 + 14), 0, 13)
  lo, hi = spread ** ((step - 14) / 14), spread ** ((step - 13) / 14)
  under = y < 1 / spread
  q = _unbiased(y, jnp.where(under, 0.0, lo), jnp.where(under, 1 / spread, hi), count)
  q = jnp.where(y > 0, jnp.maximum(q, 1 / spread), 0.0) * top
  return jnp.where(top / low > _RANGE, _lib_v(x, count).reshape(blocks.shape), q).reshape(x.shape)


def linear_v(x: jax.Array, count: jax.Array) -> jax.Array:
  """``v`` in blocks of 256 on ``k / 15`` of the block's largest, never under ``1/15`` if not 0."""
  blocks = x.reshape(-1, 256)
  top = blocks.max(-1, keepdims=True)
  top = jnp.where(top > 0, top, 1.0)
  y = blocks / top * 15
  q = _unbiased(y, jnp.floor(y), jnp.minimum(jnp.floor(y) + 1, 15), count)
  return (jnp.where(blocks > 0, jnp.maximum(q, 1.0), 0.0) / 15 * top).reshape(x.shape)


def geometric_v(x: jax.Array, count: jax.Array, rho: float = 1.25, block: int = 256,
                leaf: int = 1) -> jax.Array:
  """``v`` in blocks on 15 levels ``rho**-k`` of the block's largest (non-zero: >= ``rho**-15``).

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.zeros(256).at[:3].set(jnp.array([1.0, 0.8, 1e-6]))
    >>> geometric_v(x, jnp.int32(0))[:4].tolist()  # on its levels; the tiny one at the floor
    [1.0, 0.800000011920929, 0.03518437221646309, 0.0]
  """
  def code(blocks: jax.Array) -> jax.Array:
    top = blocks.max(-1, keepdims=True)
    y = blocks / jnp.where(top > 0, top, 1.0)
    k = jnp.clip(jnp.floor(-jnp.log(jnp.maximum(y, 1e-30)) / np.log(rho)), 0, 14)
    q = _unbiased(y, jnp.float32(rho) ** -(k + 1), jnp.float32(rho) ** -k, count, leaf)
    return jnp.where(y > 0, jnp.maximum(q, jnp.float32(rho) ** -15), 0.0) * top

  return _blockwise(x, code, block)


def nearest_v(x: jax.Array, count: jax.Array, leaf: int = 1) -> jax.Array:
  """``v`` in blocks of 256 on the int4 code's levels, rounded to the nearest (no draws).

  Examples:
    >>> import jax.numpy as jnp
    >>> x = jnp.zeros(256).at[:3].set(jnp.array([1.0, 0.7, 0.6]))
    >>> nearest_v(x, jnp.int32(0))[:4].tolist()  # levels 1/2, 3/4, 1
    [1.0, 0.75, 0.5, 0.0]
  """
  del count, leaf

  def code(blocks: jax.Array) -> jax.Array:
    top = blocks.max(-1, keepdims=True)
    y = blocks / jnp.where(top > 0, top, 1.0)
    q = codes4.encode(y, jnp.array(False), jnp.full(y.shape, 0.5), True)
    return codes4.levels(q, jnp.array(False)) * top

  return _blockwise(x, code)


def _exact(x: jax.Array, count: jax.Array) -> jax.Array:
  del count
  return x


def coder(name: str) -> Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """``(m, v, count) -> (m, v)`` as the coding ``name`` stores them."""
  Code = Callable[[jax.Array, jax.Array], jax.Array]
  codes_v: dict[str, Code] = {"adapt": adapt_v, "pre_adapt": adapt_v, "v_linear": linear_v,
                              "m_only": _exact, "geo": geometric_v, "geo_pre": geometric_v,
                              "geo120_pre": lambda x, c: geometric_v(x, c, 1.2),
                              "v_nearest": nearest_v}
  codes_m: dict[str, Code] = {"v_only": _exact, "v_linear": _exact}
  code_v, code_m = codes_v.get(name, _lib_v), codes_m.get(name, _lib_m)

  def code(m: jax.Array, v: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    v = code_v(v, count)
    if name in PRE:
      return through_v(lambda x: _lib_m(x, count), m, v), v
    return code_m(m, count), v

  return code


def adam(m: jax.Array, v: jax.Array, g: jax.Array, count: jax.Array, b2: float = _B2
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Adam's new moments and its step, in ``optax.adam``'s arithmetic (lr 1e-3, ``b1`` 0.9)."""
  m, v = (1 - _B1) * g + _B1 * m, (1 - b2) * g**2 + b2 * v
  t = (count + 1).astype(jnp.float32)
  return m, v, _LR * (m / (1 - _B1**t)) / (jnp.sqrt(v / (1 - b2**t)) + _EPS)


def largest_steps(name: str, ratios: np.ndarray, rows: int, steps: int, seed: int) -> np.ndarray:
  """Per ratio: the coded run's largest step over float32 Adam's, on the same gradients."""
  mags = sweep_lib.magnitudes(ratios, rows)
  code = coder(name)

  @jax.jit
  def step(carry: Any, g: jax.Array, count: jax.Array) -> Any:
    m, v, m32, v32 = carry
    m, v, coded_step = adam(m, v, g, count)
    m32, v32, exact_step = adam(m32, v32, g, count)
    return ((*code(m, v, count), m32, v32), jnp.abs(coded_step).max(axis=(1, 2)),
            jnp.abs(exact_step).max(axis=(1, 2)))

  zeros = jnp.zeros(mags.shape, jnp.float32)
  carry = (zeros, zeros, zeros, zeros)
  top, top32 = np.zeros(len(ratios)), np.zeros(len(ratios))
  for t in range(steps):
    carry, a, b = step(carry, jnp.asarray(sweep_lib.gradients(mags, seed, t)), jnp.int32(t))
    top, top32 = np.maximum(top, np.asarray(a)), np.maximum(top32, np.asarray(b))
  return top / top32


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.studies.int4_sweep",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--codings", default=",".join(CODINGS),
                 help="comma-separated, of " + ", ".join(CODINGS) + " (default: %(default)s)")
  p.add_argument("--ratios", default=RATIOS, help="comma-separated (default: %(default)s)")
  p.add_argument("--rows", type=int, default=4, help="blocks of 256 a ratio (default: %(default)s)")
  p.add_argument("--steps", type=int, default=3000, help="Adam steps (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="the gradients' noise (default: %(default)s)")
  p.add_argument("--smoke", action="store_true", help="lib and pre_adapt, two ratios, 20 steps")
  args = p.parse_args(argv)
  names = args.codings.split(",")
  unknown = [n for n in names if n not in CODINGS]
  if unknown:
    p.error(f"unknown codings {unknown}; choose from {', '.join(CODINGS)}")
  ratios = np.array([float(r) for r in args.ratios.split(",")])
  steps = args.steps
  if args.smoke:
    names, ratios, steps = ["lib", "pre_adapt"], ratios[:2], 20
  print(f"Largest step over float32 Adam's, {args.rows} blocks of 256 a ratio, {steps} steps, "
        f"seed {args.seed}.\n")
  print("| coding | " + " | ".join(f"{r:g}" for r in ratios) + " | worst |")
  print("|---" * (len(ratios) + 2) + "|")
  for name in names:
    r = largest_steps(name, ratios, args.rows, steps, args.seed)
    print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in r) + f" | **{r.max():.2f}** |",
          flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

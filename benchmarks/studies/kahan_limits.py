"""Where Kahan-compensated bfloat16 masters stop tracking float32: tiny updates, measured.

    python -m benchmarks.studies.kahan_limits                            # a few seconds on a 2-core CPU; writes out/
    python -m benchmarks.studies.kahan_limits --out benchmarks/results   # regenerate the committed results
    python -m benchmarks.studies.kahan_limits --smoke                    # seconds, for CI; writes to a temp folder

Weights drawn uniformly from [0.5, 2] and rounded to bfloat16 (the same start
for every variant) receive ``--steps`` identical updates ``+u``, for ``u`` from
1e-7 to 1e-3 (three per decade). Each variant applies them one step at a time
in a ``lax.scan``:

  fp32              float32 masters, ``jmp.apply_updates`` (the reference)
  bf16_nearest      bfloat16 masters, ``jmp.apply_updates(rounding="nearest")``
  bf16_stochastic   bfloat16 masters, stochastic rounding, a fresh key per step
  bf16_kahan        bfloat16 masters, Kahan compensation in a bfloat16 buffer
                    (``rounding="kahan"``, what ``TrainState`` stores)
  bf16_kahan_f32c   a prototype, not offered by the API: the library's Kahan
                    kernel (``masters.kahan_add``) with a float32 buffer

Per ``u`` and variant the report gives:

- the fraction of weights that moved;
- the mean drift of the weights relative to float32's (1 is exact, 0 a stall).
  When the drift is a few bfloat16 ulps, rounding the weight to the bfloat16
  grid alone moves this ratio by up to 10% (every weight gets the same update);
- the mean drift of the *master value* relative to float32's, and its RMS
  error relative to float32's RMS drift: the weight itself, or for the Kahan
  variants the compensated value ``p + c`` that they really hold;
- float32's own mean drift relative to the exact sum ``steps * u``: below
  about 1e-6 float32 masters round each update by up to 20% themselves.

Then every weight's master-value drift, relative to the exact sum, is binned
by its update-to-weight ratio ``u / |w|`` (three bins per decade): a variant's
limit is the smallest ratio from which on every bin's mean is within 2% of
exact. Nothing is timed and every number is deterministic (the stochastic keys
are fixed).

Why a bfloat16 compensation stalls: when the weight does not move, Kahan's new
compensation is ``bf16(c + u)``; once ``u`` is below half an ulp of ``c``,
which happens at ``|c|`` of about ``u * 2**8``, ``c`` stops growing. The weight
moves only when ``|c + u|`` exceeds half an ulp of ``w``, ``|w| * 2**-9`` to
``|w| * 2**-8``, so updates below about ``2**-17`` to ``2**-16`` of the weight
(8e-6 to 1.5e-5) never arrive. A float32 buffer moves that limit to about
``2**-33`` (1e-10), at 6 bytes per parameter (bfloat16 weight plus float32
buffer) against float32 masters' 4.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jmp
from benchmarks import cli
from benchmarks import report
from jmp_lite._src import masters as lean  # the Kahan kernel, for the float32-buffer prototype

PROG = "python -m benchmarks.studies.kahan_limits"
VARIANTS = ("fp32", "bf16_nearest", "bf16_stochastic", "bf16_kahan", "bf16_kahan_f32c")
# Bytes per parameter of the master weights and their compensation buffer.
BYTES = {"fp32": 4, "bf16_nearest": 2, "bf16_stochastic": 2, "bf16_kahan": 4,
         "bf16_kahan_f32c": 6}
UPDATES = tuple(float(f"{m}e{e}") for e in range(-7, -3) for m in (1, 2, 5)) + (1e-3,)
SMOKE_UPDATES = (1e-6, 1e-4)
TOLERANCE = 0.02  # a drift within 2% of float32's counts as tracking it
BINS_PER_DECADE = 3


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #


def initial_weights(n: int, seed: int) -> jax.Array:
  """``n`` bfloat16 weights drawn uniformly from [0.5, 2]."""
  w = np.random.default_rng(seed).uniform(0.5, 2.0, n).astype(np.float32)
  return jnp.asarray(w).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("variant", "steps"))
def accumulate(variant: str, w0: jax.Array, u: jax.Array,
               steps: int) -> tuple[jax.Array, jax.Array]:
  """The weights and the compensation after ``steps`` updates of ``+u`` (both as float32).

  The compensation is zero for the variants without one.
  """
  updates = jnp.full(w0.shape, u, jnp.float32)
  params = w0.astype(jnp.float32) if variant == "fp32" else w0
  comp = jnp.zeros(w0.shape, jnp.float32 if variant == "bf16_kahan_f32c" else jnp.bfloat16)
  rounding = {"bf16_stochastic": "stochastic", "bf16_kahan": "kahan"}.get(variant, "nearest")
  base_key = jax.random.key(0)

  def body(carry: tuple[jax.Array, jax.Array], step: jax.Array) -> tuple[Any, None]:
    p, c = carry
    if variant == "bf16_kahan_f32c":
      return lean.kahan_add(p, c, updates), None
    key = jax.random.fold_in(base_key, step) if rounding == "stochastic" else None
    p, new_c = jmp.apply_updates(p, updates, rounding=rounding, key=key,
                                 compensation=c if rounding == "kahan" else None)
    return (p, c if new_c is None else new_c), None

  (p, c), _ = jax.lax.scan(body, (params, comp), jnp.arange(steps))
  return p.astype(jnp.float32), c.astype(jnp.float32)


def _bin(ratio: np.ndarray) -> np.ndarray:
  """The bin of each update-to-weight ratio: floor(BINS_PER_DECADE * log10(ratio))."""
  return np.floor(BINS_PER_DECADE * np.log10(ratio) + 1e-9).astype(int)


Finals = dict[str, tuple[np.ndarray, np.ndarray]]  # variant -> (weights, compensation)


def measure_update(w0: np.ndarray, finals: Finals, u: float, steps: int) -> dict[str, Any]:
  """The per-``u`` row of every variant (see the module docstring); all float64 arithmetic."""
  drift32 = finals["fp32"][0] - w0
  row: dict[str, Any] = dict(
      update=u, ratio_min=u / float(w0.max()), ratio_max=u / float(w0.min()),
      fp32_vs_exact=float(drift32.mean() / (steps * u)), variants={})
  for name, (p, c) in finals.items():
    master_drift = p + c - w0
    row["variants"][name] = dict(
        moved=float(np.mean(p != w0)),
        drift_vs_fp32=float((p - w0).mean() / drift32.mean()),
        master_drift_vs_fp32=float(master_drift.mean() / drift32.mean()),
        master_rms_error_vs_fp32=float(np.sqrt(np.mean((master_drift - drift32) ** 2))
                                       / np.sqrt(np.mean(drift32**2))),
    )
  return row


def limits(w0: np.ndarray, per_update: list[tuple[float, Finals]],
           steps: int) -> dict[str, Any]:
  """Per variant, the mean master-value drift / exact drift in each ``u / |w|`` bin, and the limit.

  Args:
    w0: the initial weights (float64).
    per_update: ``(u, finals)`` for every update size, ``finals`` as in
      :func:`measure_update`.
    steps: the number of updates (the exact drift is ``steps * u``).

  Returns:
    ``bins`` (the lower edge of each bin, ascending), ``drift_vs_exact`` (per
    variant, the bins' mean per-weight ratios of the master value's drift to
    the exact one) and ``limit`` (per
    variant, the lower edge of the first bin from which on every bin is within
    :data:`TOLERANCE` of 1, or ``None``).
  """
  sums: dict[str, dict[int, float]] = {name: {} for name in per_update[0][1]}
  counts: dict[int, int] = {}
  for u, finals in per_update:
    bins = _bin(u / np.abs(w0))
    for b in np.unique(bins):
      counts[int(b)] = counts.get(int(b), 0) + int(np.sum(bins == b))
    for name, (p, c) in finals.items():
      ratio = (p + c - w0) / (steps * u)
      for b in np.unique(bins):
        sums[name][int(b)] = sums[name].get(int(b), 0.0) + float(ratio[bins == b].sum())
  order = sorted(counts)
  out: dict[str, Any] = dict(bins=[10.0 ** (b / BINS_PER_DECADE) for b in order],
                             drift_vs_exact={}, limit={})
  for name, by_bin in sums.items():
    means = [by_bin[b] / counts[b] for b in order]
    out["drift_vs_exact"][name] = means
    good = [abs(m - 1) <= TOLERANCE for m in means]
    first = next((i for i in range(len(good)) if all(good[i:])), None)
    out["limit"][name] = None if first is None else out["bins"][first]
  return out


def run(n: int, steps: int, updates: tuple[float, ...], seed: int) -> dict[str, Any]:
  """Every variant at every update size; the rows and the limits."""
  w0 = initial_weights(n, seed)
  w0_64 = np.asarray(w0.astype(jnp.float32), np.float64)
  rows, per_update = [], []
  for u in updates:
    finals = {v: tuple(np.asarray(x, np.float64)
                       for x in accumulate(v, w0, jnp.float32(u), steps)) for v in VARIANTS}
    rows.append(measure_update(w0_64, finals, u, steps))
    per_update.append((u, finals))
  return dict(rows=rows, limits=limits(w0_64, per_update, steps))


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def _limit_str(x: float | None) -> str:
  return "never within 2%" if x is None else f"u/|w| >= {x:.1e}"


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report: three tables per update size, the binned ratios and the limits."""
  cfg = result["config"]
  lines = [report.meta_line(result["meta"]), "",
           f"{cfg['weights']} weights uniform in [0.5, 2] (bfloat16), {cfg['steps']} updates of "
           "+u each. Bytes per parameter (weight + compensation): "
           + ", ".join(f"{v} {BYTES[v]}" for v in VARIANTS) + ". A bfloat16 weight moves "
           "only once its drift passes half an ulp (2^-9 to 2^-8 of the weight); until then "
           "the Kahan variants hold the drift in their compensation, which the master value "
           "(weight + compensation) counts."]
  header = "| u | u/\\|w\\| | " + " | ".join(VARIANTS) + " |"
  rule = "|---" * (len(VARIANTS) + 2) + "|"
  for key, title, fmt in [
      ("moved", "Weights that moved", "{:.1%}"),
      ("drift_vs_fp32", "Mean drift of the weights / float32's", "{:.4f}"),
      ("master_drift_vs_fp32",
       "Mean drift of the master value (weight + compensation) / float32's", "{:.4f}"),
      ("master_rms_error_vs_fp32",
       "RMS error of the master value / float32's RMS drift", "{:.4f}")]:
    lines += ["", f"**{title}**", "", header, rule]
    for row in result["rows"]:
      cells = [fmt.format(row["variants"][v][key]) for v in VARIANTS]
      lines.append(f"| {row['update']:.0e} | {row['ratio_min']:.1e}-{row['ratio_max']:.1e} | "
                   + " | ".join(cells) + " |")
  lines += ["", "float32's own mean drift / the exact sum: "
            + ", ".join(f"{r['update']:.0e}: {r['fp32_vs_exact']:.4f}" for r in result["rows"])
            + "."]
  lim = result["limits"]
  lines += ["", f"**Mean per-weight master-value drift / the exact drift, by update-to-weight "
            f"ratio** ({BINS_PER_DECADE} bins per decade; lower edge)", "",
            "| u/\\|w\\| >= | " + " | ".join(VARIANTS) + " |", rule[4:]]
  for i, edge in enumerate(lim["bins"]):
    lines.append(f"| {edge:.1e} | "
                 + " | ".join(f"{lim['drift_vs_exact'][v][i]:.4f}" for v in VARIANTS) + " |")
  lines += ["", f"Limits (every bin from there on within {TOLERANCE:.0%} of the exact drift):", ""]
  lines += [f"- {v}: {_limit_str(lim['limit'][v])}" for v in VARIANTS]
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, epilog="variants: " + ", ".join(VARIANTS))
  cli.add_common_arguments(p, "256 weights, 50 steps, u in {1e-6, 1e-4}; seconds",
                           variants=False)
  p.add_argument("--weights", type=cli.positive_int, default=4096,
                 help="number of weights (default: %(default)s)")
  p.add_argument("--steps", type=cli.positive_int, default=2000,
                 help="updates per run (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="seed of the weights (default: %(default)s)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the study and writes ``kahan-limits-<machine>-<date>.json`` and ``.md``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = p.parse_args(argv)
  if args.smoke:
    args.weights, args.steps = 256, 50
  updates = SMOKE_UPDATES if args.smoke else UPDATES
  cli.select_platform(args)
  device = cli.device(args, p)
  out = report.output_dir(args.out, args.smoke)
  print(f"{args.weights} weights, {args.steps} updates, {len(updates)} update sizes, "
        f"{len(VARIANTS)} variants on {device.device_kind}; results will be written to {out}",
        flush=True)
  measured = run(args.weights, args.steps, updates, args.seed)
  result = dict(meta=report.meta(cli.command(PROG, argv), device, smoke=args.smoke),
                config=cli.args_record(args), bytes_per_param=BYTES, tolerance=TOLERANCE,
                **measured)
  text = markdown(result)
  stem = out / f"kahan-limits-{report.machine_name(device)}-{result['meta']['date']}"
  report.publish(result, stem, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())

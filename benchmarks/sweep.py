"""Leaf-count sweep: how the cost of loss scaling grows with the number of leaves.

Run ``python -m benchmarks.sweep --help``. For each size (``small``: 16-float
leaves, ``wide``: 4096-float leaves) and each leaf count N, the model is N
parameter vectors with a trivial loss (``models.build_leaf_problem``), so the
optimizer (Adam) and the per-leaf work of loss scaling dominate. Side by side
in one process, for each variant, it measures:

  step time     interleaved with the other variants, median over repeats,
                exactly as ``benchmarks.run`` does (``benchmarks.measure``);
  compile time  ``lower()`` and XLA's ``compile()``, timed separately;
  temp memory   ``compiled.memory_analysis().temp_size_in_bytes``;

and times ``jmp_lite.gradient_report`` on the N-leaf float32 gradients (the
first call, compilation included, and a second call). Ratios are against
``f16_noscale``, which always runs. The targets of issue 13 are printed as
PASS/FAIL where their case ran (smoke runs have none):

  step time, 200 wide leaves:               jmp_lite <= 1.05x f16_noscale;
  XLA compile time, 300 and 1000 small:     jmp_lite <= 1.5x f16_noscale;
  gradient_report, 1000 leaves (each size): first + second call < 5 s.

Variants (``--variants``; see ``benchmarks/variants.py``): ``f16_noscale``
(hand-written f16 step, no scaling, no skip), ``f16_dynamic`` (jmp_lite:
``make_train_step`` with ``mixed_float16`` and ``dynamic_loss_scaling(adam)``),
``jmp_dynamic`` (the hand-written jmp pattern) and ``flax_dynamic`` (Flax
``DynamicScale``). The select-based jmp and Flax steps compile slowly at many
leaves: on two CPU cores (jax 0.10.2) XLA took 166 s (jmp) and 36 s (Flax)
for 200 wide leaves, 527 s and 126 s for 300 small ones, against 2-4 s
without scaling, and it grows faster than the leaf count. The default sweep
with every variant therefore takes hours on such a machine; ``--variants
f16_dynamic`` (with the baseline) takes minutes.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from typing import Any

import jax

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.sweep"
SIZES = {"small": 16, "wide": 4096}
VARIANTS = ("f16_noscale", "f16_dynamic", "jmp_dynamic", "flax_dynamic")
BASE = "f16_noscale"
LIB = "f16_dynamic"
DEFAULT_LEAVES = (50, 200, 300, 500, 1000)
SMOKE_LEAVES = (3, 10)

# (bar, measured quantity, size, leaf counts, limit, description)
BARS = (
    ("step", "step", "wide", (200,), 1.05, "jmp_lite / f16_noscale step time"),
    ("compile", "compile", "small", (300, 1000), 1.5, "jmp_lite / f16_noscale XLA compile"),
    (
        "gradient_report",
        "gradient_report_s",
        None,
        (1000,),
        5.0,
        "gradient_report first + second call, seconds",
    ),
)


def leaf_counts(text: str) -> list[int]:
  """An ``argparse`` type: comma-separated leaf counts >= 1, sorted, each once.

  Examples:
    >>> leaf_counts("200,50, 200")
    [50, 200]
  """
  try:
    counts = {cli.positive_int(t.strip()) for t in text.split(",") if t.strip()}
  except argparse.ArgumentTypeError as e:
    raise argparse.ArgumentTypeError(f"expected integers >= 1 and commas, got {text!r}") from e
  if not counts:
    raise argparse.ArgumentTypeError(f"expected integers >= 1 and commas, got {text!r}")
  return sorted(counts)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(
      PROG, __doc__, f"Variants: {', '.join(VARIANTS)} ({BASE}, the baseline, always runs)"
  )
  p.add_argument(
      "--leaves",
      type=leaf_counts,
      metavar="N,N,...",
      help="leaf counts (default: %s; with --smoke: %s)"
      % (",".join(map(str, DEFAULT_LEAVES)), ",".join(map(str, SMOKE_LEAVES))),
  )
  p.add_argument(
      "--sizes",
      default="all",
      metavar="LIST",
      help="comma-separated leaf sizes, from %s, or all (default: %%(default)s)"
      % ", ".join(f"{k} ({v} floats)" for k, v in SIZES.items()),
  )
  cli.add_common_arguments(p, "tiny sweep (3 and 10 leaves, 2 repeats), bars not meaningful")
  cli.add_timing_arguments(p, "--repeats", 21, "; with --smoke 2")
  return p


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
  """Parses and checks ``argv``; adds ``names`` (variants, baseline first)."""
  args = p.parse_args(argv)
  try:
    args.names = cli.choose(args.variants, VARIANTS, VARIANTS, "variant")
    args.sizes = cli.choose(args.sizes, tuple(SIZES), tuple(SIZES), "size")
  except ValueError as e:
    p.error(str(e))
  args.names = [BASE] + [n for n in args.names if n != BASE]
  if args.leaves is None:
    args.leaves = list(SMOKE_LEAVES if args.smoke else DEFAULT_LEAVES)
  if args.smoke:
    args.repeats, args.warmup, args.sample_seconds = min(args.repeats, 2), 1, 1e-9
  return args


def time_gradient_report(problem: models.Problem) -> dict[str, float]:
  """Seconds for a first and a second ``gradient_report`` on ``problem``'s gradients."""
  import jmp_lite  # pylint: disable=import-outside-toplevel

  grads = jax.block_until_ready(jax.grad(problem.loss_fn)(problem.params, problem.batch))
  out = {}
  for key in ("first_s", "second_s"):
    t0 = time.perf_counter()
    jax.block_until_ready(jmp_lite.gradient_report(grads))
    out[key] = time.perf_counter() - t0
  return out


def case_ratios(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
  """Each variant's step, lower, compile and temp-memory cost over the baseline's.

  Examples:
    >>> rec = lambda t, c, m: dict(step_s=dict(samples=[t]), lower_s=c, compile_s=c,
    ...                            memory_bytes=dict(temp=m))
    >>> case_ratios({"f16_noscale": rec(1.0, 2.0, 0), "f16_dynamic": rec(1.5, 3.0, 8)})
    {'f16_dynamic': {'step': 1.5, 'step_paired': 1.5, 'lower': 1.5, 'compile': 1.5, 'temp': None}}
  """
  base = records[BASE]

  def ratio(a, b):
    return a / b if a is not None and b else None

  out = {}
  for name, rec in records.items():
    if name == BASE:
      continue
    step = measure.compare(rec["step_s"]["samples"], base["step_s"]["samples"])
    out[name] = dict(
        step=step["median"],
        step_paired=step["paired_median"],
        lower=ratio(rec["lower_s"], base["lower_s"]),
        compile=ratio(rec["compile_s"], base["compile_s"]),
        temp=ratio(rec["memory_bytes"]["temp"], base["memory_bytes"]["temp"]),
    )
  return out


def run_case(size: str, leaves: int, args: argparse.Namespace, progress: Any) -> dict[str, Any]:
  """Measures every variant, and ``gradient_report``, on one leaf model."""
  problem = models.build_leaf_problem(leaves, SIZES[size])
  lives = []
  for name in args.names:
    progress.set_postfix_str(f"{size} x {leaves}: compile {name}")
    lives.append(
        measure.prepare(variants_lib.make_variant(name, problem), problem.batch, args.warmup)
    )
    progress.update(1)
  inner = measure.calibrate(lives, problem.batch, args.sample_seconds)
  progress.set_postfix_str(f"{size} x {leaves}: timing x{inner}")
  measure.time_interleaved(lives, problem.batch, args.repeats, inner, progress)
  records = {live.variant.name: measure.finish_record(live) for live in lives}
  progress.set_postfix_str(f"{size} x {leaves}: gradient_report")
  grad_report = time_gradient_report(problem)
  progress.update(1)
  return dict(
      size=size,
      leaf_size=SIZES[size],
      leaves=leaves,
      repeats=args.repeats,
      inner_steps_per_sample=inner,
      variants=records,
      ratios=case_ratios(records),
      gradient_report=grad_report,
  )


def check_bars(cases: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
  """The :data:`BARS` whose case (and jmp_lite variant, for ratios) ran.

  Examples:
    >>> case = dict(size="wide", leaves=200, ratios={"f16_dynamic": {"step": 1.2}},
    ...             gradient_report=dict(first_s=1.0, second_s=0.5))
    >>> [(b["bar"], b["passed"]) for b in check_bars([case], True)]
    [('step', False)]
  """
  bars = []
  for key, quantity, size, counts, limit, what in BARS:
    for c in cases:
      if c["leaves"] not in counts or size not in (None, c["size"]):
        continue
      if quantity == "gradient_report_s":
        value = c["gradient_report"]["first_s"] + c["gradient_report"]["second_s"]
      elif LIB in c["ratios"]:
        value = c["ratios"][LIB][quantity]
      else:
        continue
      case = f"{c['size']} x {c['leaves']}"
      bars.append(bars_lib.bar(key, what, value, limit, meaningful, case=case))
  return bars


def _fmt(x: float | None, spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report: one row per case and variant, gradient_report times, bars."""
  lines = [
      report.meta_line(result["meta"]),
      "",
      f"Step time: median of {result['meta']['repeats']} interleaved repeats; "
      "ratios (x) against f16_noscale in the same case.",
      "",
      "| size | leaves | variant | step ms | step x | lower s | compile s | compile x | "
      "temp KiB | temp x |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for c in result["cases"]:
    for name, v in c["variants"].items():
      r = c["ratios"].get(name, dict(step=1.0, compile=1.0, temp=1.0))
      temp = v["memory_bytes"]["temp"]
      lines.append(
          f"| {c['size']} | {c['leaves']} | {name} | {v['step_s']['median'] * 1e3:.3f} | "
          f"{r['step']:.3f} | {v['lower_s']:.2f} | {v['compile_s']:.2f} | "
          f"{_fmt(r['compile'], '.2f')} | {_fmt(None if temp is None else temp / 1024, '.1f')} | "
          f"{_fmt(r['temp'], '.2f')} |"
      )
  lines += [
      "",
      "| size | leaves | gradient_report first call s | second call s |",
      "|---|---|---|---|",
  ]
  for c in result["cases"]:
    g = c["gradient_report"]
    lines.append(f"| {c['size']} | {c['leaves']} | {g['first_s']:.2f} | {g['second_s']:.3f} |")
  lines += ["", *report.bars_table(result["bars"], where="case")]
  return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Step time, compile time and temp memory over f16_noscale against the leaf count."""
  fig, axes = report.pyplot().subplots(1, 3, figsize=(15, 4.5))
  panels = (
      ("step", "step time"),
      ("compile", "XLA compile time"),
      ("temp", "compiled temp memory"),
  )
  names = [n for n in VARIANTS if n != BASE and n in result["meta"]["variants"]]
  for ax, (key, title) in zip(axes, panels):
    for i, name in enumerate(names):
      for size, style in zip(SIZES, ("-", "--")):
        cases = [c for c in result["cases"] if c["size"] == size]
        if not cases:
          continue
        ys = [c["ratios"][name][key] for c in cases]
        ax.plot(
            [c["leaves"] for c in cases],
            [math.nan if y is None else y for y in ys],
            style,
            marker="o",
            color=f"C{i}",
            label=f"{variants_lib.LABELS[name]}, {size}",
        )
    ax.set_xscale("log")
    counts = sorted({c["leaves"] for c in result["cases"]})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("parameter leaves")
    ax.set_title(f"{title} / f16_noscale")
  axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  report.save_figure(fig, result, path)


def main(argv: list[str] | None = None) -> int:
  """Runs the sweep; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = parse_args(p, argv)
  cli.select_platform(args)
  device = cli.device(args, p)
  cases = [(size, n) for size in args.sizes for n in args.leaves]
  out = report.output_dir(args.out, args.smoke)
  print(f"leaf sizes {', '.join(args.sizes)} x leaf counts {', '.join(map(str, args.leaves))}; "
        f"variants {', '.join(args.names)}; {args.repeats} repeats; results will be written to "
        f"{out}", flush=True)
  total = len(cases) * (len(args.names) * (1 + args.repeats) + 1)
  with cli.progress_bar(total, "sweep") as progress:
    results = [run_case(size, n, args, progress) for size, n in cases]
  bars = check_bars(results, meaningful=not args.smoke)
  result = dict(
      meta=report.meta(
          cli.command(PROG, argv),
          device,
          smoke=args.smoke,
          repeats=args.repeats,
          learning_rate=variants_lib.LEARNING_RATE,
          variants={n: variants_lib.LABELS[n] for n in args.names},
      ),
      cases=results,
      bars=bars,
      all_bars_pass=None if args.smoke else all(b["passed"] for b in bars),
  )
  stem = out / (
      f"sweep-{report.machine_name(device)}-{result['meta']['date']}"
  )
  text = markdown(result)
  report.write(result, stem, text, plot)
  print(text)
  for b in bars:
    print(report.bar_line(b))
  print(f"wrote {stem}.json, .md and .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())

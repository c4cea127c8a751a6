"""Benchmarks jmp_lite against fp32, hand-written jmp and Flax DynamicScale.

Run ``python -m benchmarks.run --help``. Every variant (see
``benchmarks/variants.py``; ``--variants`` picks a subset) trains the same
model on the same batch with the same Adam, is jitted with its state donated,
is compiled ahead of time, and is warmed up before timing. Variants are timed
interleaved (their order rotates each repeat), and the step time is the median
over repeats; each repeat times ``inner`` consecutive steps followed by
``block_until_ready`` (see ``benchmarks/measure.py``).

``--model all`` runs ``models.DEFAULT_MODELS``; the deep Transformer runs only
when named (``--model deep_transformer``).

Bars are printed as PASS or FAIL; smoke-sized runs print them as
``SMOKE (not meaningful)`` and mark them ``"meaningful": false`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from typing import Any

from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.run"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(
      PROG,
      __doc__,
      "Variants (fp32_highest only on GPU; f16_autocast, bf16_autocast and bf16_fp8 only "
      "when named): "
      + ", ".join(variants_lib.VARIANTS),
  )
  p.add_argument(
      "--model",
      choices=(*models.MODELS, "all"),
      help="the model to run; all: " + ",".join(models.DEFAULT_MODELS)
      + " (default: all; with --smoke: mlp)",
  )
  cli.add_common_arguments(p, "a tiny model, 3 repeats, bars not meaningful: a CI check")
  p.add_argument("--batch", type=cli.positive_int, help="batch size (default: the preset's)")
  p.add_argument(
      "--layers", type=cli.positive_int, help="MLP/Transformer/LSTM depth (default: the preset's)"
  )
  p.add_argument(
      "--hidden",
      type=cli.positive_int,
      help="MLP width, d_model, LSTM hidden or CNN channels (default: the preset's)",
  )
  cli.add_timing_arguments(p, "--steps", 41, "; with --smoke at most 3")
  p.add_argument("--no-peak", action="store_true", help="skip the GPU peak-memory probes")
  p.add_argument(
      "--strict", action="store_true", help="exit with status 1 if a meaningful bar fails"
  )
  p.add_argument("--probe-peak", help=argparse.SUPPRESS)
  return p


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
  """Parses and checks ``argv``; adds ``names`` (variants) and ``models``."""
  args = p.parse_args(argv)
  default = [n for n in variants_lib.DEFAULT_VARIANTS if args.device == "gpu" or n != "fp32_highest"]
  try:
    args.names = cli.choose(args.variants, variants_lib.VARIANTS, default, "variant")
  except ValueError as e:
    p.error(f"--variants: {e}")
  model = args.model or ("mlp" if args.smoke else "all")
  args.models = list(models.DEFAULT_MODELS) if model == "all" else [model]
  if args.smoke:
    args.steps, args.warmup, args.sample_seconds = min(args.steps, 3), 1, 0.0
  return args


def problem(model: str, args: argparse.Namespace) -> models.Problem:
  """Builds ``model`` at the size that ``args`` asks for."""
  preset = "smoke" if args.smoke else args.device
  return models.build_problem(
      model, preset, batch=args.batch, layers=args.layers, hidden=args.hidden
  )


# Peak device memory (GPU): one fresh process per variant, since the
# allocator's peak can't be reset within a process.


def probe_peak(args: argparse.Namespace) -> int:
  """``--probe-peak model:variant``: prints that variant's peak bytes as JSON."""
  model, name = args.probe_peak.split(":")
  prob = problem(model, args)
  peak = measure.device_peak_bytes(variants_lib.make_variant(name, prob), prob.batch)
  print(json.dumps({"peak_bytes": peak}))
  return 0


def measure_peaks(args: argparse.Namespace, argv: list[str]) -> dict[str, dict[str, int | None]]:
  """model -> variant -> peak device bytes, each from a fresh process (GPU only)."""
  peaks: dict[str, dict[str, int | None]] = {m: {} for m in args.models}
  if args.device != "gpu" or args.no_peak:
    return peaks
  probe_argv = [a for a in argv if a != "--strict"]
  root = pathlib.Path(__file__).resolve().parent.parent
  for model in args.models:
    for name in args.names:
      cmd = [sys.executable, "-m", "benchmarks.run", *probe_argv, "--probe-peak", f"{model}:{name}"]
      proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
      try:
        peaks[model][name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
      except (IndexError, ValueError, KeyError):
        print(
            f"peak-memory probe failed for {model}:{name}:\n{proc.stderr[-2000:]}",
            file=sys.stderr,
        )
        peaks[model][name] = None
  return peaks


def bench_all(
    args: argparse.Namespace, device: Any, peaks: dict[str, dict[str, int | None]]
) -> list[dict[str, Any]]:
  """Runs :func:`benchmarks.measure.bench_model` on every model, one at a time."""
  on_gpu = device.platform == "gpu"
  peak_tflops = measure.bf16_peak_tflops(device.device_kind) if on_gpu else None
  total = len(args.models) * len(args.names) * (1 + args.steps)
  results = []
  with cli.progress_bar(total, "benchmarks") as progress:
    for model in args.models:
      results.append(
          measure.bench_model(
              problem(model, args),
              args.names,
              repeats=args.steps,
              warmup=args.warmup,
              target_s=max(args.sample_seconds, 1e-9),
              on_gpu=on_gpu,
              peak_tflops=peak_tflops,
              peaks=peaks[model],
              progress=progress,
              meaningful=not args.smoke,
          )
      )
  return results


def assemble(
    args: argparse.Namespace, argv: list[str], device: Any, results: list[dict[str, Any]]
) -> dict[str, Any]:
  """The JSON result: metadata, the models' results and all their bars."""
  on_gpu = device.platform == "gpu"
  meta = report.meta(
      cli.command(PROG, argv),
      device,
      bf16_peak_tflops=measure.bf16_peak_tflops(device.device_kind) if on_gpu else None,
      smoke=args.smoke,
      learning_rate=variants_lib.LEARNING_RATE,
      init_scale=variants_lib.INIT_SCALE,
      growth_interval=variants_lib.GROWTH_INTERVAL,
      variants={n: variants_lib.LABELS[n] for n in args.names},
  )
  bars = [b for r in results for b in r["bars"]]
  return dict(
      meta=meta,
      models=results,
      bars=bars,
      # Smoke-sized timings are noise: no verdict.
      all_bars_pass=None if args.smoke else all(b["passed"] for b in bars),
  )


def print_summary(result: dict[str, Any], text: str, stem: pathlib.Path) -> None:
  """Prints the report, one line per bar, and warns about skipped steps."""
  print(text)
  for b in result["bars"]:
    print(report.bar_line(b))
  skipped = [
      f"{m['model']}:{n}"
      for m in result["models"]
      for n, v in m["variants"].items()
      if v["skipped_during_timing"]
  ]
  if skipped:
    print(f"WARNING: steps were skipped during timing in {skipped}", file=sys.stderr)
  print(f"wrote {stem}.json, .md and .png")


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = parse_args(p, argv)
  cli.select_platform(args)
  if args.probe_peak:
    return probe_peak(args)
  out = report.output_dir(args.out, args.smoke)
  print(f"models {', '.join(args.models)}; variants {', '.join(args.names)}; {args.steps} "
        f"repeats after {args.warmup} warm-up steps; results will be written to {out}", flush=True)
  peaks = measure_peaks(args, argv)  # before this process takes the device
  device = cli.device(args, p)
  result = assemble(args, argv, device, bench_all(args, device, peaks))
  stem = out / f"{report.machine_name(device)}-{result['meta']['date']}"
  text = report.markdown(result)
  report.write(result, stem, text, report.plot)
  print_summary(result, text, stem)
  return 1 if args.strict and result["all_bars_pass"] is False else 0


if __name__ == "__main__":
  sys.exit(main())

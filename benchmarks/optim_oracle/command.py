"""The command line: choose the problems and parts, run them in worker processes, write the report."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from benchmarks import cli
from benchmarks import report
from benchmarks.optim_oracle import cooldown as cooldown_lib
from benchmarks.optim_oracle import drift
from benchmarks.optim_oracle import problems as problems_lib
from benchmarks.optim_oracle import sweep as sweep_lib
from benchmarks.optim_oracle import tables
from benchmarks.optim_oracle import variants as variants_lib

PARTS = ("matrix", "families", "sweep", "cooldown")
FORMATS = ("int8", "float8", "int4")
SMOKE_STEPS = 5


def build_parser() -> Any:
  """The command-line parser."""
  from benchmarks import optim_oracle  # pylint: disable=import-outside-toplevel
  p = cli.parser(variants_lib.PROG, optim_oracle.__doc__,
                 "Problems: " + ", ".join(problems_lib.PROBLEMS) + ". Optimizers: "
                 + ", ".join(variants_lib.VARIANTS) + f". Needs torch and torchao: "
                 f"{variants_lib.INSTALL}.")
  p.add_argument("--problems", default="all", metavar="LIST",
                 help="comma-separated problems (listed below), or all (default: %(default)s)")
  p.add_argument("--parts", default="all", metavar="LIST",
                 help="comma-separated parts: matrix (AdamW against torchao), families (lion and "
                      "sgd-momentum, coded against float32), sweep, cooldown (a warmup-stable-"
                      "decay schedule to lr 0 on transformer_gelu); or all (default: %(default)s)")
  p.add_argument("--formats", default="all", metavar="LIST",
                 help="comma-separated coded formats to run: " + ", ".join(FORMATS)
                      + "; or all (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="first seed of the weights, data and batches (default: %(default)s)")
  p.add_argument("--seeds", type=cli.positive_int, default=4,
                 help="runs per problem, from seeds --seed, --seed + 1, ... (default: %(default)s)")
  p.add_argument("--ratios", type=cli.positive_int, default=33,
                 help="sweep ratios, log-spaced from 1 to 1e-8 (default: %(default)s)")
  p.add_argument("--probe-rows", type=cli.positive_int, default=4,
                 help="blocks of 256 per sweep ratio (default: %(default)s)")
  p.add_argument("--probe-steps", type=cli.positive_int, default=3000,
                 help="Adam steps of the sweep (default: %(default)s)")
  p.add_argument("--probe-lr", type=cli.positive_float, default=1e-3,
                 help="Adam's learning rate in the sweep (default: %(default)s)")
  p.add_argument("--cooldown-steps", type=cli.positive_int, default=cooldown_lib.STEPS,
                 help=f"steps of the cooldown part, at least {cooldown_lib.MIN_STEPS} (default: "
                      "%(default)s)")
  p.add_argument("--jobs", type=cli.positive_int, default=min(2, os.cpu_count() or 1),
                 help="worker processes, one problem (or the sweep, or a cooldown variant) each "
                      "at a time "
                      "(default: %(default)s, the CPU count up to 2)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true",
                 help=f"{SMOKE_STEPS} steps per problem, one seed, 4 ratios x 4 rows for 20 steps, "
                      f"a cooldown of {cooldown_lib.MIN_STEPS} steps: a quick check whose bars are "
                      "not meaningful")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def variant_names(parts: list[str], formats: tuple[str, ...] = FORMATS) -> list[str]:
  """The variants the chosen parts run in ``formats``, with the float32 references they need."""
  names = []
  for part, in_part in (("matrix", lambda f: f == "adamw"), ("families", lambda f: f != "adamw")):
    if part not in parts:
      continue
    chosen = [n for n, v in variants_lib.VARIANTS.items()
              if in_part(v.family) and (v.format is None or v.format in formats)]
    if any(variants_lib.VARIANTS[n].format is not None for n in chosen):
      names += chosen
  return names


def _task(spec: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
  """Runs one problem, the sweep or one cooldown variant (in a worker process, or in this one)."""
  kind, *args = spec
  if kind == "sweep":
    return kind, sweep_lib.run_sweep(*args)
  if kind == "cooldown":
    return f"cooldown {args[0]}", cooldown_lib.run_variant(*args)
  name, seeds, names, steps = args
  return name, drift.run_problem(problems_lib.PROBLEMS[name], seeds, names, steps)


def run_tasks(specs: list[tuple[Any, ...]], jobs: int) -> dict[str, dict[str, Any]]:
  """Each task's result by name, run by ``jobs`` spawned workers (or here, for one job)."""
  done: dict[str, dict[str, Any]] = {}
  start = time.perf_counter()

  def note(name: str, res: dict[str, Any]) -> None:
    done[name] = res
    print(f"[{time.perf_counter() - start:6.0f} s] {name}: {res['seconds']:.0f} s "
          f"({len(done)}/{len(specs)})", file=sys.stderr, flush=True)

  if jobs == 1:
    for spec in specs:
      note(*_task(spec))
    return done
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the workers inherit it
  with multiprocessing.get_context("spawn").Pool(jobs) as pool:
    for name, res in pool.imap_unordered(_task, specs):
      note(name, res)
  return done


def commit() -> str:
  """The checked-out commit (short), with ``+dirty`` if tracked files differ from it."""
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           check=True, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
  """Measures and writes ``optim-oracle-<machine>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    chosen = cli.choose(args.problems, tuple(problems_lib.PROBLEMS), tuple(problems_lib.PROBLEMS),
                        "problem")
    parts = cli.choose(args.parts, PARTS, PARTS, "part")
    formats = tuple(cli.choose(args.formats, FORMATS, FORMATS, "format"))
    cooldown_lib.phases(args.cooldown_steps)
  except ValueError as e:
    parser.error(str(e))
  torch, _ = variants_lib.import_torch()
  measured = commit()  # before the run: what the numbers measure
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  seeds = [args.seed + i for i in range(1 if args.smoke else args.seeds)]
  steps = SMOKE_STEPS if args.smoke else None
  names = variant_names(parts, formats)
  cooldown_names = cooldown_lib.variant_names(formats) if "cooldown" in parts else []
  cooldown_steps = cooldown_lib.MIN_STEPS if args.smoke else args.cooldown_steps
  # Longest first: the sweep, the cooldown (torch's eager steps first), the problems by steps.
  specs: list[tuple[Any, ...]] = []
  if "sweep" in parts:
    specs.append(("sweep", [n for n in sweep_lib.NAMES if variants_lib.VARIANTS[n].format
                            in (None, *formats)], 4 if args.smoke else args.ratios,
                  4 if args.smoke else args.probe_rows, 20 if args.smoke else args.probe_steps,
                  args.probe_lr, args.seed))
  specs += [("cooldown", n, seeds, cooldown_steps) for n in
            sorted(cooldown_names, key=lambda n: variants_lib.VARIANTS[n].side != "torch")]
  if names:
    specs += [("problem", n, seeds, names, steps) for n in
              sorted(chosen, key=lambda n: -problems_lib.PROBLEMS[n].steps)]
  done = run_tasks(specs, args.jobs)
  problems = [done[n] for n in chosen if n in done]
  result: dict[str, Any] = dict(
      problems=problems, sweep=done.get("sweep"),
      summary=dict(ratios=tables.ratio_summary(problems), families=tables.family_summary(problems)))
  if cooldown_names:
    result["cooldown"] = cooldown_lib.summarize({n: done[f"cooldown {n}"] for n in cooldown_names})
  result["bars"] = tables.check_bars(result, meaningful=not args.smoke)
  device = jax.devices("cpu")[0]
  meta = report.meta(cli.command(variants_lib.PROG, argv), device, args=cli.args_record(args),
                     smoke=args.smoke, commit=measured, torch=str(torch.__version__),
                     torchao=str(__import__("torchao").__version__))
  result = dict(meta=meta, **result)
  stem = (report.output_dir(args.out, args.smoke)
          / f"optim-oracle-{report.machine_name(device)}-{meta['date']}")
  report.publish(result, stem, tables.markdown(result))
  return report.bars_status(result["bars"], args.strict)

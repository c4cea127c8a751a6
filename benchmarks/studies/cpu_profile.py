"""Where a train step's time goes on XLA:CPU: kernel time, and how often the cores overlap.

For each variant (see ``benchmarks.variants``) this script first times the
compiled steps side by side, as ``benchmarks.run`` does, by wall time and by
process CPU time. Then it records ``--steps`` more steps of each under
``jax.profiler`` and reads the trace back (``jax.profiler.ProfileData``). Per
step, it reports:

- the **kernel time**: the time XLA's kernels ran, summed over threads (the
  CPU work);
- the **overlap**: the time during which two or more kernels ran at once
  (XLA:CPU runs independent kernels concurrently, one per core);
- the kernel groups that took the most time (``ynn_fusion``: the YNNPACK
  convolutions and matmuls; ``*_fusion``: XLA's elementwise loops).

It answers the question that issue 13 left open: on two cores, the ResNet's
f16 step with dynamic scaling is slower than Flax's by wall time, although it
does no more CPU work. The profile shows whether the difference is in the work
or in how much of it overlaps. Profiling adds its own cost to every kernel, so
compare the variants with each other, not with the unprofiled times.

CPU only: on a GPU the kernels run on the device, where a GPU profiler (Nsight
Systems, or the TensorBoard profile plugin) is the tool.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import sys
import tempfile
from typing import Any, Iterable

import jax

from benchmarks import cli, measure, models, report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.studies.cpu_profile"
DEFAULT_VARIANTS = ("f16_dynamic", "f16_noscale", "flax_dynamic")

# (start_ns, end_ns, name) of one kernel on one thread.
Interval = tuple[int, int, str]


def kernel_group(name: str) -> str:
  """A kernel's name without its instance number.

  Examples:
    >>> kernel_group("ynn_fusion.12"), kernel_group("wrapped_reduce-window")
    ('ynn_fusion', 'wrapped_reduce-window')
  """
  return re.sub(r"\.\d+$", "", name)


def outermost(intervals: Iterable[Interval]) -> list[Interval]:
  """The intervals of one thread that no other of its intervals contains.

  A kernel may record events of its own inside its span; counting those too
  would count the same time twice.

  Examples:
    >>> outermost([(0, 10, "a"), (2, 5, "b"), (10, 12, "c")])
    [(0, 10, 'a'), (10, 12, 'c')]
  """
  kept: list[Interval] = []
  for iv in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
    if kept and iv[1] <= kept[-1][1]:
      continue
    kept.append(iv)
  return kept


def concurrency(threads: list[list[Interval]]) -> dict[int, int]:
  """Nanoseconds during which exactly k kernels ran, for each k seen (k >= 1).

  ``threads`` holds the outermost intervals of each thread.

  Examples:
    >>> concurrency([[(0, 10, "a")], [(5, 20, "b")]])
    {1: 15, 2: 5}
  """
  points = sorted(
      (t, d) for ivs in threads for s, e, _ in ivs for t, d in ((s, 1), (e, -1))
  )
  out: collections.Counter[int] = collections.Counter()
  running, last = 0, None
  for t, d in points:
    if running and last is not None:
      out[running] += t - last
    running, last = running + d, t
  return dict(sorted(out.items()))


def kernel_intervals(xspace_path: str) -> list[list[Interval]]:
  """The outermost kernel intervals of each XLA thread in a saved trace."""
  data = jax.profiler.ProfileData.from_file(xspace_path)
  threads = []
  for plane in data.planes:
    for line in plane.lines:
      if "XLA" not in line.name:  # the Eigen pool and PjRt's client threads
        continue
      ivs = [
          (e.start_ns, e.start_ns + e.duration_ns, e.name)
          for e in line.events
          if not e.name.startswith("ThunkExecutor")  # wrappers around the kernels
      ]
      if ivs:
        threads.append(outermost(ivs))
  return threads


def summarize(threads: list[list[Interval]], steps: int, top: int) -> dict[str, Any]:
  """Per-step milliseconds: span, kernel time, overlap, and the ``top`` kernel groups."""
  ivs = [iv for t in threads for iv in t]
  if not ivs:
    raise RuntimeError("the trace holds no XLA kernel events; is this the CPU backend?")
  ms = lambda ns: ns / 1e6 / steps  # noqa: E731
  groups: collections.Counter[str] = collections.Counter()
  for s, e, name in ivs:
    groups[kernel_group(name)] += e - s
  by_k = concurrency(threads)
  return dict(
      span_ms=ms(max(e for _, e, _ in ivs) - min(s for s, _, _ in ivs)),
      kernel_ms=ms(sum(e - s for s, e, _ in ivs)),
      overlap_ms=ms(sum(ns for k, ns in by_k.items() if k >= 2)),
      alone_ms=ms(by_k.get(1, 0)),
      top_groups=[(g, ms(ns)) for g, ns in groups.most_common(top)],
  )


def profile(live: measure.Live, batch: Any, steps: int, top: int) -> dict[str, Any]:
  """Runs ``steps`` steps of ``live`` under the profiler, each waited for; summarizes."""
  with tempfile.TemporaryDirectory() as tmp:
    state = live.state
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        state, out = live.compiled(state, batch)
        jax.block_until_ready((state, out))
    live.state = state
    found = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
    if len(found) != 1:
      raise RuntimeError(f"expected one trace file under {tmp}, found {found}")
    return summarize(kernel_intervals(found[0]), steps, top)


def markdown(result: dict[str, Any]) -> str:
  """The result as a Markdown report."""
  cfg = result["config"]
  lines = [
      report.meta_line(result["meta"]), "",
      f"**{cfg['model']}**, {cfg['repeats']} interleaved timed repeats, then {cfg['steps']} "
      "profiled steps per variant. Kernel time is summed over threads; overlap is the time "
      f"with two or more kernels running. Usable CPUs: {result['meta']['usable_cpus']}.", "",
      "| variant | step ms (wall) | CPU ms | CPU / wall | profiled span ms | kernel ms "
      "| overlap ms | one kernel ms | top kernel groups (ms) |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in result["variants"].items():
    p = r["profile"]
    top = ", ".join(f"{g} {t:.1f}" for g, t in p["top_groups"])
    lines.append(
        f"| {variants_lib.LABELS.get(name, name)} | {r['wall_ms']:.1f} | {r['cpu_ms']:.1f} "
        f"| {r['cpu_ms'] / r['wall_ms']:.2f} | {p['span_ms']:.1f} | {p['kernel_ms']:.1f} "
        f"| {p['overlap_ms']:.1f} | {p['alone_ms']:.1f} | {top} |"
    )
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command line."""
  p = cli.parser(PROG, __doc__, "Variants: " + ", ".join(variants_lib.VARIANTS)
                 + f". Default: {','.join(DEFAULT_VARIANTS)}.")
  p.add_argument("--model", default="cnn", choices=models.MODELS,
                 help="the benchmark model (default: %(default)s)")
  p.add_argument("--steps", type=cli.positive_int, default=5,
                 help="profiled steps per variant (default: %(default)s)")
  p.add_argument("--top", type=cli.positive_int, default=4,
                 help="kernel groups listed per variant (default: %(default)s)")
  cli.add_timing_arguments(p, "--repeats", 21, "; with --smoke 2")
  cli.add_common_arguments(p, "the smoke-size model, 2 repeats, 1 profiled step: a CI check")
  return p


def main(argv: list[str] | None = None) -> int:
  """Times and profiles the variants; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = p.parse_args(argv)
  if args.device != "cpu":
    p.error("--device gpu: this profile reads XLA:CPU's kernel events; use a GPU profiler")
  names = cli.choose(args.variants, variants_lib.VARIANTS, DEFAULT_VARIANTS, "variant")
  if "fp32_highest" in names:
    p.error("fp32_highest is a GPU variant")
  if args.smoke:
    args.repeats, args.steps, args.warmup, args.sample_seconds = 2, 1, 1, 1e-9
  cli.select_platform(args)
  device = cli.device(args, p)
  out = report.output_dir(args.out, args.smoke)
  preset = "smoke" if args.smoke else "cpu"
  print(f"model {args.model} ({preset} size), variants {', '.join(names)}: {args.repeats} timed "
        f"repeats, then {args.steps} profiled steps each, on {device.device_kind}; results will "
        f"be written to {out}", flush=True)
  problem = models.build_problem(args.model, preset)
  lives = [measure.prepare(variants_lib.make_variant(n, problem), problem.batch, args.warmup)
           for n in names]
  inner = measure.calibrate(lives, problem.batch, args.sample_seconds)
  measure.time_interleaved(lives, problem.batch, args.repeats, inner)
  results = {}
  for live in lives:
    print(f"profiling {live.variant.name} ...", flush=True)
    results[live.variant.name] = dict(
        wall_ms=1e3 * statistics.median(live.times),
        cpu_ms=1e3 * statistics.median(live.cpu_times),
        profile=profile(live, problem.batch, args.steps, args.top),
    )
  result = dict(
      meta=report.meta(cli.command(PROG, argv), device, smoke=args.smoke),
      config=cli.args_record(args),
      variants=results,
  )
  text = markdown(result)
  m = result["meta"]
  cores = "" if m["usable_cpus"] in (None, m["cpu_count"]) else f"-{m['usable_cpus']}cpu"
  stem = out / f"cpu-profile-{args.model}{cores}-{report.machine_name(device)}-{m['date']}"
  report.publish(result, stem, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())

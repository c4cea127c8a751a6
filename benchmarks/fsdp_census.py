"""The collectives of an FSDP train step compiled for 8 H100s that this machine does not have.

Run ``python -m benchmarks.fsdp_census --help``. The step's params, optimizer
state and batch are sharded FSDP-style along one mesh axis of 8 GPUs (every
leaf on its first axis where 8 divides it, else replicated), and XLA's SPMD
partitioner gathers each weight where it is used. For each model and variant
(``fp32``, ``bf16_autocast``, ``bf16_fp8``: autocast with
``Float8Recipe(min_size=0)``, ``bf16_fp8_amaxes``: the same with the weights'
amaxes kept in the state, ``TrainState.create(weight_amaxes=True)``) the script compiles the step with
``jmp.compile_for_gpu`` on a topology mesh of 8 H100s (no GPU needed: the CUDA
plugin's compiler, deviceless) and reports, from the compiled program:

- every collective by kind (all-gather, all-reduce, reduce-scatter, ...), with
  the bytes of its results per device by dtype;
- the float8 share of the all-gathered bytes;
- the temp bytes of ``compiled.memory_analysis()`` (per device).

Its bars are issue 44's: under FP8 float8 carries >= 90% of the all-gathered
bytes, the all-gathered bytes are <= 0.55x the bf16 autocast step's, there are
at most 3 more all-reduces than in the bf16 autocast step, and the temp memory
is no more than its. Compiles of the GPU-sized models take minutes; results are
cached by the lowered program's hash (``--cache``), so a rerun of an unchanged
step reads the cache.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import pathlib
import sys
import time
from typing import Any

# First: on a machine without a GPU driver it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK
# before JAX starts, so that the CUDA plugin's compiler stays up (see conftest.py).
from jmp_lite._src.diagnostics import gpu_compile as gpu_lib  # noqa: E402

from benchmarks import bars as bars_lib  # noqa: E402  (after the environment is set)
from benchmarks import cli  # noqa: E402
from benchmarks import gpu_compile as gpu_bench  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks import report  # noqa: E402

PROG = "python -m benchmarks.fsdp_census"
VARIANTS = ("fp32", "bf16_autocast", "bf16_fp8", "bf16_fp8_amaxes", "bf16_fp8_rowwise")
DEFAULT_VARIANTS = ("fp32", "bf16_autocast", "bf16_fp8", "bf16_fp8_amaxes")
DEFAULT_MODELS = ("transformer", "mlp")
AXIS = "fsdp"
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "jmp_lite" / "fsdp_census"


def fsdp_structs(tree: Any, mesh: Any) -> Any:
  """``tree``'s arrays as ``ShapeDtypeStruct``s sharded on their first axis over ``mesh``.

  A leaf whose first axis the mesh's size does not divide (a scalar, a count)
  is replicated.
  """
  import jax  # pylint: disable=import-outside-toplevel

  size = mesh.devices.size

  def place(x: Any) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      return x
    first = len(x.shape) >= 1 and x.shape[0] % size == 0
    spec = jax.sharding.PartitionSpec(AXIS) if first else jax.sharding.PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

  return jax.tree.map(place, tree)


def _compiled_facts(step: Any, args: tuple[Any, ...], cache: pathlib.Path | None) -> dict[str, Any]:
  """The compiled program's memory and census; the compile is skipped when the cache holds its HLO.

  The cache keeps, per lowered program (its hash), the memory analysis and the
  optimised HLO text, so that a change to the census reads the cache too.
  """
  from jmp_lite._src.diagnostics import hlo_census  # pylint: disable=import-outside-toplevel

  lowered = step.lower(*args)
  key = hashlib.sha256(("v2" + lowered.as_text()).encode()).hexdigest()[:24]
  path = cache / f"{key}.json.gz" if cache is not None else None
  if path is not None and path.exists():
    with gzip.open(path, "rt") as f:
      stored = dict(json.load(f), cached=True)
  else:
    start = time.perf_counter()
    compiled = gpu_lib.compile_placed(step, args, "h100")
    mem = compiled.memory_analysis()
    stored = dict(compile_s=time.perf_counter() - start, temp_bytes=int(mem.temp_size_in_bytes),
                  argument_bytes=int(mem.argument_size_in_bytes),
                  output_bytes=int(mem.output_size_in_bytes), hlo=compiled.as_text())
    if path is not None:
      path.parent.mkdir(parents=True, exist_ok=True)
      with gzip.open(path, "wt") as f:
        json.dump(stored, f)
    stored["cached"] = False
  text = stored.pop("hlo")
  ops = hlo_census.census(text)
  return dict(stored, gemms=len([o for o in ops if o.kind == "gemm"]),
              fp8_gemms=sum(o.float8 for o in ops if o.kind == "gemm"),
              collectives=[[c.kind, c.reduction, [list(p) for p in c.bytes_by_dtype]]
                           for c in hlo_census.collectives(text)])


def census(collectives: list[list[Any]]) -> dict[str, Any]:
  """Counts and bytes per device of ``[kind, reduction, [[dtype, bytes], ...]]`` entries.

  An all-reduce is counted under ``all-reduce`` and under ``all-reduce <reduction>``
  (``all-reduce maximum``: an amax).

  Examples:
    >>> c = census([["all-gather", "", [["f8e4m3fn", 300]]], ["all-gather", "", [["bf16", 100]]],
    ...             ["all-reduce", "maximum", [["f32", 4]]]])
    >>> c["counts"], c["bytes"]["all-gather"], round(c["float8_gather_share"], 2)
    ({'all-gather': 2, 'all-reduce': 1, 'all-reduce maximum': 1}, {'f8e4m3fn': 300, 'bf16': 100}, 0.75)
  """
  counts: dict[str, int] = collections.Counter()
  by_kind: dict[str, dict[str, int]] = {}
  for kind, reduction, parts in collectives:
    counts[kind] += 1
    if kind == "all-reduce":
      counts[f"all-reduce {reduction}"] += 1
    for dtype, n in parts:
      by_kind.setdefault(kind, collections.Counter())[dtype] += n
  gathered = by_kind.get("all-gather", {})
  total = sum(gathered.values())
  f8 = sum(n for d, n in gathered.items() if d.startswith("f8"))
  return dict(counts=dict(counts), bytes={k: dict(v) for k, v in by_kind.items()},
              gather_bytes=total, float8_gather_share=f8 / total if total else 0.0)


def measure(name: str, problem: models.Problem, mesh: Any, cache: pathlib.Path | None) -> dict[str, Any]:
  """Compiles variant ``name`` sharded over ``mesh``; its collective census and memory."""
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import variants as variants_lib  # pylint: disable=import-outside-toplevel

  variant = variants_lib.make_variant(name, problem)
  args = (fsdp_structs(jax.eval_shape(variant.init), mesh), fsdp_structs(problem.batch, mesh))
  facts = _compiled_facts(variant.fn, args, cache)
  return dict(variant=name, **facts, **census(facts["collectives"]))


# (bar, what, value of (fp8 row, bf16 autocast row), limit)
BARS = (
    ("fsdp_float8_share", "bf16_fp8: 1 - float8 share of all-gathered bytes",
     lambda f, b: 1.0 - f["float8_gather_share"], 0.10),
    ("fsdp_gather_bytes", "bf16_fp8 / bf16_autocast all-gathered bytes",
     lambda f, b: f["gather_bytes"] / b["gather_bytes"], 0.55),
    ("fsdp_extra_all_reduces", "bf16_fp8 - bf16_autocast all-reduce count",
     lambda f, b: f["counts"].get("all-reduce", 0) - b["counts"].get("all-reduce", 0), 3),
    ("fsdp_temp", "bf16_fp8 / bf16_autocast temp memory",
     lambda f, b: f["temp_bytes"] / b["temp_bytes"], 1.0),
)


def check_bars(rows: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
  """Issue 44's bars for every model whose bf16_fp8 and bf16_autocast steps were compiled."""
  index = {(r["model"], r["variant"]): r for r in rows}
  found = []
  for model in dict.fromkeys(r["model"] for r in rows):
    for fp8 in ("bf16_fp8", "bf16_fp8_amaxes", "bf16_fp8_rowwise"):
      f, b = index.get((model, fp8)), index.get((model, "bf16_autocast"))
      if f is None or b is None:
        continue
      for key, what, value, limit in BARS:
        found.append(bars_lib.bar(key, what.replace("bf16_fp8", fp8), float(value(f, b)), limit,
                                  meaningful, model=model))
  return found


def _by_dtype(parts: dict[str, int]) -> str:
  return ", ".join(f"{d} {report.mib(n)}" for d, n in parts.items()) or "-"


def markdown(result: dict[str, Any]) -> str:
  """The report: one census table per model, then the bars."""
  lines = [report.meta_line(result["meta"]), "",
           f"**Compiled for {result['devices']} x {result['target_device']}, not run**: params, "
           f"optimizer state and batch sharded on their first axis over one mesh axis "
           f"(FSDP). Bytes are MiB per device, of each collective's results.", ""]
  for model in dict.fromkeys(r["model"] for r in result["rows"]):
    config = ", ".join(f"{k}={v}" for k, v in result["configs"][model].items())
    lines += [f"**{model}** ({config}).", "",
              "| variant | temp MiB | all-gathers | gathered MiB by dtype | float8 share | "
              "all-reduces (of them amaxes) | all-reduced MiB by dtype | other collectives | FP8 GEMMs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in result["rows"] if r["model"] == model):
      counts = r["counts"]
      other = ", ".join(f"{n} {k}" for k, n in counts.items()
                        if not k.startswith(("all-gather", "all-reduce"))) or "-"
      lines.append(
          f"| {r['variant']} | {report.mib(r['temp_bytes'])} | {counts.get('all-gather', 0)} | "
          f"{_by_dtype(r['bytes'].get('all-gather', {}))} | {r['float8_gather_share']:.2f} | "
          f"{counts.get('all-reduce', 0)} ({counts.get('all-reduce maximum', 0)}) | {_by_dtype(r['bytes'].get('all-reduce', {}))} | "
          f"{other} | {r['fp8_gemms']}/{r['gemms']} |")
    lines.append("")
  if result["bars"]:
    lines += report.bars_table(result["bars"])
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Variants: " + ", ".join(VARIANTS))
  p.add_argument("--model", default=",".join(DEFAULT_MODELS), metavar="LIST",
                 help=f"comma-separated models of {', '.join(models.MODELS)} (default: %(default)s)")
  p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), metavar="LIST",
                 help="comma-separated variants (listed below), or all (default: %(default)s)")
  p.add_argument("--devices", type=cli.positive_int, default=8,
                 help="GPUs on the mesh's one axis (default: %(default)s)")
  p.add_argument("--preset", default="gpu", choices=("gpu", "cpu"),
                 help="model sizes (default: %(default)s, the sizes of the GPU benchmarks)")
  p.add_argument("--batch", type=cli.positive_int, help="batch size (default: the preset's)")
  p.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE,
                 help="where compiled censuses are kept by program hash (default: %(default)s)")
  p.add_argument("--no-cache", action="store_true", help="compile every step again")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true", help="smoke-sized models: a CI check")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def main(argv: list[str] | None = None) -> int:
  """Compiles, counts and writes ``fsdp-census-h100x<devices>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  p = build_parser()
  args = p.parse_args(argv)
  gpu_bench.require_plugin(p)
  names = cli.choose(args.model, models.MODELS, DEFAULT_MODELS, "model")
  variants = cli.choose(args.variants, VARIANTS, VARIANTS, "variant")
  mesh = gpu_lib.topology_mesh("h100", args.devices, AXIS)
  device = mesh.devices.flat[0]
  cache = None if args.no_cache else args.cache
  rows, configs = [], {}
  for name in names:
    problem = models.build_problem(name, "smoke" if args.smoke else args.preset, batch=args.batch)
    configs[name] = problem.config
    for variant in variants:
      row = dict(model=name, **measure(variant, problem, mesh, cache))
      counts = row["counts"]
      print(f"{name:12s} {variant:16s} temp {report.mib(row['temp_bytes']):>8s} MiB  "
            f"all-gather {counts.get('all-gather', 0):3d} ({_by_dtype(row['bytes'].get('all-gather', {}))})"
            f"  float8 {row['float8_gather_share']:.2f}  all-reduce {counts.get('all-reduce', 0):3d} (amax {counts.get('all-reduce maximum', 0)})"
            f"  {'(cached)' if row['cached'] else 'compiled in %.0f s' % row['compile_s']}",
            flush=True)
      rows.append(row)
  bars = check_bars(rows, meaningful=not args.smoke)
  meta = report.meta(cli.command(PROG, argv), gpu_bench.CompiledFor(device),
                     args=cli.args_record(args))
  result = dict(meta=meta, devices=args.devices, target_device=device.device_kind,
                configs=configs, rows=rows, bars=bars)
  stem = report.output_dir(args.out, args.smoke) / f"fsdp-census-h100x{args.devices}-{meta['date']}"
  report.publish(result, stem, markdown(result))
  return report.bars_status(bars, args.strict)


if __name__ == "__main__":
  sys.exit(main())

"""From what GEMM size FP8 pays on an H100: a roofline estimate of the compiled program.

Run ``python -m benchmarks.fp8_sizes --help``. For each shape ``(M, K, N)`` it
compiles, for an H100 that this machine does not have (deviceless, as
``benchmarks.gpu_compile`` does), one linear layer's training work: the
product ``y = x @ w`` of ``x: (M, K)`` and ``w: (K, N)`` and both backward
GEMMs (``jax.vjp`` pulled back with a cotangent ``g: (M, N)``), under
``jmp.autocast(..., bfloat16)`` once without FP8 and once with
``fp8=Float8Recipe(min_size=0)``. It reads every kernel of the optimised HLO
(``hlo_census.kernels``: fusions, GEMM library calls, Triton GEMM fusions,
with the bytes each reads and writes and its GEMM FLOPs) and estimates::

  time = sum over kernels of  launch + max(flops / peak(dtype), bytes / HBM)   (a GEMM)
                              launch + bytes / HBM                             (any other)

with the dense H100 SXM peaks (:data:`H100`) and a fixed launch cost per
kernel (``--launch-us``). It reports the estimated FP8 / bf16 time per shape,
the kernel counts and the bytes FP8 adds, sets the model beside torchao's
measured speedups (:data:`TORCHAO`), and picks the smallest power of two from
which FP8 is estimated to pay for every larger square shape under every flag
set: the default of ``Float8Recipe.min_size`` (``docs/fp8.md``). It is an
estimate from the program, not a timing: nothing runs.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import gpu_compile  # Sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK before JAX starts.
from benchmarks import hlo_census
from benchmarks import report
from jmp_lite._src.diagnostics import gpu_compile as gpu_lib

PROG = "python -m benchmarks.fp8_sizes"
# Dense peaks and HBM bandwidth of the H100 SXM, from NVIDIA's H100 Tensor Core GPU
# datasheet (its tensor-core figures are with 2:4 sparsity: 1979 bf16 and 3958 FP8
# TFLOPS; the dense rates are half).
H100 = dict(bf16_flops=989e12, fp8_flops=1979e12, hbm_bytes=3.35e12)
LAUNCH_US = 1.0  # A kernel's fixed cost: its launch and the gap to the next (see docs/fp8.md).
SENSITIVITY_US = (0.0, 1.0, 2.0, 4.0)
SQUARES = (256, 512, 1024, 2048, 3072, 4096, 8192)
# torchao's measured fwd+bwd speedups of a Float8Linear (tensorwise) over bf16 on an
# H100, at its two worked examples (torchao/float8/README.md, "Performance").
TORCHAO = {(1024, 2048, 1024): 0.80, (4096, 8192, 16384): 1.39}
# One GEMM size small, the other two large: where min_size's "each of the three" bites.
SKINNY = ((16384, 16384, 2048), (16384, 16384, 4096), (2048, 16384, 16384),
          (4096, 16384, 16384), (16384, 2048, 16384), (16384, 4096, 16384))
SHAPES = tuple((s, s, s) for s in SQUARES) + tuple(TORCHAO) + SKINNY
SMOKE_SHAPES = ((256, 256, 256), (512, 512, 512))


def linear_work(recipe: Any) -> Any:
  """``(w, x, g) -> (y, (dw, dx))``: one linear layer's forward and backward, autocast to bf16."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  layer = jmp.autocast(lambda w, x: x @ w, jnp.bfloat16, fp8=recipe)

  def work(w: Any, x: Any, g: Any) -> Any:
    y, pullback = jax.vjp(layer, w, x)
    return y, pullback(g)

  return jax.jit(work)


def compile_linear(shape: tuple[int, int, int], fp8: bool, target: str,
                   flags: dict[str, Any]) -> Any:
  """:func:`linear_work` for ``(M, K, N)``, all in FP8 (``min_size=0``) or in bf16, compiled."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  m, k, n = shape
  args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((k, n), (m, k), (m, n)))
  recipe = jmp.Float8Recipe(min_size=0) if fp8 else None
  return gpu_lib.compile_placed(linear_work(recipe), args, target, flags)


def kernel_seconds(k: hlo_census.Kernel, launch_s: float, peaks: dict[str, float] = H100) -> float:
  """The roofline time of one kernel: its launch plus its FLOPs or its bytes, whichever is slower.

  Examples:
    >>> gemm = hlo_census.Kernel("g", "fusion", 2 * 10**9, 10**9, flops=2 * 10**12, float8=True)
    >>> round(kernel_seconds(gemm, 1e-6) * 1e6, 1)  # 2 TFLOP at 1979 TFLOP/s > 3 GB at 3.35 TB/s
    1011.6
    >>> round(kernel_seconds(hlo_census.Kernel("c", "fusion", 670, 0), 0.0) * 1e9, 1)
    0.2
  """
  memory = k.bytes / peaks["hbm_bytes"]
  if not k.flops:
    return launch_s + memory
  peak = peaks["fp8_flops"] if k.float8 else peaks["bf16_flops"]
  return launch_s + max(k.flops / peak, memory)


def _epilogue(kernels: list[hlo_census.Kernel]) -> list[hlo_census.Kernel]:
  """The kernels that are no GEMM but read a GEMM's product (split-K sums, FP8 rescales)."""
  gemms = {k.name for k in kernels if k.flops}
  return [k for k in kernels if not k.flops and gemms.intersection(k.inputs)]


def program(kernels: list[hlo_census.Kernel], launch_s: float) -> dict[str, Any]:
  """The totals of one compiled program: kernels, bytes, GEMM FLOPs, estimated and epilogue time."""
  return dict(kernels=len(kernels), gemms=sum(bool(k.flops) for k in kernels),
              float8_gemms=sum(k.float8 for k in kernels), bytes=sum(k.bytes for k in kernels),
              flops=sum(k.flops for k in kernels),
              time_s=sum(kernel_seconds(k, launch_s) for k in kernels),
              epilogue_s=sum(kernel_seconds(k, launch_s) for k in _epilogue(kernels)))


def compare(bf16: dict[str, Any], fp8: dict[str, Any]) -> dict[str, float]:
  """FP8 against bf16: the time ratio, speedup, bytes added, and the ratio with scales in the GEMM.

  ``ratio_scales_in_gemm`` takes away the time FP8's epilogue kernels add over
  bf16's: what the FP8 program would cost if the GEMM applied the two scales
  itself (as torch's ``_scaled_mm`` does) instead of a kernel rereading its product.

  Examples:
    >>> compare(dict(time_s=4.0, bytes=10, epilogue_s=0.0), dict(time_s=3.0, bytes=15, epilogue_s=1.0))
    {'ratio': 0.75, 'speedup': 1.3333333333333333, 'extra_bytes': 5, 'ratio_scales_in_gemm': 0.5}
  """
  fused = fp8["time_s"] - max(0.0, fp8["epilogue_s"] - bf16["epilogue_s"])
  return dict(ratio=fp8["time_s"] / bf16["time_s"], speedup=bf16["time_s"] / fp8["time_s"],
              extra_bytes=fp8["bytes"] - bf16["bytes"], ratio_scales_in_gemm=fused / bf16["time_s"])


def pick_min_size(ratios: dict[tuple[str, int], float]) -> int | None:
  """The smallest power of two from which every measured square shape is estimated to pay.

  Args:
    ratios: FP8 / bf16 estimated time by ``(flag set, M = K = N)``.

  Returns:
    The smallest power of two ``p`` such that every square of size ``>= p``
    has a ratio below 1 under every flag set (rounded up: at ``p`` itself FP8
    pays), or ``None`` if the largest square does not pay.

  Examples:
    >>> pick_min_size({("a", 1024): 1.3, ("a", 2048): 1.1, ("a", 3072): 0.95, ("a", 4096): 0.9})
    4096
    >>> pick_min_size({("a", 1024): 0.9, ("a", 2048): 1.1, ("b", 2048): 0.9, ("a", 4096): 0.9})
    4096
    >>> pick_min_size({("a", 256): 0.9, ("a", 512): 0.8}), pick_min_size({("a", 256): 1.2}) is None
    (256, True)
  """
  sizes = sorted({s for _, s in ratios})
  pays = {s: all(r < 1.0 for (_, t), r in ratios.items() if t == s) for s in sizes}
  start = None
  for s in reversed(sizes):
    if not pays[s]:
      break
    start = s
  return None if start is None else 2 ** math.ceil(math.log2(start))


Compiled = dict[tuple[str, tuple[int, int, int]], dict[str, list[hlo_census.Kernel]]]


def measure(shapes: list[tuple[int, int, int]], flag_sets: list[str], target: str) -> Compiled:
  """The kernels of every shape, in bf16 and in FP8, under every flag set."""
  found: Compiled = {}
  for flags in flag_sets:
    for shape in shapes:
      found[flags, shape] = {mode: hlo_census.kernels(compile_linear(
          shape, mode == "fp8", target, gpu_compile.FLAG_SETS[flags]).as_text())
                             for mode in ("bf16", "fp8")}
  return found


def estimate(found: Compiled, launch_us: float) -> list[dict[str, Any]]:
  """One row per flag set and shape: both programs' totals and :func:`compare`, at ``launch_us``."""
  rows = []
  for (flags, (m, k, n)), kernels in found.items():
    bf16, fp8 = (program(kernels[mode], launch_us * 1e-6) for mode in ("bf16", "fp8"))
    rows.append(dict(flags=flags, m=m, k=k, n=n, bf16=bf16, fp8=fp8, **compare(bf16, fp8)))
  return rows


def pick(rows: list[dict[str, Any]]) -> int | None:
  """:func:`pick_min_size` of the square shapes of ``rows``."""
  return pick_min_size({(r["flags"], r["m"]): r["ratio"] for r in rows if r["m"] == r["k"] == r["n"]})


def torchao_comparison(found: Compiled, launch_us: float) -> list[dict[str, Any]]:
  """The model's speedups at torchao's shapes, beside torchao's measured ones.

  torchao sums the GPU time of the kernels (``torch.profiler``), so the
  like-for-like model has no launch cost; ``launch_us`` gives a second column.
  """
  rows = {launch: [r for r in estimate(found, launch) if (r["m"], r["k"], r["n"]) in TORCHAO]
          for launch in (0.0, launch_us)}
  return [dict(flags=r["flags"], shape=(r["m"], r["k"], r["n"]), torchao=TORCHAO[r["m"], r["k"], r["n"]],
               model_no_launch=r["speedup"], model_scales_in_gemm=1 / r["ratio_scales_in_gemm"],
               model=at_launch["speedup"])
          for r, at_launch in zip(rows[0.0], rows[launch_us])]


def check_bars(rows: list[dict[str, Any]], min_size: int, meaningful: bool) -> list[dict[str, Any]]:
  """Whether jmp_lite's default ``min_size`` is where FP8 starts to pay: at it, and at half of it."""
  found = []
  for r in rows:
    if r["m"] == r["k"] == r["n"] == min_size:
      found.append(bars_lib.bar("fp8_at_min_size", f"FP8 / bf16 estimated time at M=K=N={min_size} "
                                "(the default min_size)", r["ratio"], 1.0, meaningful, case=r["flags"]))
    if r["m"] == r["k"] == r["n"] == min_size // 2 and min_size > 1:
      found.append(bars_lib.bar("bf16_below_min_size", f"bf16 / FP8 estimated time at M=K=N="
                                f"{min_size // 2} (half the default)", 1 / r["ratio"], 1.0,
                                meaningful, case=r["flags"]))
  return found


def markdown(result: dict[str, Any]) -> str:
  """The report: the table per flag set, torchao's shapes, the pick and its sensitivity, the bars."""
  us = lambda s: f"{s * 1e6:,.1f}"
  lines = [report.meta_line(result["meta"]), "",
           f"**Estimated from the program compiled for an {result['target_device']}, not run.** "
           f"Roofline per kernel: GEMM max(FLOPs / peak, bytes / HBM), others bytes / HBM, plus "
           f"{result['launch_us']} µs per kernel; peaks bf16 {H100['bf16_flops'] / 1e12:.0f} and FP8 "
           f"{H100['fp8_flops'] / 1e12:.0f} TFLOP/s dense, HBM {H100['hbm_bytes'] / 1e12:.2f} TB/s. "
           "Work: y = x @ w and both backward GEMMs, x (M, K), w (K, N).", ""]
  for flags in dict.fromkeys(r["flags"] for r in result["rows"]):
    lines += [f"Flags `{flags}` {gpu_compile.FLAG_SETS[flags] or '(XLA defaults)'}.", "",
              "| M | K | N | bf16 µs | FP8 µs | FP8 / bf16 | kernels bf16 / FP8 | FP8 GEMMs "
              "| FP8 extra MiB | FP8 / bf16, scales in the GEMM |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['m']} | {r['k']} | {r['n']} | {us(r['bf16']['time_s'])} | {us(r['fp8']['time_s'])} "
              f"| **{r['ratio']:.2f}** | {r['bf16']['kernels']} / {r['fp8']['kernels']} "
              f"| {r['fp8']['float8_gemms']} / {r['fp8']['gemms']} | {r['extra_bytes'] / 2**20:,.1f} "
              f"| {r['ratio_scales_in_gemm']:.2f} |" for r in result["rows"] if r["flags"] == flags]
    lines.append("")
  if result["torchao"]:
    lines += ["| flags | M, K, N | torchao measured speedup | model, no launch cost | model, no launch "
              f"cost, scales in the GEMM | model, {result['launch_us']} µs per kernel |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {t['flags']} | {', '.join(map(str, t['shape']))} | {t['torchao']:.2f} | "
              f"{t['model_no_launch']:.2f} | {t['model_scales_in_gemm']:.2f} | {t['model']:.2f} |"
              for t in result["torchao"]]
    lines.append("")
  lines += ["| launch µs per kernel | " + " | ".join(str(k) for k in result["picks"]) + " |",
            "|---" * (len(result["picks"]) + 1) + "|",
            "| smallest power of two from which FP8 pays | "
            + " | ".join(str(v or "none") for v in result["picks"].values()) + " |", "",
            f"jmp_lite's default `Float8Recipe.min_size`: **{result['min_size']}**.", ""]
  if result["bars"]:
    lines += report.bars_table(result["bars"], where="case")
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Shapes (M,K,N): " + " ".join("x".join(map(str, s)) for s in SHAPES)
                 + ". Flag sets: " + ", ".join(f"{k} {v or '(XLA defaults)'}"
                                              for k, v in gpu_compile.FLAG_SETS.items()))
  p.add_argument("--flags", default="all", metavar="LIST",
                 help="comma-separated flag sets (listed below), or all (default: %(default)s)")
  p.add_argument("--launch-us", type=float, default=LAUNCH_US,
                 help="fixed cost of one kernel in microseconds (default: %(default)s)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true",
                 help="two small square shapes (" + ", ".join("x".join(map(str, s)) for s in SMOKE_SHAPES)
                      + "): a CI check")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The options; a usage error without the CUDA plugin or for a negative ``--launch-us``."""
  p = build_parser()
  args = p.parse_args(argv)
  gpu_compile.require_plugin(p)
  if not (args.launch_us >= 0 and math.isfinite(args.launch_us)):
    p.error(f"--launch-us must be a finite number >= 0, got {args.launch_us}")
  return args


def main(argv: list[str] | None = None) -> int:
  """Compiles, estimates and writes ``fp8-sizes-h100-<date>.{json,md}``."""
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  flag_sets = cli.choose(args.flags, tuple(gpu_compile.FLAG_SETS), tuple(gpu_compile.FLAG_SETS),
                         "flag set")
  device = gpu_lib.topology_sharding("h100").mesh.devices.flat[0]
  found = measure(list(SMOKE_SHAPES if args.smoke else SHAPES), flag_sets, "h100")
  rows = estimate(found, args.launch_us)
  for r in rows:
    print(f"{r['flags']:15s} {r['m']:>6d} {r['k']:>6d} {r['n']:>6d}  FP8/bf16 {r['ratio']:.3f}  "
          f"kernels {r['bf16']['kernels']}/{r['fp8']['kernels']}  +{r['extra_bytes'] / 2**20:.1f} MiB")
  min_size = jmp.Float8Recipe().min_size
  meta = report.meta(cli.command(PROG, argv), gpu_compile.CompiledFor(device),
                     args=cli.args_record(args))
  result = dict(meta=meta, target_device=device.device_kind, peaks=H100, launch_us=args.launch_us,
                rows=rows, torchao=torchao_comparison(found, args.launch_us), min_size=min_size,
                picks={launch: pick(estimate(found, launch))
                       for launch in sorted({args.launch_us, *SENSITIVITY_US})},
                bars=check_bars(rows, min_size, meaningful=not args.smoke))
  stem = report.output_dir(args.out, args.smoke) / f"fp8-sizes-h100-{meta['date']}"
  report.publish(result, stem, markdown(result))
  return report.bars_status(result["bars"], args.strict)


if __name__ == "__main__":
  sys.exit(main())

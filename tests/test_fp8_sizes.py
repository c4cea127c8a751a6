"""From what size FP8 pays (issue 30 item 2): the kernel reader, the roofline and the default.

The kernel reader and the roofline run anywhere. The compiles for an H100 need
JAX's CUDA plugin (no GPU): without it they skip, as in ``test_gpu_compile.py``.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import fp8_sizes
from benchmarks import gpu_compile
from benchmarks import hlo_census
from jmp_lite._src.fp8 import recipe as fp8_lib

needs_plugin = pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                                  reason=str(gpu_compile.plugin_missing()))


def test_kernels_of_an_xla_cpu_program_carry_their_bytes_and_gemm_flops():
  f = jax.jit(lambda a, b: jnp.tanh(a @ b))
  a, b = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 32), jnp.float32)
  kernels = hlo_census.kernels(f.lower(a, b).compile().as_text())
  gemms = [k for k in kernels if k.flops]
  assert len(gemms) == 1 and gemms[0].flops == 2 * 8 * 16 * 32 and not gemms[0].float8
  assert gemms[0].read_bytes == (8 * 16 + 16 * 32) * 4
  assert sum(k.write_bytes for k in kernels if k is not gemms[0]) == 8 * 32 * 4  # the tanh's output
  assert all(not k.flops for k in kernels if k is not gemms[0])


def test_roofline_charges_a_launch_per_kernel_and_the_slower_of_flops_and_bytes():
  launch = 1e-6
  gemm = hlo_census.Kernel("g", "fusion", 10**6, 10**6, flops=2 * 10**12, float8=False)
  fp8 = hlo_census.Kernel("g", "fusion", 10**6, 10**6, flops=2 * 10**12, float8=True)
  copy = hlo_census.Kernel("c", "fusion", 3 * 10**9, 0)
  peaks = fp8_sizes.H100
  assert fp8_sizes.kernel_seconds(gemm, launch) == launch + 2e12 / peaks["bf16_flops"]
  assert fp8_sizes.kernel_seconds(fp8, launch) == launch + 2e12 / peaks["fp8_flops"]
  assert fp8_sizes.kernel_seconds(copy, 0.0) == 3e9 / peaks["hbm_bytes"]
  total = fp8_sizes.program([gemm, copy], launch)
  assert total["kernels"] == 2 and total["gemms"] == 1 and total["float8_gemms"] == 0
  assert total["time_s"] == fp8_sizes.kernel_seconds(gemm, launch) + fp8_sizes.kernel_seconds(copy, launch)
  assert total["epilogue_s"] == 0.0  # the copy reads no GEMM's product


def test_epilogue_is_what_reads_a_gemms_product():
  gemm = hlo_census.Kernel("g", "custom-call", 100, 50, flops=1000, float8=True, inputs=("x", "w"))
  rescale = hlo_census.Kernel("r", "fusion", 50, 50, inputs=("s", "g"))
  other = hlo_census.Kernel("q", "fusion", 70, 30, inputs=("x",))
  total = fp8_sizes.program([other, gemm, rescale], 0.0)
  assert total["epilogue_s"] == 100 / fp8_sizes.H100["hbm_bytes"]


def test_the_pick_is_the_power_of_two_from_which_every_larger_square_pays_everywhere():
  ratios = {("a", 2048): 1.4, ("a", 3072): 0.97, ("a", 4096): 0.9, ("a", 8192): 0.7,
            ("b", 2048): 1.5, ("b", 3072): 1.1, ("b", 4096): 0.95, ("b", 8192): 0.7}
  assert fp8_sizes.pick_min_size(ratios) == 4096
  assert fp8_sizes.pick_min_size({**ratios, ("b", 3072): 0.99}) == 4096  # 3072, rounded up
  assert fp8_sizes.pick_min_size({**ratios, ("b", 3072): 1.01, ("b", 2048): 0.9}) == 4096
  assert fp8_sizes.pick_min_size({**ratios, ("b", 3072): 0.99, ("b", 2048): 0.9,
                                  ("a", 2048): 0.9}) == 2048
  assert fp8_sizes.pick_min_size({**ratios, ("a", 8192): 1.01}) is None


@needs_plugin
def test_smoke_run_writes_the_estimates(tmp_path):
  assert fp8_sizes.main(["--smoke", "--out", str(tmp_path)]) == 0
  result = json.loads(next(tmp_path.glob("fp8-sizes-h100-*.json")).read_text())
  assert [(r["flags"], r["m"]) for r in result["rows"]] == [
      (flags, m) for flags in gpu_compile.FLAG_SETS for m, _, _ in fp8_sizes.SMOKE_SHAPES]
  for r in result["rows"]:
    size = r["m"]
    # Three GEMMs (forward, both backward), the same FLOPs in both programs.
    assert r["bf16"]["flops"] == r["fp8"]["flops"] == 3 * 2 * size**3
    assert r["fp8"]["gemms"] == r["fp8"]["float8_gemms"] == 3 and r["bf16"]["float8_gemms"] == 0
    # Amax reductions, quantisations and rescales: more kernels, more bytes; too small to pay.
    assert r["fp8"]["kernels"] > r["bf16"]["kernels"] and r["extra_bytes"] > 0
    assert r["ratio"] > 1.0
  assert result["min_size"] == fp8_lib.MIN_SIZE
  assert set(result["picks"].values()) == {None}  # no smoke shape pays
  assert "**Estimated from the program compiled for an NVIDIA H100" in next(
      tmp_path.glob("*.md")).read_text()


@needs_plugin
def test_the_default_min_size_is_where_fp8_starts_to_pay_on_the_h100():
  """FP8 is estimated to pay at M = K = N = MIN_SIZE and not at half of it, on both GEMM paths."""
  for flags in gpu_compile.FLAG_SETS:
    found = fp8_sizes.measure([(fp8_lib.MIN_SIZE // 2,) * 3, (fp8_lib.MIN_SIZE,) * 3], [flags],
                              "h100")
    half, full = (r["ratio"] for r in fp8_sizes.estimate(found, fp8_sizes.LAUNCH_US))
    assert half > 1.0 > full, (flags, half, full)


def _gemm_lines(text: str) -> list[str]:
  return [line for line in text.splitlines()
          if "__cublas$lt$matmul" in line or (" dot(" in line and "= " in line)]


@needs_plugin
def test_fp8_gemm_dims_not_multiples_of_16_are_padded_for_cublaslt_and_taken_by_triton():
  """A 100x200x10 layer: XLA pads each FP8 GEMM to multiples of 16 for cuBLASLt; Triton takes it as is.

  Neither path falls back to a half GEMM or refuses: every GEMM is float8.
  """
  shape = (100, 200, 10)
  cublas = fp8_sizes.compile_linear(shape, True, "h100", {"xla_gpu_enable_triton_gemm": False})
  text = cublas.as_text()
  fp8_calls = [line for line in _gemm_lines(text) if "__cublas$lt$matmul$f8" in line]
  assert len(fp8_calls) == len(_gemm_lines(text)) == 3
  products = {tuple(sorted(map(int, re.search(r"= \(bf16\[(\d+),(\d+)\]", line).groups())))
              for line in fp8_calls}
  assert products == {(16, 112), (16, 208), (112, 208)}  # 10 -> 16, 100 -> 112, 200 -> 208
  assert re.search(r"f8e4m3fn\[112,208\]", text) and "pad" in text
  # The results come back in the layer's own shapes.
  outputs = re.search(r"^ENTRY .* -> \((.*)\) \{$", text, re.M).group(1)
  assert outputs == "bf16[100,10], bf16[200,10], bf16[100,200]"
  triton = fp8_sizes.compile_linear(shape, True, "h100", {}).as_text()
  ops = [op for op in hlo_census.census(triton) if op.kind == "gemm"]
  assert len(ops) == 3 and all(op.float8 and op.runner == "Triton GEMM" for op in ops)
  assert not re.search(r"f8e4m3fn\[(?:112|208),", triton)  # unpadded


@needs_plugin
def test_a_negative_launch_cost_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    fp8_sizes.main(["--smoke", "--launch-us", "-1"])
  assert e.value.code == 2 and "--launch-us must be a finite number >= 0, got -1.0" in capsys.readouterr().err

"""The program an H100 would run, compiled here without one (``jmp.compile_for_gpu``, ``benchmarks.gpu_compile``).

The census of an HLO module runs anywhere. The compiles need JAX's CUDA plugin
(``pip install -e '.[gpu]'``; no GPU or driver): without it they skip, with the
reason, so that the README's test command works on a fresh machine; ``.ci/run``
installs it, so CI guards the GPU program.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lite as jmp
from benchmarks import gpu_compile
from benchmarks import hlo_census
from benchmarks import models
from conftest import classifier_batch, classifier_loss, classifier_params
from jmp_lite._src.diagnostics import gpu_compile as gpu_lib

needs_plugin = pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                                  reason=str(gpu_compile.plugin_missing()))


def test_census_reads_an_xla_cpu_program():
  """XLA:CPU's dots are the runner "XLA"; the dtypes are the dot's operands'."""
  f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T)
  a, b = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 16), jnp.bfloat16)
  ops = hlo_census.census(f.lower(a, b).compile().as_text())
  gemms = [op for op in ops if op.kind == "gemm"]
  assert len(gemms) == 2 and all(op.runner == "XLA" for op in gemms)
  assert {(op.lhs, op.rhs) for op in gemms} <= {("bf16", "bf16"), ("f32", "f32")}
  assert hlo_census.summary(ops)["fp8_fraction"] == 0.0


def test_census_finds_nothing_where_there_is_nothing():
  assert hlo_census.census(jax.jit(jnp.tanh).lower(jnp.ones(4)).compile().as_text()) == []
  assert hlo_census.summary([])["gemms"] == 0


@needs_plugin
def test_fp8_step_is_all_float8_gemms_on_both_gemm_paths(tmp_path):
  """Issue 28: every GEMM of the FP8 step multiplies float8 operands, Triton or cuBLAS."""
  assert gpu_compile.main(["--smoke", "--variants", "bf16_fp8", "--out", str(tmp_path)]) == 0
  result = json.loads(next(tmp_path.glob("gpu-compile-h100-*.json")).read_text())
  rows = {(r["model"], r["flags"], r["variant"]): r for r in result["rows"]}
  assert {m for m, _, _ in rows} == set(models.DEFAULT_MODELS)
  for (model, flags, _), r in rows.items():
    assert r["fp8_gemms"] == r["gemms"] > 0, (model, flags, r["gemm_kinds"])
    runner = "Triton GEMM" if flags == "default" else "cuBLASLt FP8"
    assert all(kind.startswith(runner) for kind in r["gemm_kinds"]), r["gemm_kinds"]
  assert rows["cnn", "default", "bf16_fp8"]["conv_kinds"] == {"cuDNN bf16 x bf16": 23}
  assert "**Compiled for an NVIDIA H100 80GB HBM3, not run**" in next(tmp_path.glob("*.md")).read_text()


def test_without_the_plugin_the_command_says_what_to_install(monkeypatch, capsys):
  monkeypatch.setattr(gpu_compile, "plugin_missing", lambda: gpu_compile.PLUGIN_HINT)
  with pytest.raises(SystemExit) as e:
    gpu_compile.main(["--smoke"])
  assert e.value.code == 2 and "pip install -e '.[gpu]'" in capsys.readouterr().err


@needs_plugin
@pytest.mark.parametrize("recipe,bf16_gemms", [
    (dict(scaling="rowwise"), 0),
    (dict(keep=r"^Dense_0/"), 2),                 # its forward and weight-gradient GEMMs
    (dict(keep=r"^Dense_0/", scaling="rowwise"), 2),
])
def test_steered_fp8_steps_compile_to_float8_gemms_except_the_kept(recipe, bf16_gemms):
  """Issue 30: rowwise and keep-rule steps hold float8 GEMMs only, but for the kept layer's."""
  problem = models.build_problem("mlp", "smoke")
  step = jmp.make_train_step(problem.loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0, **recipe))  # toy sizes: every matmul
  init = lambda: jmp.TrainState.create(params=problem.params, tx=optax.adam(1e-3))
  for flags in gpu_compile.FLAG_SETS.values():
    compiled = gpu_lib.compile_placed(step, (jax.eval_shape(init), problem.batch), "h100", flags)
    summary = hlo_census.summary(hlo_census.census(compiled.as_text()))
    assert summary["gemms"] - summary["fp8_gemms"] == bf16_gemms, summary["gemm_kinds"]
    assert all(" bf16 x bf16" in k or "f8" in k for k in summary["gemm_kinds"]), summary


def _fp8_linear(shape, compiler_options):
  """One linear layer's forward and both backward GEMMs, every one in FP8, compiled for an H100."""
  layer = jmp.autocast(lambda w, x: x @ w, jnp.bfloat16, fp8=jmp.Float8Recipe(min_size=0))

  def work(w, x, g):
    y, pullback = jax.vjp(layer, w, x)
    return y, pullback(g)

  m, k, n = shape
  args = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((k, n), (m, k), (m, n)))
  return gpu_lib.compile_placed(work, args, "h100", compiler_options).as_text()


def _gemm_lines(text):
  return [line for line in text.splitlines()
          if "__cublas$lt$matmul" in line or (" dot(" in line and "= " in line)]


@needs_plugin
def test_fp8_gemm_dims_not_multiples_of_16_are_padded_for_cublaslt_and_taken_by_triton():
  """A 100x200x10 layer: XLA pads each FP8 GEMM to multiples of 16 for cuBLASLt; Triton takes it as is.

  Neither path falls back to a half GEMM or refuses: every GEMM is float8.
  """
  shape = (100, 200, 10)
  text = _fp8_linear(shape, {"xla_gpu_enable_triton_gemm": False})
  fp8_calls = [line for line in _gemm_lines(text) if "__cublas$lt$matmul$f8" in line]
  assert len(fp8_calls) == len(_gemm_lines(text)) == 3
  products = {tuple(sorted(map(int, re.search(r"= \(bf16\[(\d+),(\d+)\]", line).groups())))
              for line in fp8_calls}
  assert products == {(16, 112), (16, 208), (112, 208)}  # 10 -> 16, 100 -> 112, 200 -> 208
  assert re.search(r"f8e4m3fn\[112,208\]", text) and "pad" in text
  # The results come back in the layer's own shapes.
  outputs = re.search(r"^ENTRY .* -> \((.*)\) \{$", text, re.M).group(1)
  assert outputs == "bf16[100,10], bf16[200,10], bf16[100,200]"
  triton = _fp8_linear(shape, {})
  ops = [op for op in hlo_census.census(triton) if op.kind == "gemm"]
  assert len(ops) == 3 and all(op.float8 and op.runner == "Triton GEMM" for op in ops)
  assert not re.search(r"f8e4m3fn\[(?:112|208),", triton)  # unpadded


@needs_plugin
def test_the_skip_is_a_select_on_the_gpu_and_a_cond_on_the_cpu():
  """skip.either: XLA:GPU would copy every operand a conditional passes through."""
  from benchmarks import variants  # pylint: disable=import-outside-toplevel

  problem = models.build_problem("mlp", "smoke")
  variant = variants.make_variant("f16_dynamic", problem)
  gpu = gpu_lib.compile_placed(variant.fn, (jax.eval_shape(variant.init), problem.batch),
                             "h100", {}).as_text()
  cpu = variant.fn.lower(variant.init(), problem.batch).compile().as_text()
  assert " conditional(" not in gpu and " conditional(" in cpu


# ------------------------------------------------------------ jmp.compile_for_gpu


def _classifier_step(**kwargs):
  step = jmp.make_train_step(classifier_loss, jmp.get_policy("mixed_bfloat16"), **kwargs)
  init = lambda: jmp.TrainState.create(params=classifier_params(), tx=optax.adam(1e-3))
  return step, jax.eval_shape(init), classifier_batch()


@needs_plugin
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compile_for_gpu_reports_the_gemms_of_a_users_train_step(fp8):
  """Issue 37: a user's own make_train_step, compiled for an H100 on this machine."""
  kwargs = dict(autocast=True, fp8=jmp.Float8Recipe(min_size=0)) if fp8 else {}
  step, state, batch = _classifier_step(**kwargs)
  report = jmp.compile_for_gpu(step, state, batch, target="h100")
  assert report.device_kind == "NVIDIA H100 80GB HBM3" and report.target == "h100"
  # Two matmuls forward, and each has a weight gradient; the first layer's input
  # gradient is not needed (x is data), the second's is: 5 GEMMs.
  assert report.num_gemms == 5 == len([op for op in report.ops if op.kind == "gemm"])
  if fp8:
    assert report.fp8_gemms == 5, report.gemms
  else:
    assert report.fp8_gemms == 0 and all(k.endswith("bf16 x bf16") for k in report.gemms), report
  assert all(re.fullmatch(r"(cuBLASLt FP8|cuBLASLt|cuBLAS|Triton GEMM|XLA) \w+ x \w+", k)
             for k in report.gemms), report.gemms
  assert report.convolutions == {}
  assert report.temp_bytes > 0 and report.output_bytes > 0
  # The state is donated: its buffers come back as outputs.
  assert 0 < report.alias_bytes <= report.argument_bytes
  assert f"{report.num_gemms} GEMMs, {report.fp8_gemms} on float8 operands" in str(report)


@needs_plugin
def test_compile_for_gpu_takes_any_jittable_function_and_xla_options():
  """A plain (not jitted) function with a convolution, on arrays; cuBLAS when Triton is off."""
  def f(x, w, k):
    y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.tanh(y.reshape(x.shape[0], -1) @ w)

  x = jnp.ones((8, 16, 16, 32), jnp.bfloat16)
  k = jnp.ones((3, 3, 32, 32), jnp.bfloat16)
  w = jnp.ones((16 * 16 * 32, 64), jnp.bfloat16)
  report = jmp.compile_for_gpu(f, x, w, k, compiler_options={"xla_gpu_enable_triton_gemm": False})
  assert report.gemms == {"cuBLASLt bf16 x bf16": 1}, report.gemms
  assert report.convolutions == {"cuDNN bf16 x bf16": 1}, report.convolutions
  assert report.argument_bytes == 2 * (x.size + k.size + w.size)
  assert report.output_bytes == 2 * 8 * 64


def test_compile_for_gpu_report_prints_as_a_table():
  op = hlo_census.Op("cuBLASLt", "bf16", "bf16", "d")
  report = jmp.GpuCompileReport("h100", "NVIDIA H100 80GB HBM3", {"cuBLASLt bf16 x bf16": 3},
                                {}, 3 * 2**20, 2**20, 2**19, 0, (op, op, op))
  assert str(report) == "\n".join([
      "compiled for NVIDIA H100 80GB HBM3 (h100), not run",
      "  temp 3.0 MiB, arguments 1.0 MiB, outputs 0.5 MiB (aliased 0.0 MiB)",
      "  3 GEMMs, 0 on float8 operands",
      "  GEMMs                 count",
      "  cuBLASLt bf16 x bf16      3",
      "  convolutions: none",
  ])


def test_compile_for_gpu_without_the_plugin_says_what_to_install(monkeypatch):
  monkeypatch.setattr(gpu_lib, "_PLUGINS", ("jax_plugins.no_such_plugin",))
  step, state, batch = _classifier_step()
  with pytest.raises(RuntimeError, match=r"pip install 'jmp_lite\[gpu\]'"):
    jmp.compile_for_gpu(step, state, batch)


def test_compile_for_gpu_rejects_an_unknown_target():
  step, state, batch = _classifier_step()
  with pytest.raises(ValueError, match=r"target must be one of \['h100'\], got 'a100'"):
    jmp.compile_for_gpu(step, state, batch, target="a100")


def test_the_h100_target_ships_inside_the_package():
  """The wheel packages jmp_lite/ only: the target description must live there."""
  path = gpu_lib.GPU_TARGETS["h100"]
  assert path.is_file() and pathlib.Path(jmp.__file__).parent in path.parents
  assert "cuda_compute_capability { major: 9 minor: 0 }" in path.read_text()  # Hopper, sm_90


def test_the_gpu_memory_is_read_from_the_target_file():
  text = gpu_lib.GPU_TARGETS["h100"].read_text()
  size = int(re.search(r"device_memory_size: (\d+)", text).group(1))
  assert gpu_lib.device_memory_bytes("h100") == size and 79 * 2**30 < size < 80 * 2**30


@needs_plugin
def test_a_program_larger_than_the_gpu_warns(monkeypatch):
  """Issue 42 item 7: a 160 GB program compiled for an 80 GB H100 said nothing."""
  f = jax.grad(lambda w, x: jnp.tanh(x @ w).sum())
  w, x = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16)
  report = jmp.compile_for_gpu(f, w, x)  # Fits: no warning (the suite errors on one).
  assert report.memory_bytes == (report.argument_bytes + report.output_bytes
                                 - report.alias_bytes + report.temp_bytes) > 0
  # The GPU made smaller than the program, rather than the program larger than 80 GB.
  monkeypatch.setattr(gpu_lib, "device_memory_bytes", lambda target: report.memory_bytes - 1)
  with pytest.warns(UserWarning, match=r"compiled for h100 needs .* more than .* the NVIDIA H100"):
    jmp.compile_for_gpu(f, w, x)
  monkeypatch.setattr(gpu_lib, "device_memory_bytes", lambda target: report.memory_bytes)
  assert jmp.compile_for_gpu(f, w, x).memory_bytes == report.memory_bytes  # Exactly fits.


def test_topology_mesh_rejects_a_bad_device_count():
  with pytest.raises(ValueError, match="devices must be an int >= 1, got 0"):
    gpu_lib.topology_mesh("h100", 0)


@needs_plugin
def test_an_fsdp_fp8_step_for_8_h100s_gathers_its_weights_as_float8():
  """Issue 44: the weights cast to float8 on their shards, with the amax known before the gather."""
  from benchmarks import fsdp_census  # pylint: disable=import-outside-toplevel

  def loss_fn(p, b):
    h = jax.nn.relu(b["x"] @ p["w1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)

  params = {"w1": jnp.ones((256, 512)), "w2": jnp.ones((512, 128))}
  batch = {"x": jnp.ones((64, 256)), "y": jnp.ones((64, 128))}
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0))
  state = jax.eval_shape(lambda: jmp.TrainState.create(params=params, tx=optax.adam(1e-3)))
  mesh = gpu_lib.topology_mesh("h100", 8)
  report = jmp.compile_for_gpu(step, fsdp_census.fsdp_structs(state, mesh),
                               fsdp_census.fsdp_structs(batch, mesh))
  gathered: dict[str, int] = {}
  for c in report.collectives:
    if c.kind == "all-gather":
      for dtype, n in c.bytes_by_dtype:
        gathered[dtype] = gathered.get(dtype, 0) + n
  assert gathered.get("f8e4m3fn", 0) >= 256 * 512 + 512 * 128, gathered  # Both weights, 1 byte each.
  assert gathered.get("bf16", 0) < 256 * 512, gathered  # No weight in bf16.

"""The program an H100 would run, compiled here without one (``benchmarks.gpu_compile``).

The census of an HLO module runs anywhere. The compiles need JAX's CUDA plugin
(``pip install -e '.[gpu]'``; no GPU or driver): without it they skip, with the
reason, so that the README's test command works on a fresh machine; ``.ci/run``
installs it, so CI guards the GPU program.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import fp8_sizes
from benchmarks import gpu_compile
from benchmarks import hlo_census
from benchmarks import models

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


@needs_plugin
def test_step_needs_no_more_memory_than_jmp_on_a_parameter_heavy_model():
  """Issue 28: the MLP 4x4096 (235 MB of params) needed 2.7x jmp's temp memory."""
  problem = models.build_problem("mlp", "gpu")
  sharding = gpu_compile.topology_sharding(gpu_compile.TARGETS["h100"])
  temp = {name: gpu_compile.measure(name, problem, sharding, {})["temp_bytes"]
          for name in ("jmp_dynamic", "f16_dynamic", "bf16", "bf16_lean")}
  assert temp["f16_dynamic"] <= 1.02 * temp["jmp_dynamic"], temp
  assert temp["bf16"] <= 1.02 * temp["jmp_dynamic"], temp
  assert temp["bf16_lean"] < temp["bf16"], temp


@needs_plugin
def test_fp8_step_needs_less_memory_than_bf16_autocast_on_the_transformer():
  problem = models.build_problem("transformer", "gpu", layers=1, batch=8)
  sharding = gpu_compile.topology_sharding(gpu_compile.TARGETS["h100"])
  fp8, bf16 = (gpu_compile.measure(name, problem, sharding, {})
               for name in ("bf16_fp8", "bf16_autocast"))
  assert fp8["fp8_gemms"] == fp8["gemms"] > 0
  assert fp8["temp_bytes"] < bf16["temp_bytes"], (fp8["temp_bytes"], bf16["temp_bytes"])


@pytest.mark.parametrize("command", ["gpu_compile", "fp8_sizes"])
def test_without_the_plugin_the_command_says_what_to_install(command, monkeypatch, capsys):
  monkeypatch.setattr(gpu_compile, "plugin_missing", lambda: gpu_compile.PLUGIN_HINT)
  main = {"gpu_compile": gpu_compile.main, "fp8_sizes": fp8_sizes.main}[command]
  with pytest.raises(SystemExit) as e:
    main(["--smoke"])
  assert e.value.code == 2 and "pip install -e '.[gpu]'" in capsys.readouterr().err


@needs_plugin
@pytest.mark.parametrize("recipe,bf16_gemms", [
    (dict(scaling="rowwise"), 0),
    (dict(keep=r"^Dense_0/"), 2),                 # its forward and weight-gradient GEMMs
    (dict(keep=r"^Dense_0/", scaling="rowwise"), 2),
])
def test_steered_fp8_steps_compile_to_float8_gemms_except_the_kept(recipe, bf16_gemms):
  """Issue 30: rowwise and keep-rule steps hold float8 GEMMs only, but for the kept layer's."""
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  problem = models.build_problem("mlp", "smoke")
  step = jmp.make_train_step(problem.loss_fn, jmp.get_policy("mixed_bfloat16"), autocast=True,
                             fp8=jmp.Float8Recipe(min_size=0, **recipe))  # toy sizes: every matmul
  init = lambda: jmp.TrainState.create(params=problem.params, tx=optax.adam(1e-3))
  sharding = gpu_compile.topology_sharding(gpu_compile.TARGETS["h100"])
  for flags in gpu_compile.FLAG_SETS.values():
    compiled = gpu_compile.compile_step(step, (jax.eval_shape(init), problem.batch), sharding, flags)
    summary = hlo_census.summary(hlo_census.census(compiled.as_text()))
    assert summary["gemms"] - summary["fp8_gemms"] == bf16_gemms, summary["gemm_kinds"]
    assert all(" bf16 x bf16" in k or "f8" in k for k in summary["gemm_kinds"]), summary


@needs_plugin
def test_the_skip_is_a_select_on_the_gpu_and_a_cond_on_the_cpu():
  """skip.either: XLA:GPU would copy every operand a conditional passes through."""
  from benchmarks import variants  # pylint: disable=import-outside-toplevel

  problem = models.build_problem("mlp", "smoke")
  variant = variants.make_variant("f16_dynamic", problem)
  sharding = gpu_compile.topology_sharding(gpu_compile.TARGETS["h100"])
  gpu = gpu_compile.compile_step(variant.fn, (jax.eval_shape(variant.init), problem.batch),
                                 sharding, {}).as_text()
  cpu = variant.fn.lower(variant.init(), problem.batch).compile().as_text()
  assert " conditional(" not in gpu and " conditional(" in cpu

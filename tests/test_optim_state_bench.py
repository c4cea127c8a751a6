"""``python -m benchmarks.optim_state`` (issue 35): its bars, its persistent column and its smoke run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_compile
from benchmarks import optim_state
from benchmarks import report

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bars_compare_the_update_temp_with_adamw_and_the_persistent_bytes_with_4_1():
  rows = [dict(model="m", variant="adamw", temp_bytes=100, persistent_per_param=12.0),
          dict(model="m", variant="int8", temp_bytes=90, persistent_per_param=4.03),
          dict(model="m", variant="float8", temp_bytes=120, persistent_per_param=4.03)]
  bars = optim_state.check_bars(rows, meaningful=True)
  assert [(b["what"], b["value"], b["passed"]) for b in bars] == [
      ("int8 / adamw H100 update temp", 0.9, True),
      ("float8 / adamw H100 update temp", 1.2, False),
      ("int8 + bf16 masters: persistent bytes/param", 4.03, True)]


def test_persistent_bytes_from_shapes_only():
  params = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32),
            "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
  adamw, int8 = (optim_state.persistent(v, params) for v in ("adamw", "int8"))
  n = 64 * 256 + 64
  assert adamw["params"] == int8["params"] == n
  assert adamw["persistent_bytes"] == 12 * n + 8  # Adam's count and the step
  # bf16 masters (2) + int8 mu and uint8 nu (1 + 1) + one float32 scale per 256 (x2); the
  # 64 biases (under min_size) keep float32 moments; the rounding key (8 bytes); the codes'
  # update count (4 bytes, which seeds their rounding).
  assert int8["persistent_bytes"] == 2 * n + 2 * 64 * 256 + 2 * 4 * 64 + 8 * 64 + 8 + 8 + 4


@pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                    reason=str(gpu_compile.plugin_missing()))
@pytest.mark.parametrize("variant", ["int8", "float8", "int4"])
def test_the_h100_update_holds_no_float32_copy_of_the_state(variant):
  # A 1024 x 1024 matrix, a 4096 x 256 embedding and a bias: optax's AdamW update holds one
  # float32 buffer of the largest (4 MiB). Before the update ran in passes (block scales,
  # updates, codes), the coded update held the new mu and nu in float32 (16 MiB).
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
            "embed": jax.ShapeDtypeStruct((4096, 256), jnp.float32),
            "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
  adamw = optim_state.h100_update("adamw", params)["temp_bytes"]
  coded = optim_state.h100_update(variant, params)["temp_bytes"]
  assert adamw >= 4 * 2**20
  assert coded <= adamw // 2, (coded, adamw)


@pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                    reason=str(gpu_compile.plugin_missing()))
@pytest.mark.parametrize("variant", ["int8", "float8"])
def test_the_h100_update_codes_a_leaf_blocked_over_its_flattened_elements_in_place(variant):
  # Leaves whose last axis is not a multiple of 256 are blocked over their flattened
  # elements: an attention kernel (768, 12, 64) and a padded (1000, 1000) matrix. Coded as
  # blocks, XLA:GPU wrote their new mu and nu to float32 buffers first (4.5 and 7.7 MiB
  # against optax AdamW's 3.8); coded in the leaf's shape, they fuse. What is left is a copy
  # of the padded matrix's old codes (its codes and params differ in shape, so XLA writes
  # them in separate fusions): one byte per element and moment, half of optax's buffer.
  params = {"attention": jax.ShapeDtypeStruct((768, 12, 64), jnp.float32),
            "w": jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}
  adamw = optim_state.h100_update("adamw", params)["temp_bytes"]
  coded = optim_state.h100_update(variant, params)["temp_bytes"]
  assert adamw >= 3.5 * 2**20
  assert coded <= 0.55 * adamw, (coded, adamw)


@pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                    reason=str(gpu_compile.plugin_missing()))
def test_the_h100_int4_update_writes_its_codes_in_place():
  # Rows of 6 and 18 blocks (768 and 2304 wide) and an attention kernel blocked over its
  # flattened elements. Until stop 55 a block's elements j and j + B/2 shared a byte: XLA:GPU
  # copied the old codes and wrote these leaves' unpacked int32 codes to buffers (4.6 MiB for
  # a 768 x 768 leaf alone, against optax AdamW's 2.25); neighbours packed by a uint4 bitcast
  # fuse, and the codes are written over the old ones.
  params = {"w": jax.ShapeDtypeStruct((768, 768), jnp.float32),
            "up": jax.ShapeDtypeStruct((768, 2304), jnp.float32),
            "attention": jax.ShapeDtypeStruct((768, 12, 64), jnp.float32)}
  adamw = optim_state.h100_update("adamw", params)["temp_bytes"]
  coded = optim_state.h100_update("int4", params)["temp_bytes"]
  assert adamw >= 6.5 * 2**20
  assert coded <= 0.2 * adamw, (coded, adamw)


@pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                    reason=str(gpu_compile.plugin_missing()))
@pytest.mark.parametrize("shape, adamw_at_least, limit", [
    # An LM head over a vocabulary of odd size, blocked over its flattened elements. As
    # blocks, a byte's two codes crossed rows and XLA:GPU wrote the new mu and nu to float32
    # first (30 MiB, 2.1x optax AdamW's temp); its codes now keep the leaf's shape, the odd
    # last axis padded with a zero code, and what is left is a copy of the old codes.
    ((768, 5025), 14 * 2**20, 0.35),
    # mu's blocks of 32 divide it, nu's blocks of 256 are padded. Reduced as padded blocks,
    # XLA:GPU computed the new nu in mu's block-scale fusion and wrote it to float32 for
    # nu's (4.2 MiB, 1.1x); nu's scales now come in two levels (coded.scales_of).
    ((1000, 1000), 3.5 * 2**20, 0.25),
])
def test_the_h100_int4_update_of_a_leaf_blocked_across_rows(shape, adamw_at_least, limit):
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  adamw = optim_state.h100_update("adamw", params)["temp_bytes"]
  assert adamw >= adamw_at_least
  assert optim_state.h100_update("int4", params)["temp_bytes"] <= limit * adamw


@pytest.mark.slow
def test_smoke_run_writes_its_report(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "benchmarks.optim_state", "--smoke", "--out",
                         str(tmp_path)], cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="error"),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  files = sorted(tmp_path.iterdir())
  assert [f.suffix for f in files] == [".json", ".md"]
  assert files[0].stem.startswith("optim-state-cpu-")
  result = json.loads(files[0].read_text())
  assert result["meta"]["command"] == f"python -m benchmarks.optim_state --smoke --out {tmp_path}"
  assert [(r["model"], r["variant"]) for r in result["rows"]] == [
      (m, v) for m in optim_state.SMOKE_MODELS for v in optim_state.VARIANTS]
  compiled = gpu_compile.plugin_missing() is None
  for r in result["rows"]:
    assert ("temp_bytes" in r) == compiled
    assert ("cpu_update_s" in r) == (r["model"] != optim_state.BIG)
  assert files[1].read_text() in proc.stdout
  bar_lines = [line for line in proc.stdout.splitlines() if "(limit " in line]
  # per model: the update temp of int8, float8, int4 and int4_all (compiled), persistent of
  # int8, int4 and int4_all
  assert len(bar_lines) == len(result["bars"]) == (14 if compiled else 6)
  assert all(line.startswith(report.SMOKE_STATUS + " ") for line in bar_lines)

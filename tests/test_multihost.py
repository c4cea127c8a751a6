"""Multi-host: two processes (jax.distributed, gloo collectives) x four CPU devices each.

Each process feeds its local shard of the batch with
``jax.make_array_from_process_local_data``; one process poisons its shard of
one step. Both must skip that step, keep identical params, and resume
bit-exactly from an orbax checkpoint that both wrote. Then FSDP with FP8
weights over both processes (issue 44): the same skip, the same params.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

CHILD = pathlib.Path(__file__).with_name("multihost_child.py")


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_skip_together_stay_identical_and_resume(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  port = str(_free_port())
  procs = [
      subprocess.Popen([sys.executable, str(CHILD), str(pid), port, str(tmp_path)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for pid in (0, 1)
  ]
  outs = []
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    assert proc.returncode == 0, f"process failed:\n{err[-3000:]}"
    outs.append(json.loads(out.strip().splitlines()[-1]))
  first, second = outs
  assert first == second  # Same decisions, same params, same checkpoint, in both.
  assert first["finite"] == [True, True, True, False, True, True]  # Global skip.
  assert first["skip_kept_params"] and first["skipped"] == 1
  assert first["final"] == first["resumed"]  # Bit-exact resume.
  assert first["fsdp_fp8_finite"] == [True, True, False, True, True, True]  # Global skip.
  assert first["fsdp_fp8_spec"] == "P('data',)"
  losses = first["fsdp_fp8_losses"]
  assert losses[5] < losses[0], losses

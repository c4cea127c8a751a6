"""Loaded by pytest before anything imports JAX: the environment the whole suite runs in.

The CUDA plugin. With it installed (``pip install -e '.[gpu]'``, for the
GPU-compile tests) on a machine without a GPU driver, the plugin's start-up
check of the driver's CUDA version would fail and take the CUDA platform down
with it, and with it the deviceless compiles. Skipping that check lets JAX fall
back to the CPU for running, and keeps the CUDA compiler available for
compiling. On a machine with a GPU the check is only a version comparison.

The compilation cache. JAX's persistent compilation cache is on, in
``.jax_cache/`` at the repository root (git ignores it), for every program
however small or quick to compile: the pytest-xdist workers and the example,
benchmark and docs subprocesses (they inherit these variables) then compile a
program once and load it from the cache after that, the same train step built
again by another test included. An empty cache (a fresh clone, as in CI) costs
only the writes; set ``JAX_COMPILATION_CACHE_DIR`` to use another folder, or
``JAX_ENABLE_COMPILATION_CACHE=false`` to compile everything afresh.

XLA's machine code. The suite compiles thousands of small programs and runs
each a few times, so it compiles with LLVM's optimisation level 0
(``--xla_backend_optimization_level=0`` added to ``XLA_FLAGS``, unless
``XLA_FLAGS`` already sets a level): XLA's own passes (fusion, layout, buffer
assignment, the H100 compiles' memory analysis) and IEEE arithmetic are the
same, only LLVM's optimisation of the emitted loops is skipped, and a
compile-heavy test (a model-zoo cell) takes 22 s instead of 37 s. It also
emits the CPU's fused loops with XLA's older elemental emitter
(``--xla_cpu_use_fusion_emitters=false``): the same fusions, compiled in about
half the time (a quantized Adam update 0.22 s instead of 0.52 s; the model
zoo, transform, autocast-corpus and a slice of the alias tests together 180 s
instead of 305 s). And it compiles each program's LLVM module whole
(``--xla_cpu_parallel_codegen_split_count=1``): split into parts compiled on
threads, as XLA does by default, the parts' overhead outweighed the threads
on programs this small, with two pytest-xdist workers already busy on the
two cores (autocast, masters and model-zoo tests 75 s -> 57 s with an empty
cache; 217 of optax's alias tests 78 s -> 54 s). Because XLA aborts on a
flag it does not know, those two are added only after a child process has
started XLA with them. Benchmarks are not
run through pytest for their timings, so no measured speed depends on either.

The plugin ``tests/optax_alias_quantized.py``: optax's own optimizer tests,
every optimizer wrapped in ``jmp.quantize_state`` (see its docstring).
"""

import os
import pathlib
import subprocess
import sys


def _add_xla_flag(name: str, value: str, probe: bool = False) -> None:
    """Adds ``--name=value`` to ``XLA_FLAGS`` unless it already sets ``name``.

    With ``probe``, only if a child process starts XLA's CPU backend with the flag (XLA
    aborts on a flag it does not know, and a newer jaxlib may drop one). The pytest-xdist
    workers and the tests' subprocesses inherit ``XLA_FLAGS``, so the probe runs once.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if name in flags:
        return
    flags = f"{flags} --{name}={value}".strip()
    if probe:
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        code = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
        if subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          check=False).returncode != 0:
            return
    os.environ["XLA_FLAGS"] = flags


os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
_add_xla_flag("xla_backend_optimization_level", "0")
_add_xla_flag("xla_cpu_use_fusion_emitters", "false", probe=True)
_add_xla_flag("xla_cpu_parallel_codegen_split_count", "1", probe=True)

CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(pathlib.Path(__file__).resolve().parent / ".jax_cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # every program, however quick
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",  # however small
}
for name, value in CACHE.items():
    os.environ.setdefault(name, value)

import jax  # noqa: E402  (after the environment: JAX reads it when it starts)

pytest_plugins = ("tests.optax_alias_quantized",)

# In case a plugin imported JAX before this file ran: the same settings through its config.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

"""Compile a step for a GPU this machine does not have, and read what it would run.

XLA's GPU compiler can build the program an NVIDIA H100 would run without the
GPU ("deviceless" ahead-of-time compilation) from a target description that
ships with the package (``gpu_targets/``). :func:`compile_for_gpu` lowers a
step on the shapes of its arguments, placed on a one-GPU topology mesh of the
target, compiles it, and reports its GEMMs by runner and operand dtypes, its
convolutions and the bytes of ``compiled.memory_analysis()``.

It needs JAX's CUDA plugin (``pip install 'jmp_lite[gpu]'``), but no GPU,
driver or CUDA install. What a compile proves: which kernels the program holds
and how much memory it asks for. What it cannot prove: speed (nothing runs),
and autotuned choices (no autotuning without a GPU).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax

from jmp_lite._src.diagnostics import hlo_census

# The CUDA plugin checks the driver's CUDA version when JAX starts its backends;
# without a driver that check takes the CUDA platform, and so its compiler, down.
# Where no NVIDIA driver is loaded the check has nothing to compare, so skip it
# (before JAX starts); where one is, leave the check alone.
if not os.path.exists("/proc/driver/nvidia/version"):
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

_TARGET_DIR = pathlib.Path(__file__).resolve().parent / "gpu_targets"
# The GPUs a step can be compiled for: name -> XLA's GpuTargetConfigProto (text).
GPU_TARGETS: Mapping[str, pathlib.Path] = {"h100": _TARGET_DIR / "h100_sxm.txtpb"}
PLUGIN_HINT = ("compiling for a GPU needs JAX's CUDA plugin, which is not installed: "
               "pip install 'jmp_lite[gpu]' (in a checkout: pip install -e '.[gpu]'; "
               "about 5.6 GB, no GPU or driver needed)")
_CUDA_DOWN = ("JAX's CUDA plugin is installed but its platform did not start ({error}). On a "
              "machine without a GPU driver, set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX "
              "first runs (importing jmp_lite before running anything in JAX does so).")
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_TOO_BIG = (
    "the program compiled for {target} needs {need} (arguments {args} + outputs {outs} - "
    "donated {alias} + temp {temp}), more than the {have} the {device} has: it would fail "
    "to allocate there. Shrink the batch, rematerialise "
    "(jax.checkpoint), keep optimizer state in 8 bits (quantize_state) or shard the step")


@functools.lru_cache(maxsize=None)
def device_memory_bytes(target: str) -> int | None:
  """The device memory of ``target`` (``device_memory_size`` in its target file), or ``None``."""
  found = re.search(r"^\s*device_memory_size:\s*(\d+)", GPU_TARGETS[target].read_text(), re.M)
  return int(found.group(1)) if found else None


def plugin_missing() -> str | None:
  """Why a GPU compile cannot run here (JAX's CUDA plugin is absent), or ``None`` if it can."""
  for name in _PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return None
    except ModuleNotFoundError:  # Not even the jax_plugins namespace.
      pass
  return PLUGIN_HINT


def topology_sharding(target: str = "h100") -> jax.sharding.NamedSharding:
  """A replicated ``NamedSharding`` on a one-GPU topology mesh of ``target``'s device.

  Raises:
    ValueError: ``target`` is not one of :data:`GPU_TARGETS`.
    RuntimeError: the CUDA plugin is missing, or its platform did not start.
  """
  if target not in GPU_TARGETS:
    raise ValueError(f"target must be one of {sorted(GPU_TARGETS)}, got {target!r}")
  missing = plugin_missing()
  if missing:
    raise RuntimeError(missing)
  return _topology_sharding(target)


@functools.lru_cache(maxsize=None)
def _topology_sharding(target: str) -> jax.sharding.NamedSharding:
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=GPU_TARGETS[target].read_text(), topology="1x1x1")
  except (NotImplementedError, RuntimeError) as e:
    raise RuntimeError(_CUDA_DOWN.format(error=e)) from e
  mesh = topologies.make_mesh(topology, (1,), ("data",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=None)
def topology_mesh(target: str, devices: int, axis: str = "fsdp") -> jax.sharding.Mesh:
  """A one-axis mesh (named ``axis``) of ``devices`` GPUs of ``target`` on one host, not present.

  Place the arguments of :func:`compile_for_gpu` on it (``jax.ShapeDtypeStruct``s
  with a ``NamedSharding`` of this mesh) to compile a sharded step.

  Raises:
    ValueError: ``target`` is unknown, or ``devices`` is not a positive int.
    RuntimeError: the CUDA plugin is missing, or its platform did not start.
  """
  if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
    raise ValueError(f"devices must be an int >= 1, got {devices!r}")
  topology_sharding(target)  # Validates the target and the plugin.
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  topology = topologies.get_topology_desc(
      platform="cuda", target_config=GPU_TARGETS[target].read_text(), topology=f"1x1x{devices}")
  return topologies.make_mesh(topology, (devices,), (axis,))


def _placed(args: tuple[Any, ...], sharding: jax.sharding.NamedSharding) -> Any:
  """``args`` with every array (or ``ShapeDtypeStruct``) leaf a struct placed by ``sharding``."""

  def struct(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      return x  # Placed by the caller (on a topology mesh of several GPUs).
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x

  return jax.tree.map(struct, args)


def compile_placed(fn: Callable[..., Any], args: tuple[Any, ...], target: str = "h100",
                   compiler_options: Mapping[str, Any] | None = None) -> Any:
  """``fn`` (jitted if it is not) lowered for ``target`` on ``args``' shapes, compiled."""
  sharding = topology_sharding(target)
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  lowered = jitted.lower(*_placed(args, sharding))
  with _without_persistent_cache():
    return lowered.compile(compiler_options=dict(compiler_options or {}))


@contextlib.contextmanager
def _without_persistent_cache() -> Iterator[None]:
  """JAX's persistent compilation cache off, then as it was.

  A deviceless executable is written to the cache but cannot be read back
  (``PjRtCompiler must be constructed with a Client to call
  DeserializeLoadedExecutable``): the second compile of the same program,
  in this process or another that shares the cache, would fail.
  """
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel

  was = bool(getattr(jax.config, "jax_enable_compilation_cache"))
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def _kinds(ops: list[hlo_census.Op]) -> dict[str, int]:
  return dict(collections.Counter(f"{op.runner} {op.lhs} x {op.rhs}" for op in ops))


@dataclasses.dataclass(frozen=True)
class GpuCompileReport:
  """What a step compiled for a GPU would run, and the memory it asks for.

  Attributes:
    target: the target's name (``"h100"``).
    device_kind: the device XLA compiled for (``"NVIDIA H100 80GB HBM3"``).
    gemms: GEMM count by ``"<runner> <lhs dtype> x <rhs dtype>"``, the dtypes
      as HLO spells them (``"cuBLASLt bf16 x bf16"``, ``"Triton GEMM f8e4m3fn x
      f8e4m3fn"``). The runners: ``cuBLASLt FP8``, ``cuBLASLt``, ``cuBLAS``,
      ``Triton GEMM``, ``cuDNN``, ``XLA`` (a ``dot`` no library runs).
    convolutions: convolution count, keyed the same way.
    temp_bytes: the program's scratch memory (activations kept for the
      backward pass included).
    argument_bytes: the bytes of its inputs.
    output_bytes: the bytes of its outputs.
    alias_bytes: the output bytes that reuse donated input buffers.
    ops: every GEMM and convolution, in program order.
    collectives: every collective (all-gather, all-reduce, ...), in program
      order, with its result bytes per device by dtype (none on one GPU).

  A GEMM inside a loop counts once (instructions, not executions).
  :attr:`memory_bytes` is what the program needs on the device at once.
  """

  target: str
  device_kind: str
  gemms: dict[str, int]
  convolutions: dict[str, int]
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  ops: tuple[hlo_census.Op, ...]
  collectives: tuple[hlo_census.Collective, ...] = ()

  @property
  def memory_bytes(self) -> int:
    """Arguments + outputs + temp, less the outputs that reuse donated arguments."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def num_gemms(self) -> int:
    """How many GEMMs the program holds."""
    return sum(self.gemms.values())

  @property
  def fp8_gemms(self) -> int:
    """How many of its GEMMs multiply float8 operands (both of them)."""
    return sum(op.float8 for op in self.ops if op.kind == "gemm")

  def __str__(self) -> str:
    def mib(n: int) -> str:
      return f"{n / 2**20:.1f} MiB"

    lines = [f"compiled for {self.device_kind} ({self.target}), not run",
             f"  temp {mib(self.temp_bytes)}, arguments {mib(self.argument_bytes)}, "
             f"outputs {mib(self.output_bytes)} (aliased {mib(self.alias_bytes)})",
             f"  {self.num_gemms} GEMMs, {self.fp8_gemms} on float8 operands"]
    for title, kinds in (("GEMMs", self.gemms), ("convolutions", self.convolutions)):
      if kinds:
        width = max(len(k) for k in kinds)
        lines.append(f"  {title:<{width}s}  count")
        lines += [f"  {k:<{width}s}  {n:5d}" for k, n in kinds.items()]
      else:
        lines.append(f"  {title}: none")
    return "\n".join(lines)


def compile_for_gpu(step: Callable[..., Any], *args: Any, target: str = "h100",
                    compiler_options: Mapping[str, Any] | None = None) -> GpuCompileReport:
  """Compiles ``step(*args)`` for a GPU this machine need not have, and reports what it holds.

  The arguments may be arrays or ``jax.ShapeDtypeStruct``s (``jax.eval_shape``
  of an init function: nothing is allocated); only their shapes and dtypes are
  used. ``step`` is a :func:`make_train_step` result or any function ``jax.jit``
  accepts. Needs JAX's CUDA plugin (``pip install 'jmp_lite[gpu]'``), not a GPU.

  Args:
    step: the function to compile (jitted, or jittable).
    *args: its positional arguments, e.g. ``state, batch``.
    target: the GPU, one of ``GPU_TARGETS`` (``"h100"``: an H100 SXM 80 GB).
    compiler_options: XLA options for the compile, e.g.
      ``{"xla_gpu_enable_triton_gemm": False}`` (cuBLAS for every GEMM).

  Returns:
    A :class:`GpuCompileReport`; ``print(report)`` shows it as a table.

  Warns:
    UserWarning: when the program's memory (:attr:`GpuCompileReport.memory_bytes`:
      arguments, outputs and temp, less donated outputs) exceeds the
      target's device memory (``device_memory_size`` of its target file: an
      H100 SXM has 79.1 GiB): it would not fit on that GPU.

  Raises:
    ValueError: ``target`` is not a known GPU.
    RuntimeError: the CUDA plugin is not installed (the message says what to
      install), or its platform did not start.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jmp_lite as jmp
    >>> f = lambda w, x: jnp.tanh(x @ w).sum()
    >>> w, x = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16)
    >>> try:
    ...   report = jmp.compile_for_gpu(jax.grad(f), w, x)  # print(report): a table
    ... except RuntimeError as e:  # Without the CUDA plugin: what to install.
    ...   print("pip install 'jmp_lite[gpu]'" in str(e))
    ... else:
    ...   print(report.num_gemms == 2 and report.device_kind.startswith("NVIDIA H100"))
    True
    >>> jmp.compile_for_gpu(jax.grad(f), w, x, target="a100")
    Traceback (most recent call last):
    ...
    ValueError: target must be one of ['h100'], got 'a100'
  """
  compiled = compile_placed(step, args, target, compiler_options)
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  ops = hlo_census.census(text)
  report = GpuCompileReport(
      target=target,
      device_kind=topology_sharding(target).mesh.devices.flat[0].device_kind,
      gemms=_kinds([op for op in ops if op.kind == "gemm"]),
      convolutions=_kinds([op for op in ops if op.kind == "conv"]),
      temp_bytes=int(mem.temp_size_in_bytes),
      argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      alias_bytes=int(mem.alias_size_in_bytes),
      ops=tuple(ops),
      collectives=tuple(hlo_census.collectives(text)))
  _warn_if_too_big(report)
  return report


def _warn_if_too_big(report: GpuCompileReport) -> None:
  """A ``UserWarning`` when ``report``'s program needs more memory than its GPU has."""
  have = device_memory_bytes(report.target)
  if have is None or report.memory_bytes <= have:
    return
  def size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"

  warnings.warn(_TOO_BIG.format(
      target=report.target, need=size(report.memory_bytes), args=size(report.argument_bytes),
      outs=size(report.output_bytes), alias=size(report.alias_bytes),
      temp=size(report.temp_bytes), have=size(have), device=report.device_kind), stacklevel=3)

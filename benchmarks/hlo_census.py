"""The kernels an optimised XLA program launches, for a roofline estimate.

:func:`kernels` reads the text of a compiled HLO module (``compiled.as_text()``)
as the kernels its entry computation launches (each fusion, library call and
unfused op), with the bytes each reads and writes and the FLOPs of the GEMMs in
it: what a roofline estimate needs (``benchmarks/fp8_sizes.py``).

The GEMM and convolution census (which runner, which operand dtypes) is the
library's: :func:`census` and :func:`summary` are
``jmp_lite._src.diagnostics.hlo_census``'s, re-exported here for the benchmark
scripts; ``jmp.compile_for_gpu`` reports it for any step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from jmp_lite._src.diagnostics.hlo_census import CUBLAS
from jmp_lite._src.diagnostics.hlo_census import FLOAT8
from jmp_lite._src.diagnostics.hlo_census import Instr
from jmp_lite._src.diagnostics.hlo_census import Op
from jmp_lite._src.diagnostics.hlo_census import census
from jmp_lite._src.diagnostics.hlo_census import instructions
from jmp_lite._src.diagnostics.hlo_census import summary

__all__ = ["CUBLAS", "FLOAT8", "Kernel", "Op", "census", "kernels", "summary"]

_ENTRY = re.compile(r"^ENTRY %([\w.\-]+) ")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
# Bytes per element of the HLO element types (float8 formats are 1 byte; tokens and others 0).
_BYTES = dict(pred=1, s8=1, u8=1, bf16=2, f16=2, s16=2, u16=2, f32=4, s32=4, u32=4, f64=8,
              s64=8, u64=8, c64=8, c128=16, **{f: 1 for f in FLOAT8})
# Instructions that launch nothing: they name, group or reinterpret buffers.
_NO_KERNEL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel the entry computation launches, and the traffic and work a roofline charges it.

  Attributes:
    name: the instruction's name.
    opcode: ``fusion``, ``custom-call``, or the op of an unfused instruction.
    read_bytes: the bytes of its operands, each operand once.
    write_bytes: the bytes of its output (a cuBLAS call's workspace left out).
    flops: the FLOPs of the GEMMs it runs (``2 * output elements * contracting
      size`` per dot); 0 for a kernel that runs none.
    float8: it runs a GEMM and every GEMM in it multiplies float8 operands.
    inputs: the kernels (or parameters) whose outputs it reads, seen
      through bitcasts and tuple elements.
  """

  name: str
  opcode: str
  read_bytes: int
  write_bytes: int
  flops: int = 0
  float8: bool = False
  inputs: tuple[str, ...] = ()

  @property
  def bytes(self) -> int:
    """What it moves: ``read_bytes + write_bytes``."""
    return self.read_bytes + self.write_bytes


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """The element type and dimensions of each array in an HLO type (a tuple has several)."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(type_text)]


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> int:
  return sum(_BYTES.get(dtype, 0) * math.prod(shape) for dtype, shape in arrays)


def kernels(hlo_text: str) -> list[Kernel]:
  """The kernels of an optimised HLO module's entry computation, in program order.

  A kernel is an instruction of the entry computation that launches work: a
  fusion (its GEMM, if it owns one, included), a library call (cuBLAS,
  cuDNN) or an unfused op; parameters, constants, tuples and bitcasts launch
  none. Reads count each distinct operand once, in full (a fusion that reads
  a slice of an operand is charged all of it). A loop (``while``) or a call is
  one kernel charged its operands: what runs inside it is not listed, so a
  program with loops is undercounted.

  Args:
    hlo_text: ``compiled.as_text()`` of an XLA program.

  Returns:
    A list of :class:`Kernel`.

  Examples:
    >>> text = '''
    ... %gemm (p0: f8e4m3fn[32,64], p1: f8e4m3fn[64,16]) -> bf16[32,16] {
    ...   %p0 = f8e4m3fn[32,64]{1,0} parameter(0)
    ...   %p1 = f8e4m3fn[64,16]{1,0} parameter(1)
    ...   ROOT %d = bf16[32,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }
    ... ENTRY %main (a: f8e4m3fn[32,64], b: f8e4m3fn[64,16], c: bf16[16,8]) -> bf16[32,8] {
    ...   %a = f8e4m3fn[32,64]{1,0} parameter(0)
    ...   %b = f8e4m3fn[64,16]{1,0} parameter(1)
    ...   %c = bf16[16,8]{1,0} parameter(2)
    ...   %f = bf16[32,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
    ...   %cb = bf16[16,8]{0,1} bitcast(%c)
    ...   %g = (bf16[32,8]{1,0}, s8[1024]{0}) custom-call(%f, %cb), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
    ...   ROOT %r = bf16[32,8]{1,0} get-tuple-element(%g), index=0
    ... }
    ... '''
    >>> [(k.name, k.read_bytes, k.write_bytes, k.flops, k.float8, k.inputs) for k in kernels(text)]
    [('f', 3072, 1024, 65536, True, ('a', 'b')), ('g', 1280, 512, 8192, False, ('f', 'c'))]
  """
  instrs = list(instructions(hlo_text))
  entry = next((m.group(1) for m in map(_ENTRY.match, hlo_text.splitlines()) if m), None)
  types = {(i.computation, i.name): i.type for i in instrs}
  caller = {i.calls: i for i in instrs if i.calls}

  def owner(computation: str) -> str | None:
    """The entry instruction that (through nested fusions) runs ``computation``."""
    seen = set()
    while computation in caller and computation not in seen:
      seen.add(computation)
      if caller[computation].computation == entry:
        return caller[computation].name
      computation = caller[computation].computation
    return None

  def operand(i: Instr, k: int) -> list[tuple[str, tuple[int, ...]]]:
    return _arrays(types.get((i.computation, i.operands[k]), "")) if k < len(i.operands) else []

  def gemm(i: Instr) -> tuple[int, bool]:
    """The FLOPs of dot (or cuBLAS call) ``i``, and whether both its operands are float8."""
    lhs, rhs, out = operand(i, 0), operand(i, 1), _arrays(i.type)[:1]
    if not (lhs and rhs and out):
      return 0, False
    k = math.prod(tuple(lhs[0][1][d] for d in i.contracting))
    return 2 * math.prod(out[0][1]) * k, lhs[0][0] in FLOAT8 and rhs[0][0] in FLOAT8

  work: dict[str, list[tuple[int, bool]]] = collections.defaultdict(list)
  for i in instrs:
    if i.opcode == "dot" or (i.opcode == "custom-call" and i.target in CUBLAS):
      name = i.name if i.computation == entry else owner(i.computation)
      if name is not None:
        work[name].append(gemm(i))
  by_name = {i.name: i for i in instrs if i.computation == entry}

  def source(name: str) -> str:
    """The instruction whose buffer ``name`` names, through bitcasts and tuple elements."""
    while name in by_name and by_name[name].opcode in ("bitcast", "get-tuple-element"):
      name = by_name[name].operands[0]
    return name

  found = []
  for i in instrs:
    if i.computation != entry or i.opcode in _NO_KERNEL:
      continue
    out = _arrays(i.type)
    if i.opcode == "custom-call" and i.target in CUBLAS:
      out = out[:1]  # The rest is cuBLAS's workspace.
    reads = _nbytes([a for name in dict.fromkeys(i.operands)
                     for a in _arrays(types.get((entry, name), ""))])
    gemms = work.get(i.name, [])
    found.append(Kernel(i.name, i.opcode, reads, _nbytes(out), sum(f for f, _ in gemms),
                        bool(gemms) and all(f8 for _, f8 in gemms),
                        tuple(dict.fromkeys(source(o) for o in i.operands))))
  return found

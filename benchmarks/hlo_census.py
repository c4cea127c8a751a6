"""What an optimised XLA:GPU program runs its matmuls and convolutions with.

:func:`census` reads the text of a compiled HLO module (``compiled.as_text()``)
and lists every GEMM and every convolution in it, with what runs it and the
dtypes of its operands:

- a cuBLAS custom call (``__cublas$gemm``: cuBLAS; ``__cublas$lt$matmul``:
  cuBLASLt; ``__cublas$lt$matmul$f8``: cuBLASLt's FP8 GEMM), whose first two
  operands are the matrices;
- a ``dot`` inside a fusion that a GEMM emitter owns (the fusion's
  ``backend_config`` kind: ``__triton_gemm`` and ``__triton_nested_gemm_fusion``
  are Triton GEMMs, ``__cudnn$fusion`` is cuDNN), its operands read where the
  ``dot`` is;
- any other ``dot`` (XLA's own loop emitter, or an unfused ``dot``);
- a cuDNN convolution custom call (``__cudnn$conv...``) or an unfused
  ``convolution``, by the dtype of its input.

It counts instructions in the program, not executions: a GEMM in a loop body
counts once. Nothing here needs a GPU or a CUDA install: it reads text.

:func:`kernels` reads the same text as the kernels its entry computation
launches (each fusion, library call and unfused op), with the bytes each reads
and writes and the FLOPs of the GEMMs in it: what a roofline estimate needs.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterator

FLOAT8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz")
CUBLAS = {
    "__cublas$gemm": "cuBLAS",
    "__cublas$lt$matmul": "cuBLASLt",
    "__cublas$lt$matmul$f8": "cuBLASLt FP8",
}
FUSION_RUNNERS = {
    "__triton_gemm": "Triton GEMM",
    "__triton_nested_gemm_fusion": "Triton GEMM",
    "__triton_scaled_dot_fusion": "Triton GEMM",
    "__cudnn$fusion": "cuDNN",
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r"([\w.\-]+): ([a-z0-9]+)\[")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?|[a-z0-9]+\[\]) "
                          r"([\w\-]+)\((.*)$")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
_ENTRY = re.compile(r"^ENTRY %([\w.\-]+) ")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
# A dot's lhs contracting dimensions: in the HLO attribute, or in a cuBLAS call's backend_config.
_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]')
# Bytes per element of the HLO element types (float8 formats are 1 byte; tokens and others 0).
_BYTES = dict(pred=1, s8=1, u8=1, bf16=2, f16=2, s16=2, u16=2, f32=4, s32=4, u32=4, f64=8,
              s64=8, u64=8, c64=8, c128=16, **{f: 1 for f in FLOAT8})
# Instructions that launch nothing: they name, group or reinterpret buffers.
_NO_KERNEL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


@dataclasses.dataclass(frozen=True)
class Op:
  """One GEMM or convolution: what runs it, its operand dtypes and its name in the HLO.

  Attributes:
    runner: ``"cuBLASLt FP8"``, ``"cuBLASLt"``, ``"cuBLAS"``, ``"Triton GEMM"``,
      ``"cuDNN"``, ``"XLA"`` (a ``dot``/``convolution`` no library runs).
    lhs: the first operand's element type, as HLO spells it (``bf16``, ``f8e4m3fn``).
    rhs: the second operand's element type.
    name: the instruction's name.
    kind: ``"gemm"`` or ``"conv"``.
  """

  runner: str
  lhs: str
  rhs: str
  name: str
  kind: str = "gemm"

  @property
  def float8(self) -> bool:
    """Both operands are float8."""
    return self.lhs in FLOAT8 and self.rhs in FLOAT8


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  opcode: str
  operands: list[str]
  calls: str | None
  target: str | None
  kind: str | None
  computation: str
  contracting: tuple[int, ...] = ()


def _element_type(type_text: str) -> str:
  """``bf16`` of ``bf16[16,8]{1,0}``; the first element type of a tuple."""
  match = re.search(r"([a-z0-9]+)\[", type_text)
  return match.group(1) if match else type_text


def _instructions(hlo_text: str) -> Iterator[_Instr]:
  computation = ""
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      for name, dtype in _PARAM.findall(header.group(2)):
        yield _Instr(name, dtype + "[]", "parameter", [], None, None, None, computation)
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, type_text, opcode, rest = match.groups()
    args = rest.split("),", 1)[0] if opcode != "parameter" else ""
    calls, target, kind = _CALLS.search(rest), _TARGET.search(rest), _KIND.search(rest)
    dims = _CONTRACTING.search(rest)
    contracting = tuple(int(d.strip('" ')) for d in (dims.group(1) or dims.group(2) or "").split(",")
                        if d.strip('" ')) if dims else ()
    yield _Instr(name, type_text, opcode, _OPERANDS.findall(args), calls and calls.group(1),
                 target and target.group(1), kind and kind.group(1), computation, contracting)


def census(hlo_text: str) -> list[Op]:
  """Every GEMM and convolution of an optimised HLO module, in program order.

  Args:
    hlo_text: ``compiled.as_text()`` of an XLA program (any backend).

  Returns:
    A list of :class:`Op`.

  Examples:
    >>> text = '''
    ... %gemm (p0: f8e4m3fn[16,16], p1: f8e4m3fn[16,16]) -> bf16[16,16] {
    ...   %p0 = f8e4m3fn[16,16]{1,0} parameter(0)
    ...   %p1 = f8e4m3fn[16,16]{1,0} parameter(1)
    ...   ROOT %d = bf16[16,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
    ... }
    ... ENTRY %main (a: f8e4m3fn[16,16], b: bf16[16,16]) -> bf16[16,16] {
    ...   %a = f8e4m3fn[16,16]{1,0} parameter(0)
    ...   %b = bf16[16,16]{1,0} parameter(1)
    ...   %f = bf16[16,16]{1,0} fusion(%a, %a), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
    ...   %c = (bf16[16,16]{1,0}, s8[0]{0}) custom-call(%b, %b), custom_call_target="__cublas$lt$matmul"
    ...   ROOT %v = bf16[1,16,16,1]{3,2,1,0} custom-call(%b, %b), custom_call_target="__cudnn$convForward"
    ... }
    ... '''
    >>> [(op.runner, op.lhs, op.rhs, op.kind, op.float8) for op in census(text)]
    [('Triton GEMM', 'f8e4m3fn', 'f8e4m3fn', 'gemm', True), ('cuBLASLt', 'bf16', 'bf16', 'gemm', False), ('cuDNN', 'bf16', 'bf16', 'conv', False)]
  """
  instrs = list(_instructions(hlo_text))
  types = {(i.computation, i.name): i.type for i in instrs}
  caller = {i.calls: i for i in instrs if i.calls}

  def dtype(i: _Instr, k: int) -> str:
    if k >= len(i.operands):
      return "?"
    return _element_type(types.get((i.computation, i.operands[k]), "?"))

  def runner_of(computation: str) -> str:
    seen = set()
    while computation in caller and computation not in seen:
      seen.add(computation)
      fusion = caller[computation]
      if fusion.kind in FUSION_RUNNERS:
        return FUSION_RUNNERS[fusion.kind]
      computation = fusion.computation
    return "XLA"

  ops = []
  for i in instrs:
    if i.opcode == "custom-call" and i.target in CUBLAS:
      ops.append(Op(CUBLAS[i.target], dtype(i, 0), dtype(i, 1), i.name))
    elif i.opcode == "custom-call" and i.target and i.target.startswith("__cudnn$conv"):
      ops.append(Op("cuDNN", dtype(i, 0), dtype(i, 1), i.name, "conv"))
    elif i.opcode in ("dot", "convolution"):
      kind = "gemm" if i.opcode == "dot" else "conv"
      ops.append(Op(runner_of(i.computation), dtype(i, 0), dtype(i, 1), i.name, kind))
  return ops


def summary(ops: list[Op]) -> dict[str, object]:
  """Counts by ``"runner lhs x rhs"`` for GEMMs and convolutions, and the FP8 share of the GEMMs.

  Examples:
    >>> ops = [Op("cuBLASLt FP8", "f8e4m3fn", "f8e5m2", "a"), Op("cuBLASLt", "bf16", "bf16", "b")]
    >>> summary(ops)
    {'gemms': 2, 'fp8_gemms': 1, 'fp8_fraction': 0.5, 'gemm_kinds': {'cuBLASLt FP8 f8e4m3fn x f8e5m2': 1, 'cuBLASLt bf16 x bf16': 1}, 'convs': 0, 'conv_kinds': {}}
  """
  gemms = [op for op in ops if op.kind == "gemm"]
  convs = [op for op in ops if op.kind == "conv"]
  fp8 = sum(op.float8 for op in gemms)

  def kinds(group: list[Op]) -> dict[str, int]:
    return dict(collections.Counter(f"{op.runner} {op.lhs} x {op.rhs}" for op in group))

  return dict(gemms=len(gemms), fp8_gemms=fp8,
              fp8_fraction=fp8 / len(gemms) if gemms else 0.0,
              gemm_kinds=kinds(gemms), convs=len(convs), conv_kinds=kinds(convs))


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
  instrs = list(_instructions(hlo_text))
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

  def operand(i: _Instr, k: int) -> list[tuple[str, tuple[int, ...]]]:
    return _arrays(types.get((i.computation, i.operands[k]), "")) if k < len(i.operands) else []

  def gemm(i: _Instr) -> tuple[int, bool]:
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

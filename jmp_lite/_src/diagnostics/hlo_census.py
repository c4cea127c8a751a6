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
:func:`instructions` is the parser underneath, for readers of the same text
(``benchmarks/hlo_census.py`` reads the kernels of the entry computation with it).
"""

from __future__ import annotations

import collections
import dataclasses
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
# A dot's lhs contracting dimensions: in the HLO attribute, or in a cuBLAS call's backend_config.
_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]')


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
class Instr:
  """One HLO instruction, as :func:`instructions` reads it."""

  name: str
  type: str
  opcode: str
  operands: list[str]
  calls: str | None
  target: str | None
  kind: str | None
  computation: str
  contracting: tuple[int, ...] = ()
  rest: str = ""


def _element_type(type_text: str) -> str:
  """``bf16`` of ``bf16[16,8]{1,0}``; the first element type of a tuple."""
  match = re.search(r"([a-z0-9]+)\[", type_text)
  return match.group(1) if match else type_text


def instructions(hlo_text: str) -> Iterator[Instr]:
  """The instructions of an HLO module's text, computation by computation (parameters included)."""
  computation = ""
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
      for name, dtype in _PARAM.findall(header.group(2)):
        yield Instr(name, dtype + "[]", "parameter", [], None, None, None, computation)
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
    yield Instr(name, type_text, opcode, _OPERANDS.findall(args), calls and calls.group(1),
                 target and target.group(1), kind and kind.group(1), computation, contracting,
                 rest)


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
  instrs = list(instructions(hlo_text))
  types = {(i.computation, i.name): i.type for i in instrs}
  caller = {i.calls: i for i in instrs if i.calls}

  def dtype(i: Instr, k: int) -> str:
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


# Bytes per element of the HLO element types a collective carries.
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                  "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                  **{f: 1 for f in FLOAT8}}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_TO_APPLY = re.compile(r"\bto_apply=%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program: its kind and the bytes of its results, by dtype.

  Attributes:
    kind: ``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``, ``"all-to-all"``,
      ``"collective-permute"`` or ``"collective-broadcast"`` (an async ``-start``
      counts as its collective; its ``-done`` is not counted again).
    name: the instruction's name.
    bytes_by_dtype: ``((dtype, bytes), ...)``: what one device holds as the
      collective's results (an all-gather's gathered arrays, an all-reduce's
      reduced ones), per element type, in the order the results come.
    reduction: what a reducing collective applies (its ``to_apply``
      computation's root opcode: ``"maximum"`` for an amax, ``"add"`` for a
      sum), ``""`` for the others.
  """

  kind: str
  name: str
  bytes_by_dtype: tuple[tuple[str, int], ...]
  reduction: str = ""

  @property
  def bytes(self) -> int:
    """All its result bytes."""
    return sum(n for _, n in self.bytes_by_dtype)


def _top_level(type_text: str) -> list[str]:
  """The elements of a tuple type (``(a, (b, c))`` -> ``["a", "(b, c)"]``); a non-tuple: itself."""
  if not type_text.startswith("("):
    return [type_text]
  parts, depth, start = [], 0, 1
  for k, ch in enumerate(type_text):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(type_text[start:k].strip())
      start = k + 1
  return [p for p in parts if p]


def _result_bytes(opcode: str, type_text: str) -> tuple[tuple[str, int], ...]:
  """The results' bytes by dtype: an async start's type holds its operands, then its results."""
  parts = _top_level(type_text)
  if opcode == "collective-permute-start" and len(parts) >= 2:
    parts = parts[1:2]
  elif opcode == "all-gather-start" and len(parts) >= 2:
    parts = parts[len(parts) // 2:]
  found: dict[str, int] = {}
  for dtype, dims in _SHAPE.findall(" ".join(parts)):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    found[dtype] = found.get(dtype, 0) + count * _ELEMENT_BYTES.get(dtype, 0)
  return tuple(found.items())


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an optimised HLO module, in program order.

  Args:
    hlo_text: ``compiled.as_text()`` of an SPMD-partitioned XLA program.

  Returns:
    A list of :class:`Collective` (a collective in a loop body counts once).

  Examples:
    >>> text = '''
    ... ENTRY %main (a: f8e4m3fn[4,16], b: f32[]) -> f32[] {
    ...   %a = f8e4m3fn[4,16]{1,0} parameter(0)
    ...   %b = f32[] parameter(1)
    ...   %g = (f8e4m3fn[4,16]{1,0}, f8e4m3fn[32,16]{1,0}) all-gather-start(%a), dimensions={0}
    ...   %d = f8e4m3fn[32,16]{1,0} all-gather-done(%g)
    ...   ROOT %r = f32[] all-reduce(%b), to_apply=%max
    ... }
    ... %max (x: f32[], y: f32[]) -> f32[] {
    ...   %x = f32[] parameter(0)
    ...   %y = f32[] parameter(1)
    ...   ROOT %m = f32[] maximum(%x, %y)
    ... }
    ... '''
    >>> [(c.kind, c.bytes_by_dtype, c.reduction) for c in collectives(text)]
    [('all-gather', (('f8e4m3fn', 512),), ''), ('all-reduce', (('f32', 4),), 'maximum')]
  """
  instrs = list(instructions(hlo_text))
  roots = _roots(hlo_text)
  found = []
  for i in instrs:
    kind = i.opcode[:-len("-start")] if i.opcode.endswith("-start") else i.opcode
    if kind in COLLECTIVES:
      applied = _TO_APPLY.search(i.rest)
      found.append(Collective(kind, i.name, _result_bytes(i.opcode, i.type),
                              roots.get(applied.group(1), "?") if applied else ""))
  return found


def _roots(hlo_text: str) -> dict[str, str]:
  """Each computation's root opcode."""
  roots, computation = {}, ""
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      computation = header.group(1)
    elif line.lstrip().startswith("ROOT "):
      match = _INSTRUCTION.match(line)
      if match:
        roots[computation] = match.group(3)
  return roots


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

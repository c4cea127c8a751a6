"""Memory ledger: where the bytes of a train state go.

For a user who has to fit a model: the persistent bytes of a
:class:`jmp_lite.TrainState` (or any pytree) by part and by how each part is
stored, with the total and the bytes per trained parameter. It reads shapes
and dtypes only, so it works on ``jax.eval_shape`` of a state as well as on
the state itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.optim import codes as codes_lib
from jmp_lite._src.optim import coded as coded_lib
from jmp_lite._src.step import train_state as train_state_lib

# The parts of a TrainState, in table order.
PARTS = ("params", "compensation", "optimizer state", "model state", "weight amaxes",
         "step and key", "other")


class LedgerRow(NamedTuple):
  """One line of a :class:`MemoryLedger`.

  Attributes:
    part: ``"params"``, ``"compensation"``, ``"optimizer state"``, ``"model
      state"``, ``"weight amaxes"`` (FP8's, ``TrainState.weight_amaxes``),
      ``"step and key"`` or ``"other"`` (a pytree that is not a ``TrainState``).
    stored_as: the dtype name, or ``"uint8 codes"``, ``"4-bit codes"``
      (two a byte: its elements are codes, its bytes half as many)
      and ``"float32 scales"`` (``"bfloat16 scales"`` for int4's momenta)
      for state that :func:`jmp_lite.quantize_state` coded.
    elements: the number of elements.
    bytes: their bytes.
  """

  part: str
  stored_as: str
  elements: int
  bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
  """What :func:`memory_ledger` counted. ``str()`` of it is a table.

  Attributes:
    rows: one :class:`LedgerRow` per part and storage, in :data:`PARTS` order.
    params: the number of trained parameters (floating elements of
      ``params``; every floating element for a plain pytree).
  """

  rows: tuple[LedgerRow, ...]
  params: int

  @property
  def total_bytes(self) -> int:
    """All the bytes counted."""
    return sum(r.bytes for r in self.rows)

  @property
  def bytes_per_param(self) -> float:
    """``total_bytes / params`` (0.0 without parameters)."""
    return self.total_bytes / self.params if self.params else 0.0

  def bytes_of(self, part: str) -> int:
    """The bytes of one part (0 if it holds nothing)."""
    return sum(r.bytes for r in self.rows if r.part == part)

  def __str__(self) -> str:
    head = ("part", "stored as", "elements", "bytes", "bytes/param")
    lines = [(r.part, r.stored_as, f"{r.elements:,}", f"{r.bytes:,}",
              f"{r.bytes / self.params:.3f}" if self.params else "-") for r in self.rows]
    lines.append(("total", "", "", f"{self.total_bytes:,}", f"{self.bytes_per_param:.3f}"))
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]

    def fmt(row: tuple[str, ...]) -> str:
      return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([fmt(head), *(fmt(r) for r in lines)])


def _leaf_bytes(leaf: Any) -> tuple[str, int, int]:
  """(dtype name, elements, bytes) of an array or ``ShapeDtypeStruct``."""
  dtype, size = leaf.dtype, int(np.prod(leaf.shape))
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, leaf)
    return "PRNG key", size, int(np.prod(data.shape)) * np.dtype(data.dtype).itemsize
  return np.dtype(dtype).name, size, size * np.dtype(dtype).itemsize


def _count(part: str, tree: Any, tally: dict[tuple[str, str], list[int]]) -> None:
  def add(stored_as: str, elements: int, nbytes: int) -> None:
    row = tally.setdefault((part, stored_as), [0, 0])
    row[0] += elements
    row[1] += nbytes

  def is_q(x: Any) -> bool:
    return isinstance(x, coded_lib.QuantizedArray)

  for leaf in jax.tree.leaves(tree, is_leaf=is_q):
    if isinstance(leaf, coded_lib.QuantizedArray):
      _, n, b = _leaf_bytes(leaf.codes)
      per_byte = codes_lib.codes_per_byte(leaf.format)  # int4: two codes a byte
      add("4-bit codes" if per_byte == 2 else f"{np.dtype(leaf.codes.dtype).name} codes",
          per_byte * n, b)
      _, n, b = _leaf_bytes(leaf.scales)
      add(f"{np.dtype(leaf.scales.dtype).name} scales", n, b)
    elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      add(*_leaf_bytes(leaf))


def _floating_elements(tree: Any) -> int:
  """Floating elements of arrays and ``ShapeDtypeStruct`` leaves."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)
             if hasattr(x, "dtype") and hasattr(x, "shape")
             and jnp.issubdtype(x.dtype, jnp.floating))


def memory_ledger(x: Any) -> MemoryLedger:
  """Where the bytes of a train state go: params, optimizer state by format, model state.

  Reads shapes and dtypes only: pass the state, or ``jax.eval_shape`` of the
  function that builds it to size a model without allocating it. Counts
  persistent bytes (what a step keeps between calls), not the step's
  temporaries.

  Args:
    x: a :class:`jmp_lite.TrainState`, or any pytree of arrays or
      ``jax.ShapeDtypeStruct`` (counted as one part, ``"other"``).

  Returns:
    A :class:`MemoryLedger`; ``print`` it for a table.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite as jmp
    >>> state = jmp.TrainState.create(params={"w": jnp.zeros((64, 256))}, tx=optax.adamw(1e-3))
    >>> round(jmp.memory_ledger(state).bytes_per_param, 2)
    12.0
    >>> lean = jmp.TrainState.create(params={"w": jnp.zeros((64, 256))},
    ...                              tx=jmp.quantize_state(optax.adamw(1e-3), "int8"),
    ...                              master_dtype=jnp.bfloat16, rounding="stochastic",
    ...                              key=jax.random.key(0))
    >>> ledger = jmp.memory_ledger(lean)
    >>> round(ledger.bytes_per_param, 3)
    4.032
    >>> print(ledger)  # doctest: +NORMALIZE_WHITESPACE
    part             stored as       elements   bytes  bytes/param
    params           bfloat16          16,384  32,768        2.000
    optimizer state  int32                  2       8        0.000
    optimizer state  uint8 codes       32,768  32,768        2.000
    optimizer state  float32 scales       128     512        0.031
    step and key     int32                  1       4        0.000
    step and key     PRNG key               1       8        0.000
    total                                      66,068        4.032
  """
  tally: dict[tuple[str, str], list[int]] = {}
  if isinstance(x, train_state_lib.TrainState):
    _count("params", x.params, tally)
    _count("compensation", x.compensation, tally)
    _count("optimizer state", x.opt_state, tally)
    _count("model state", x.model_state, tally)
    _count("weight amaxes", x.weight_amaxes, tally)
    _count("step and key", (x.step, x.rounding_key), tally)
    params = _floating_elements(x.params)
  else:
    _count("other", x, tally)
    params = _floating_elements(x)
  rows = tuple(LedgerRow(part, stored_as, n, b) for (part, stored_as), (n, b)
               in sorted(tally.items(), key=lambda kv: PARTS.index(kv[0][0])))
  return MemoryLedger(rows, params)

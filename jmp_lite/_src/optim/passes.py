"""An update run in passes, so that XLA keeps no float32 copy of the new state.

Coding a new state needs each block's largest value before any element of
it can be coded: a reduction, then an element-wise pass that reads the
reduction. Written once, XLA computes the new state in the reduction's
fusion and keeps it, in float32, for the coding fusion: one float32 buffer
of every coded leaf, twice optax's own AdamW update's temp on an H100
(``benchmarks.optim_state``). Run in passes, the update is computed again
where it is needed, from the same inputs:

  1. the update, reduced to what the coding needs (the block scales);
  2. behind an ``optimization_barrier`` (which keeps XLA from merging it with
     pass 1), the update again, for its updates (which the caller's
     ``apply_updates`` consumes in the same fusion);
  3. behind a barrier of its own, the new state once more, coded with pass
     1's scales.

Codes in their own pass fuse where codes computed with the updates did not:
packed two to a byte (``"int4"``), or a leaf's blocks laid out unlike the
leaf, XLA wrote the new state to a float32 buffer first; and with several
leaves XLA's cost model sometimes did so for plain layouts too (the
benchmark LSTM's embedding, 2.0x optax AdamW's temp with the codes in pass 2,
0.04x in pass 3). Pass 3 writes the new codes over the old ones, which pass
2 reads, so XLA keeps a copy of a leaf's old codes (a quarter of a float32
copy in 8 bits, an eighth in 4).

Each pass reads the coded state, the gradients and what else the update
reads; none writes a float32 state. The passes cost arithmetic (the update
is cheap next to its memory traffic) and trace the inner update three
times. Only traced updates (under ``jit``) of at least :data:`MIN_ELEMENTS`
coded elements run in passes (:func:`worth_it`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from jmp_lite._src import checks
from jmp_lite._src import filtering

# Coded elements under which the update runs once: the float32 copy of the new state
# it saves is at most 256 KiB, and the passes would double the update's trace and compile
# time (optax's alias tests, thousands of small programs, take measurably longer).
MIN_ELEMENTS = 2**16


def worth_it(elements: int, args: Any) -> bool:
  """Whether an update of ``elements`` coded elements, given ``args``, should run in passes.

  Only traced (under ``jit``, ``vmap``, ``grad``: a leaf of ``args`` is a
  tracer), where XLA fuses; run eagerly, every operation writes its own
  buffer and passes would only repeat work. And only for at least
  :data:`MIN_ELEMENTS` coded elements.
  """
  return elements >= MIN_ELEMENTS and any(map(checks.is_traced, jax.tree.leaves(args)))


def run_in_passes(run: Callable[..., tuple[Any, Any]], state: Any, updates: Any, params: Any,
                  extra_args: Any, reduce: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
  """``run(state, updates, params, extra_args)`` in passes (module docstring).

  Args:
    run: the update, ``(state, updates, params, extra_args) -> (updates,
      new_state)``; pure, so that its passes agree.
    state, updates, params, extra_args: its arguments.
    reduce: what the coding of the new state needs of it (its block scales).

  Returns:
    ``(updates, new_state, reduce(new_state))``: pass 2's updates and pass
    3's new state, which the caller codes with pass 1's reduction.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> run = lambda s, u, p, e: (u * 2, s + u)
    >>> out = jax.jit(lambda s, u: run_in_passes(run, s, u, None, {}, jnp.max))(
    ...     jnp.ones(3), jnp.arange(3.0))
    >>> [x.tolist() for x in out]
    [[0.0, 2.0, 4.0], [1.0, 2.0, 3.0], 3.0]
  """
  reduced = reduce(run(state, updates, params, extra_args)[1])
  # The params stay out of the barriers: a barrier holding them would keep them alive
  # while the caller's apply_updates overwrites them in place (XLA would copy them).
  # Static leaves (a Python number among the extra arguments) stay out of them too.
  arrays, spec = filtering.partition((state, updates, extra_args))
  arrays, reduced = jax.lax.optimization_barrier((arrays, reduced))
  state, updates, extra_args = filtering.combine(arrays, spec)
  updates_out = run(state, updates, params, extra_args)[0]
  state, updates, extra_args = filtering.combine(jax.lax.optimization_barrier(arrays), spec)
  return updates_out, run(state, updates, params, extra_args)[1], reduced

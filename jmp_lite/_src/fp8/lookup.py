"""An embedding lookup under FP8: its cotangent crosses the wire as float8 (issue 44).

A token embedding ``table[tokens]`` is a matmul with a one-hot matrix, and
its backward is one: the scatter-add of the cotangent into the table's rows.
Under FSDP the table is sharded on its rows (the vocabulary) and the tokens
on the batch, so XLA's SPMD partitioner gathers every device's cotangent to
every device for the scatter-add: in the benchmark Transformer, 32 MiB of
bfloat16 per step, a quarter of all gathered bytes.

:func:`fp8_lookup` treats that backward as the FP8 recipe treats a matmul's:
the cotangent is quantised to the recipe's backward format (e5m2), with a
scale per device's rows (:func:`fp8_groups.groups_of`, no all-reduce), and
under a mesh it is gathered as float8 before it is dequantised and
scattered. The forward lookup is the ordinary gather: it moves no weight
bytes (XLA gathers the tokens and reduce-scatters the rows).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jmp_lite._src.fp8 import dot as fp8_dot
from jmp_lite._src.fp8 import groups as fp8_groups
from jmp_lite._src.fp8.recipe import Float8Recipe


def is_row_lookup(operand_shape: tuple[int, ...], params: Any) -> bool:
  """Whether a ``gather`` with ``params`` reads whole rows of a 2-D table (``jnp.take(t, i, axis=0)``).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> take = jax.make_jaxpr(lambda t, i: jnp.take(t, i, axis=0))(jnp.ones((5, 3)), jnp.ones(4, int))
    >>> gather = take.eqns[-1].params["jaxpr"].eqns[-1]  # Inside jnp.take's own jit.
    >>> gather.primitive.name, is_row_lookup((5, 3), gather.params)
    ('gather', True)
  """
  dn = params.get("dimension_numbers")
  if dn is None or len(operand_shape) != 2 or tuple(params.get("slice_sizes", ())) != (1, operand_shape[1]):
    return False
  return (tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
          and not tuple(getattr(dn, "operand_batching_dims", ())))


def _everywhere(x: jax.Array, mesh: Any) -> jax.Array:
  return lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))


def _on_the_wire(q: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``q`` and its scales replicated over ``q``'s mesh, ``q`` sent as its float8 bits.

  XLA would widen a float8 value before gathering it, but not its bits.
  """
  mesh = jax.typeof(q).sharding.mesh
  bits = _everywhere(lax.bitcast_convert_type(q, jnp.uint8), mesh)
  return lax.bitcast_convert_type(bits, q.dtype), _everywhere(s, mesh)


def fp8_lookup(table: jax.Array, indices: jax.Array, gather: Any, recipe: Float8Recipe) -> jax.Array:
  """``gather(table, indices)``, whose cotangent is quantised to ``recipe.backward`` for its scatter-add.

  Args:
    table: the embedding table (the half dtype).
    indices: the integer indices.
    gather: ``gather(table, indices)``, the traced lookup (its dimension
      numbers and out-of-bounds mode): linear in ``table``.
    recipe: the FP8 recipe, whose backward format and scale rule the
      cotangent takes.

  Returns:
    The looked-up rows, exactly the ordinary gather's.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> t = jnp.arange(6.0, dtype=jnp.bfloat16).reshape(3, 2)
    >>> take = lambda t, i: jnp.take(t, i, axis=0)
    >>> i = jnp.array([2, 0, 2])
    >>> fp8_lookup(t, i, take, Float8Recipe()).tolist()
    [[4.0, 5.0], [0.0, 1.0], [4.0, 5.0]]
    >>> g = jax.grad(lambda t: (fp8_lookup(t, i, take, Float8Recipe()) * jnp.array([1.0, 0.3])).sum())(t)
    >>> g.tolist()  # 0.3 / s = 17203 rounds to e5m2's 16384 (s = 1 / 57344)
    [[1.0, 0.28515625], [0.0, 0.0], [2.0, 0.5703125]]
  """

  @jax.custom_vjp
  def lookup(table: jax.Array, indices: jax.Array) -> jax.Array:
    return gather(table, indices)

  def forward(table: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gather(table, indices), indices

  def backward(indices: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    n_groups = fp8_groups.groups_of(g) if g.ndim else 1
    axes = tuple(range(g.ndim))
    q, s = fp8_dot._quantize(g, np.dtype(recipe.backward), recipe.margin, recipe.power_of_two,
                             axes, groups=n_groups)
    if n_groups > 1:
      q, s = _on_the_wire(q, s)
    dequantised = fp8_dot.dequantize(q, fp8_groups.rows(s, 0, g.shape[0]) if g.ndim else s, g.dtype)
    if n_groups > 1:  # Dequantised where it arrived, not per shard and gathered again wider.
      dequantised = _everywhere(dequantised, jax.typeof(g).sharding.mesh)
    _, pull = jax.vjp(lambda t: gather(t, indices), jnp.zeros(table.shape, table.dtype))
    return pull(dequantised)[0], None

  lookup.defvjp(forward, backward)
  return lookup(table, indices)

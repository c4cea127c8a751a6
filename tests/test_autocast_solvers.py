"""A solver's own arithmetic under autocast (issue 42 item 3).

diffrax's Runge-Kutta stage sums and error estimate (``vector_tree_dot``: a
tableau row contracted with the stages) and lineax's RMS norm (a sum of
squares, ``jnp.dot(x, x)``) are ``dot_general``s. Autocast ran them in half,
and the adaptive solver took up to 2.4x float32's steps. They are no matrix
products (``autocast/lists.py``'s ``is_matmul``: an inner product, or a
weighted sum of fewer than 16 vectors whose weights are constants or asked for
at ``Precision.HIGHEST``): they run as traced, in
float32, while the vector field's matmuls run in half.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
FP8 = jmp.Float8Recipe(min_size=0)  # Every matmul in FP8, the smallest too.
HIGHEST = jax.lax.Precision.HIGHEST
MODES = {"f16": (F16, None), "bf16": (BF16, None), "fp8": (BF16, FP8)}


@pytest.mark.parametrize("mode", list(MODES))
def test_inner_products_and_weighted_sums_of_few_vectors_run_as_traced(mode, maybe_jit):
  dtype, fp8 = MODES[mode]
  x = jax.random.normal(jax.random.key(0), (32, 64))
  w = jax.random.normal(jax.random.key(1), (64, 48))
  stages = jax.random.normal(jax.random.key(2), (7, 64))
  row = jnp.linspace(0.1, 0.7, 7)

  def f(x, w, stages, row):
    return {"layer": x @ w,                                   # weights by a batch: a matmul
            "gemv": x[0] @ w,                                 # one activation, 64 features
            "norm": jnp.sqrt(jnp.dot(x[0], x[0])),            # a sum of squares
            "rows": jax.vmap(jnp.dot)(x, x),                  # batched inner products
            "stage_sum": jnp.tensordot(row, stages, axes=1, precision=HIGHEST),  # as diffrax
            "batched": jnp.tensordot(row, stages[:, None] * x[None, :4], axes=1,
                                     precision=HIGHEST),
            "few_rows": row[None] @ stages}                   # a row of an activation: a matmul

  out = maybe_jit(jmp.autocast(f, dtype, fp8=fp8))(x, w, stages, row)
  want = f(x, w, stages, row)
  assert out["layer"].dtype == out["gemv"].dtype == out["few_rows"].dtype == dtype
  for name in ("norm", "rows", "stage_sum", "batched"):  # Half before: float32 now, exact.
    assert out[name].dtype == F32, name
    np.testing.assert_array_equal(out[name], want[name], err_msg=name)
  report = jmp.precision_report(f, x, w, stages, row, autocast=True, policy=(
      "mixed_float16" if dtype == F16 else "mixed_bfloat16"), fp8=fp8 or False)
  assert report.count("matmul") == 3 and report.count("matmul", F32) == 0
  assert report.count("reduction", F32) >= 4


class Field(eqx.Module):
  """A batch of states through a tiny MLP: its matmuls are matrix products."""

  mlp: eqx.nn.MLP

  def __call__(self, t, y, args):
    return jax.vmap(self.mlp)(y)


class HalfField(eqx.Module):
  """The reference: only the vector field under autocast, the solver outside it in float32."""

  field: Field
  dtype: object = eqx.field(static=True)
  fp8: object = eqx.field(static=True)

  def __call__(self, t, y, args):
    run = jmp.autocast(lambda f, y: f(t, y, args), self.dtype, fp8=self.fp8)
    return run(self.field, y).astype(F32)


def _solve(field, y0, solver):
  sol = diffrax.diffeqsolve(
      diffrax.ODETerm(field), solver(), 0.0, 1.0, 0.1, y0,
      stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
      saveat=diffrax.SaveAt(t1=True), max_steps=64)
  return sol.ys[-1], sol.stats["num_steps"]


def _float_carries(jaxpr):
  return [v.aval.dtype for e in jaxpr_utils.walk(jaxpr) if e.primitive.name == "while"
          for v in e.outvars if jaxpr_utils.is_floating(v.aval.dtype)]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_solvers_arithmetic_and_carries_stay_float32(mode, solver=diffrax.Tsit5):
  """No more steps than the solve whose vector field alone runs under autocast.

  The steps that remain above float32's (2 here) are the vector field's: its
  values carry half's rounding, which the error estimate sees against a
  tolerance float32 meets with room to spare.
  """
  dtype, fp8 = MODES[mode]
  field = Field(eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0)))
  y0 = jax.random.normal(jax.random.key(1), (8, 2))
  run = jmp.autocast(lambda f, y: _solve(f, y, solver), dtype, fp8=fp8)
  y1, steps = eqx.filter_jit(run)(field, y0)
  y_ref, ref_steps = eqx.filter_jit(_solve)(HalfField(field, dtype, fp8), y0, solver)
  assert y1.dtype == F32
  # No more steps than the reference (as many in float16 and bfloat16; FP8 took 6 against 7).
  # Before: 6 against 4 (bfloat16), 10 against 7 (FP8).
  assert int(steps) <= int(ref_steps), (int(steps), int(ref_steps))
  np.testing.assert_allclose(y1, y_ref, atol=0.01 if dtype == F16 else 0.05)  # The field's rounding.
  # The time, the step size, the controller's state and the solution: float32 carries.
  params, static = eqx.partition(field, eqx.is_array)
  jaxpr = jax.make_jaxpr(lambda p, y: run(eqx.combine(p, static), y))(params, y0).jaxpr
  carries = _float_carries(jaxpr)
  assert carries and all(d == F32 for d in carries), carries

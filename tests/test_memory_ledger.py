"""``jmp.memory_ledger`` (issue 35): where the bytes of a TrainState go."""

import jax
import jax.numpy as jnp
import optax

import jmp_lite as jmp

N_IN, N_HIDDEN, N_OUT = 256, 1024, 256


def params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (N_IN, N_HIDDEN)), "b1": jnp.zeros(N_HIDDEN),
          "w2": jax.random.normal(k2, (N_HIDDEN, N_OUT)), "b2": jnp.zeros(N_OUT)}


N_MATRIX = 2 * N_IN * N_HIDDEN
N_BIAS = N_HIDDEN + N_OUT
N = N_MATRIX + N_BIAS


def lean_int8_state(**kwargs):
  return jmp.TrainState.create(
      params=params(), tx=jmp.dynamic_loss_scaling(jmp.quantize_state(optax.adamw(1e-3), **kwargs)),
      master_dtype=jnp.bfloat16, rounding="stochastic", key=jax.random.key(1))


def test_float32_adamw_is_12_bytes_per_param():
  ledger = jmp.memory_ledger(jmp.TrainState.create(params=params(), tx=optax.adamw(1e-3)))
  assert ledger.params == N
  assert ledger.bytes_of("params") == 4 * N
  assert ledger.bytes_of("optimizer state") == 8 * N + 4  # mu, nu and Adam's int32 count
  assert ledger.total_bytes == 12 * N + 4 + 4  # and the step counter
  assert abs(ledger.bytes_per_param - 12) < 1e-4


def test_bf16_stochastic_masters_and_int8_state_persist_in_at_most_4_1_bytes_per_param():
  ledger = jmp.memory_ledger(lean_int8_state())
  rows = {(r.part, r.stored_as): r.bytes for r in ledger.rows}
  assert rows[("params", "bfloat16")] == 2 * N
  assert rows[("optimizer state", "uint8 codes")] == 2 * N_MATRIX  # mu and nu, a byte each
  assert rows[("optimizer state", "float32 scales")] == 4 * 2 * N_MATRIX // 256
  # The biases (under min_size) keep float32 moments; the scaler keeps float32 and int32 scalars.
  assert rows[("optimizer state", "float32")] == 8 * N_BIAS + 4
  assert rows[("optimizer state", "int32")] == 16 + 4  # Adam's and the scaler's counts; the codes' count
  assert ledger.bytes_per_param <= 4.1
  assert ledger.bytes_per_param == ledger.total_bytes / N


def test_bf16_stochastic_masters_and_int4_state_persist_in_at_most_3_1_bytes_per_param():
  ledger = jmp.memory_ledger(lean_int8_state(format="int4"))
  rows = {(r.part, r.stored_as): (r.elements, r.bytes) for r in ledger.rows}
  assert rows[("optimizer state", "4-bit codes")] == (2 * N_MATRIX, N_MATRIX)  # two codes a byte
  assert rows[("optimizer state", "float32 scales")][1] == 4 * N_MATRIX // 256  # nu's blocks
  assert rows[("optimizer state", "bfloat16 scales")][1] == 2 * N_MATRIX // 32  # mu's blocks
  assert ledger.bytes_per_param <= 3.1


def _transformer_state(fmt, layers=12, d=768, vocab=32000):
  """A GPT-2-small-shaped Transformer (about 134M parameters) and its lean state, from shapes."""
  def make():
    z = jnp.zeros
    block = lambda: {"ln1": z(d), "qkv": z((d, 3 * d)), "qkv_b": z(3 * d), "out": z((d, d)),
                     "out_b": z(d), "ln2": z(d), "up": z((d, 4 * d)), "up_b": z(4 * d),
                     "down": z((4 * d, d)), "down_b": z(d)}
    params = {"embed": z((vocab, d)), "pos": z((1024, d)), "blocks": [block() for _ in range(layers)],
              "ln_f": z(d)}
    tx = jmp.dynamic_loss_scaling(jmp.quantize_state(optax.adamw(1e-3), fmt))
    return jmp.TrainState.create(params=params, tx=tx, master_dtype=jnp.bfloat16,
                                 rounding="stochastic", key=jax.random.key(0))
  return jmp.memory_ledger(jax.eval_shape(make))


def test_a_100m_transformer_persists_in_3_1_bytes_per_param_with_int4_state():
  int4, int8 = _transformer_state("int4"), _transformer_state("int8")
  assert int4.params == int8.params > 100_000_000
  assert int4.bytes_per_param <= 3.1 < 4.0 < int8.bytes_per_param <= 4.1
  assert int8.bytes_per_param - int4.bytes_per_param > 0.95  # a byte a parameter, less the scales


def test_eval_shape_gives_the_same_ledger_without_allocating():
  real = jmp.memory_ledger(lean_int8_state())
  abstract = jmp.memory_ledger(jax.eval_shape(lean_int8_state))
  assert abstract == real


def test_kahan_compensation_float8_and_model_state_have_their_rows():
  state = jmp.TrainState.create(params=params(), tx=jmp.quantize_state(optax.adam(1e-3), "float8"),
                                master_dtype=jnp.bfloat16, rounding="kahan",
                                model_state={"mean": jnp.zeros(100)})
  ledger = jmp.memory_ledger(state)
  assert ledger.bytes_of("compensation") == 2 * N
  assert ledger.bytes_of("model state") == 400
  stored = {r.stored_as for r in ledger.rows if r.part == "optimizer state"}
  assert stored == {"uint8 codes", "float32 scales", "float32", "int32"}


def test_a_plain_tree_is_one_part_and_the_table_prints_every_row():
  ledger = jmp.memory_ledger({"a": jnp.zeros((10, 10)), "b": jnp.zeros(5, jnp.int32)})
  assert [(r.part, r.stored_as, r.elements, r.bytes) for r in ledger.rows] == [
      ("other", "float32", 100, 400), ("other", "int32", 5, 20)]
  assert ledger.params == 100 and ledger.bytes_per_param == 4.2
  lines = str(ledger).splitlines()
  assert lines[0].split() == ["part", "stored", "as", "elements", "bytes", "bytes/param"]
  assert lines[1].split() == ["other", "float32", "100", "400", "4.000"]
  assert lines[-1].split() == ["total", "420", "4.200"]

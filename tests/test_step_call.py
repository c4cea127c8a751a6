"""Calling the step: static (non-array) batch leaves are compile-time values, checked per call."""

import time

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lite as jmp
from jmp_lite._src import filtering


def _problem():
  traces = []

  def loss_fn(params, batch):
    traces.append(batch)
    return jnp.sum(params["w"] * batch["x"]) * batch["scale"]

  state = jmp.TrainState.create(params={"w": jnp.array([1.0, 2.0])}, tx=optax.sgd(0.5))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), donate=False)
  return state, step, traces


def test_a_python_number_in_the_batch_is_static():
  state, step, traces = _problem()
  x = jnp.array([3.0, 4.0])
  state, metrics = step(state, {"x": x, "scale": 2.0})
  assert float(metrics["loss"]) == 22.0  # (1*3 + 2*4) * 2
  assert traces[0]["scale"] == 2.0 and type(traces[0]["scale"]) is float  # Not traced.
  assert state.params["w"].tolist() == [1.0 - 0.5 * 6.0, 2.0 - 0.5 * 8.0]
  state, metrics = step(state, {"x": x, "scale": 2.0})  # The same value: no new trace.
  assert len(traces) == 1
  assert float(metrics["loss"]) == (-2.0 * 3.0 - 2.0 * 4.0) * 2.0


@pytest.mark.parametrize(
    "scale, described",
    [(3.0, "3.0"), (2, "2"), (jnp.asarray(2.0), "an array")],
    ids=["other-value", "other-type", "array"],
)
def test_a_changed_static_batch_leaf_is_refused(scale, described):
  state, step, traces = _problem()
  x = jnp.array([3.0, 4.0])
  step(state, {"x": x, "scale": 2.0})
  expected = (
      r"a static \(non-array\) batch leaf changed value between calls of the same train step: "
      rf"batch\['scale'\] was 2.0 on the first call and is {described} now\. .*"
      r"pass an array \(jnp.asarray\) for a value that changes per step, or build another step"
  )
  with pytest.raises(ValueError, match=expected):
    step(state, {"x": x, "scale": scale})
  assert len(traces) == 1  # Refused before tracing.


def test_an_array_where_the_first_call_had_one_may_change_value():
  state, step, traces = _problem()
  x = jnp.array([3.0, 4.0])
  losses = [float(step(state, {"x": x, "scale": jnp.float32(s)})[1]["loss"]) for s in (2.0, 3.0)]
  assert losses == [22.0, 33.0] and len(traces) == 1
  expected = r"batch\['scale'\] was an array on the first call and is 3.0 now"
  with pytest.raises(ValueError, match=expected):
    step(state, {"x": x, "scale": 3.0})


def test_a_string_in_the_batch_is_static_and_checked():
  seen = []

  def loss_fn(params, batch):
    seen.append(batch["mode"])
    return jnp.sum(params["w"] * batch["x"])

  state = jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_bfloat16"), donate=False)
  for _ in range(2):
    _, metrics = step(state, {"x": jnp.array([1.0, 2.0]), "mode": "train"})
  assert seen == ["train"] and float(metrics["loss"]) == 3.0
  expected = r"batch\['mode'\] was 'train' on the first call and is 'eval' now"
  with pytest.raises(ValueError, match=expected):
    step(state, {"x": jnp.array([1.0, 2.0]), "mode": "eval"})


def test_a_donated_state_is_refused_before_dispatch(capfd):
  state, _, _ = _problem()
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b["x"]), jmp.get_policy("f32"))
  new, _ = step(state, {"x": jnp.ones(2)})
  capfd.readouterr()
  expected = (r"^state.step was deleted: a donating step .* consumed the state it was part of\. "
              r"Keep using the state each call returns")
  with pytest.raises(ValueError, match=expected):
    step(state, {"x": jnp.ones(2)})
  err = capfd.readouterr().err
  assert "donated" not in err and "Execute()" not in err, err  # No XLA log line.
  assert int(step(new, {"x": jnp.ones(2)})[0].step) == 2


@pytest.mark.parametrize("donate", [True, False])
def test_an_error_raised_while_the_step_runs_surfaces_unchanged(donate):
  # Issue 37 item 2: eqx.error_if (diffrax's "maximum number of solver steps")
  # failed a fresh state's first call with "state.step was deleted": the
  # donating call had consumed the state while running, and that was taken
  # for a state consumed before the call.
  import equinox as eqx

  def loss_fn(params, batch):
    loss = jnp.sum(params["w"] * batch["x"])
    return eqx.error_if(loss, loss > 100.0, "the loss ran away")

  state, _, _ = _problem()
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"), donate=donate)
  for first in (True, False):  # The first call, and a later one.
    # JAX raises it as a RuntimeError or (on a later, synchronous call) a ValueError.
    with pytest.raises((RuntimeError, ValueError), match="the loss ran away") as info:
      jax.block_until_ready(step(state, {"x": jnp.array([1e3, 1e3])}))  # Dispatch is async.
    assert "deleted" not in str(info.value) and info.value.__cause__ is None
    if first:
      state, _ = step(jmp.TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.5)),
                      {"x": jnp.ones(2)})
  if donate:  # Now the state was really consumed, and is named so.
    with pytest.raises(ValueError, match=r"^state.step was deleted: a donating step"):
      step(state, {"x": jnp.ones(2)})


def test_flaxs_train_state_is_named_next_to_jmp_lites():
  from flax.training import train_state

  _, step, _ = _problem()
  flax_state = train_state.TrainState.create(
      apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
  expected = (r"^state must be a jmp_lite.TrainState \(see TrainState.create\), got "
              r"flax.training.train_state.TrainState \(another library's TrainState, not "
              r"jmp_lite.TrainState: build one with jmp_lite.TrainState.create")
  with pytest.raises(TypeError, match=expected):
    step(flax_state, {"x": jnp.ones(2), "scale": 1.0})
  with pytest.raises(TypeError, match=r"got dict$"):
    step({"params": {"w": jnp.ones(2)}}, {"x": jnp.ones(2), "scale": 1.0})


def test_the_step_dispatches_asynchronously_with_its_skip_metrics():
  # The Python side of a call (structure checks, donation checks, consecutive_skips)
  # never waits on the device: the call returns while the heavy step still runs.
  def loss_fn(params, x):
    return jnp.mean(jnp.linalg.matrix_power(x * params["w"], 24).astype(jnp.float32))

  x = jnp.full((1024, 1024), 1.0 / 1024)
  tx = jmp.dynamic_loss_scaling(optax.sgd(1e-3))
  state = jmp.TrainState.create(params={"w": jnp.ones(())}, tx=tx)
  step = jmp.make_train_step(loss_fn, jmp.get_policy("mixed_float16"))
  state, metrics = jax.block_until_ready(step(state, x))  # compiled
  start = time.perf_counter()
  state, metrics = step(state, x)
  dispatched = time.perf_counter() - start
  jax.block_until_ready((state, metrics))
  total = time.perf_counter() - start
  assert int(metrics["consecutive_skips"]) == 0
  assert dispatched < 0.25 * total, (dispatched, total)


def test_a_call_does_no_python_work_per_leaf(monkeypatch):
  # Issue 31 item 5: the structure checks ran on the Python side of every call
  # (flattening the params and the batch); they now run when jax retraces.
  from jmp_lite._src import filtering
  from jmp_lite._src.step import call as step_call

  calls = []

  def counting(name, original):
    return lambda *args, **kwargs: (calls.append(name), original(*args, **kwargs))[1]

  for module, name in ((step_call, "_signature"), (filtering, "partition"),
                       (filtering, "hollow"), (jax.tree_util, "tree_flatten_with_path")):
    monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
  state, _, _ = _problem()
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b["x"]), jmp.get_policy("f32"))
  batch = {"x": jnp.array([3.0, 4.0])}
  state, _ = step(state, batch)  # the first call records the signature
  assert "_signature" in calls
  calls.clear()
  for _ in range(5):
    state, metrics = step(state, batch)
  assert calls == [] and int(state.step) == 6
  assert float(metrics["loss"]) == (1.0 - 1.5 * 5) * 3.0 + (2.0 - 2.0 * 5) * 4.0  # sgd(0.5)


def test_a_string_where_the_first_call_had_an_array_is_named():
  state, step, traces = _problem()
  x = jnp.array([3.0, 4.0])
  state, _ = step(state, {"x": x, "scale": jnp.float32(2.0)})
  expected = r"batch\['scale'\] was an array on the first call and is 'two' now"
  with pytest.raises(ValueError, match=expected):
    step(state, {"x": x, "scale": "two"})
  with pytest.raises(ValueError, match=r"params tree changed structure"):
    step(state.replace(params={"w": state.params["w"], "v": jnp.ones(2)}), {"x": x, "scale": 2.0})
  assert len(traces) == 1
  state, metrics = step(state, {"x": x, "scale": jnp.float32(1.0)})  # the first signature still runs
  assert int(state.step) == 2 and len(traces) == 1


def test_lower_trace_and_eval_shape_check_their_arguments_as_a_call_does():
  state, step, traces = _problem()
  batch = {"x": jnp.array([3.0, 4.0]), "scale": 2.0}
  state, _ = step(state, batch)
  wide = {"x": jnp.ones(3), "scale": 2.0}  # a new shape: traces and compiles
  bigger = state.replace(params={"w": jnp.ones(3)}, opt_state=optax.sgd(0.5).init({"w": jnp.ones(3)}))
  shapes = step.eval_shape(bigger, wide)
  assert shapes[0].params["w"].shape == (3,) and shapes[1]["loss"].dtype == jnp.float32
  assert "stablehlo" in step.lower(bigger, wide).as_text() and step.trace(bigger, wide).jaxpr
  for method in (step.eval_shape, step.lower, step.trace):
    with pytest.raises(ValueError, match=r"batch\['scale'\] was 2.0 on the first call and is 3.0 now"):
      method(state, {"x": batch["x"], "scale": 3.0})
  state, metrics = step(state, batch)  # the first call's program, unchanged
  assert float(metrics["loss"]) == (-2.0 * 3.0 - 2.0 * 4.0) * 2.0 and len(traces) == 2


@pytest.mark.parametrize("tag", [None, "tag"], ids=["arrays-only", "static-leaf"])
def test_an_in_place_edit_of_the_params_reaches_the_step(tag, monkeypatch):
  # Issue 36 item 5: with a static leaf in the params, the edit showed in
  # state.params but the step, the leaves and checkpoints kept the old arrays.
  params = {"w": jnp.array([1.0, 2.0]), "inner": {"b": jnp.zeros(2)}}
  if tag is not None:
    params["inner"]["tag"] = tag
  state = jmp.TrainState.create(params=params, tx=optax.sgd(0.0))
  step = jmp.make_train_step(lambda p, b: jnp.sum(p["w"] * b + p["inner"]["b"]),
                             jmp.get_policy("f32"), donate=False)
  batch = jnp.array([1.0, 1.0])
  assert float(step(state, batch)[1]["loss"]) == 3.0
  hollowed, original = [], filtering.hollow
  monkeypatch.setattr(filtering, "hollow", lambda t: (hollowed.append(1), original(t))[1])
  step(state, batch)
  assert hollowed == []  # Unedited: flattening the state hollows nothing again.
  state.params["w"] = jnp.array([10.0, 11.0])  # Loading pretrained weights in place.
  state.params["inner"]["b"] = jnp.array([0.5, 0.5])
  new, metrics = step(state, batch)
  assert len(hollowed) == (3 if tag else 0)  # params, opt_state, model_state: once.
  assert float(metrics["loss"]) == 22.0
  assert new.params["w"].tolist() == [10.0, 11.0]
  leaves = jax.tree.leaves(state)  # What checkpoints save.
  assert any(x is state.params["w"] for x in leaves)
  assert any(x is state.params["inner"]["b"] for x in leaves)
  if tag is not None:
    assert new.params["inner"]["tag"] == "tag"
    state.params["inner"]["tag"] = "other"  # A changed static leaf: a new structure.
    assert jax.tree.structure(state) != jax.tree.structure(new)

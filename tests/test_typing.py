"""mypy passes on the package (we ship py.typed) and on user code typed against it."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_typing")

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A user's file: the README's quickstart, typed. It must check under the
# project's strict config, so the public signatures accept what the docs show.
USER_CODE = '''
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jmp_lite as jmp

def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


policy: jmp.Policy = jmp.get_policy("p=f32,c=f16,o=f32")
explicit = jmp.Policy(jnp.float32, jnp.float16, "float32", keep_full="norm")
tx: optax.GradientTransformationExtraArgs = jmp.dynamic_loss_scaling(optax.adam(1e-3))
accumulated = jmp.static_loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), 1.0)
state = jmp.TrainState.create(params={"w": jnp.ones((3, 1))}, tx=tx)
step = jmp.make_train_step(loss_fn, policy)
state, metrics = step(state, {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 1))})
scale: jax.Array = jmp.loss_scale_of(state.opt_state)
half: dict[str, Any] = policy.cast_to_compute({"w": jnp.ones(2)})
batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 1))}
low: jax.Array = jmp.autocast(loss_fn, jnp.bfloat16)({"w": jnp.ones((3, 1))}, batch)
new_params, comp = jmp.apply_updates({"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.ones(2)})
'''

# Wrong calls mypy must catch, with the line and error code of each.
WRONG_CODE = '''
import optax

import jmp_lite as jmp

jmp.dynamic_loss_scaling(3)
jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scal=2.0)
jmp.get_policy(16)
'''
WRONG_ERRORS = (":6: error:", "[arg-type]"), (":7: error:", "[call-arg]"), (":8: error:", "[arg-type]")


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
  """Runs mypy with the project's config and one cache shared by this module's runs."""
  cache = tmp_path_factory.mktemp("mypy_cache")

  def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(cache), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )

  return run


@pytest.mark.slow
def test_package_passes_mypy(mypy):
  result = mypy()  # The files in [tool.mypy].
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.startswith("Success: no issues found"), result.stdout


@pytest.mark.slow
def test_user_code_type_checks(mypy, tmp_path):
  path = tmp_path / "user.py"
  path.write_text(textwrap.dedent(USER_CODE))
  result = mypy(str(path))
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_catches_wrong_calls(mypy, tmp_path):
  path = tmp_path / "wrong.py"
  path.write_text(textwrap.dedent(WRONG_CODE))
  result = mypy(str(path))
  assert result.returncode == 1, result.stdout + result.stderr
  errors = [line for line in result.stdout.splitlines() if ": error:" in line]
  assert len(errors) == len(WRONG_ERRORS), result.stdout
  for line, (where, code) in zip(errors, WRONG_ERRORS):
    assert where in line and line.endswith(code), result.stdout

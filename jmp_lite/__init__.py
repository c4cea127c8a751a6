"""jmp_lite: mixed-precision training for JAX, Flax and optax.

A drop-in replacement for DeepMind's ``jmp`` (``import jmp_lite as jmp``) plus an
optax loss-scaling transformation and a jit-compiled train step.
"""

from jmp_lite._src.autocast.autocast import autocast
from jmp_lite._src.autocast.lists import AutocastLists
from jmp_lite._src.fp8.recipe import Float8Recipe
from jmp_lite._src.diagnostics.fp8_sensitivity import Float8Sensitivity
from jmp_lite._src.diagnostics.fp8_sensitivity import Float8SensitivityRow
from jmp_lite._src.diagnostics.fp8_sensitivity import fp8_sensitivity
from jmp_lite._src.diagnostics.gpu_compile import GpuCompileReport
from jmp_lite._src.diagnostics.gpu_compile import compile_for_gpu
from jmp_lite._src.diagnostics.grad_report import GradientReport
from jmp_lite._src.diagnostics.grad_report import LeafStats
from jmp_lite._src.diagnostics.grad_report import gradient_report
from jmp_lite._src.diagnostics.grad_report import nonfinite_paths
from jmp_lite._src.diagnostics.findings import LintFinding
from jmp_lite._src.diagnostics.findings import LintFindings
from jmp_lite._src.diagnostics.lint import precision_lint
from jmp_lite._src.diagnostics.memory_ledger import LedgerRow
from jmp_lite._src.diagnostics.memory_ledger import MemoryLedger
from jmp_lite._src.diagnostics.memory_ledger import memory_ledger
from jmp_lite._src.scaling.loss_scale import DynamicLossScale
from jmp_lite._src.scaling.loss_scale import LossScale
from jmp_lite._src.scaling.loss_scale import NoOpLossScale
from jmp_lite._src.scaling.loss_scale import StaticLossScale
from jmp_lite._src.scaling.loss_scale import all_finite
from jmp_lite._src.scaling.loss_scale import select_tree
from jmp_lite._src.masters import apply_updates
from jmp_lite._src.optim.coded import QuantizedArray
from jmp_lite._src.optim.quantize import QuantizedState
from jmp_lite._src.optim.quantize import quantize_state
from jmp_lite._src.policy import Policy
from jmp_lite._src.policy import cast_to_full
from jmp_lite._src.policy import cast_to_half
from jmp_lite._src.policy import get_policy
from jmp_lite._src.policy import half_dtype
from jmp_lite._src.diagnostics.precision_report import PrecisionReport
from jmp_lite._src.diagnostics.precision_report import precision_report
from jmp_lite._src.step.train_state import TrainState
from jmp_lite._src.step.eval import make_eval_step
from jmp_lite._src.step.make import make_train_step
from jmp_lite._src.step.half_share import NothingInHalfWarning
from jmp_lite._src.step.half_sums import HalfSumWarning
from jmp_lite._src.scaling.transform import LossScaleState
from jmp_lite._src.scaling.transform import dynamic_loss_scaling
from jmp_lite._src.scaling.transform import loss_scale_of
from jmp_lite._src.scaling.transform import skipped_steps_of
from jmp_lite._src.scaling.transform import static_loss_scaling

__version__ = "0.1.0"

__all__ = (
    "AutocastLists",
    "DynamicLossScale",
    "Float8Recipe",
    "Float8Sensitivity",
    "Float8SensitivityRow",
    "GpuCompileReport",
    "GradientReport",
    "HalfSumWarning",
    "LeafStats",
    "LedgerRow",
    "LintFinding",
    "LintFindings",
    "LossScale",
    "LossScaleState",
    "NothingInHalfWarning",
    "MemoryLedger",
    "NoOpLossScale",
    "Policy",
    "PrecisionReport",
    "QuantizedArray",
    "QuantizedState",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "apply_updates",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "compile_for_gpu",
    "dynamic_loss_scaling",
    "fp8_sensitivity",
    "get_policy",
    "gradient_report",
    "half_dtype",
    "loss_scale_of",
    "make_eval_step",
    "make_train_step",
    "memory_ledger",
    "nonfinite_paths",
    "precision_lint",
    "precision_report",
    "quantize_state",
    "select_tree",
    "skipped_steps_of",
    "static_loss_scaling",
)

"""8-bit optimizer state against torchao's: a matrix of problems, a mixed-magnitude sweep, a cooldown.

Run ``python -m benchmarks.optim_oracle --help``. It needs torch and torchao
(``pip install torch torchao``, or ``pip install -e '.[oracle]'``), which the
tests and the other benchmarks never do; without them it stops with that
message. torchao's optimizers call ``torch.compile`` in each step; the
benchmark replaces it by the identity while they step, so they run eagerly on
the CPU (their arithmetic is the same, only not fused).

Four parts (``--parts``):

- **matrix**: each problem (:mod:`.problems`: MLPs, a CNN, an LSTM and a
  Transformer; tanh, GELU and ReLU; 100 to 2,000 steps; lr 1e-4 to 1e-2;
  weight decay on and off), at 4 seeds, trained by ``optax.adamw``,
  ``jmp.quantize_state(optax.adamw, "int8")`` and ``"float8"``,
  ``torch.optim.AdamW`` and torchao's ``AdamW8bit`` and ``AdamWFp8``, from
  the same weights on the same batches (:mod:`.variants`). Each coded run's
  drift from its side's float32 run (:mod:`.drift`), and per problem the
  ratio of jmp's mean drift over torchao's.
- **families**: ``optax.lion`` and ``optax.sgd(momentum=0.9)``, coded in
  both formats, against their float32 selves on the same problems (torchao
  has no coded counterpart).
- **sweep** (:mod:`.sweep`): Adam on blocks whose gradients mix 1 and a ratio
  from 1 to 1e-8 (33 ratios); each coded optimizer's largest step over float32
  Adam's.
- **cooldown** (:mod:`.cooldown`): ``transformer_gelu`` for 1,000 steps
  (``--cooldown-steps``) under a warmup-stable-decay schedule (peak lr 3e-3,
  3x the matrix's) whose lr falls linearly to 0 over the last 10% of steps,
  each AdamW of the matrix at the same lr each step; the held-out loss through
  the decay: its largest rise, the final loss against float32's, divergence.

Bars (:mod:`.tables`): over the problems, the worst ratio <= 1.0 and the
median <= 0.6, for int8 against ``AdamW8bit`` and float8 against
``AdamWFp8``; the sweep's largest step <= 1.5x float32 Adam's at every ratio,
for both formats; jmp and torchao code the same parameters on every problem;
in the cooldown, each jmp format's held-out loss rises at most 1% during the
decay, at every seed (torchao's are reported, not barred).
"""

from benchmarks.optim_oracle.command import build_parser
from benchmarks.optim_oracle.command import main

__all__ = ("build_parser", "main")

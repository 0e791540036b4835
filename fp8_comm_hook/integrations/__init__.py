"""Trainer integrations, each importing its framework only when used:

- :mod:`fp8_comm_hook.integrations.cli` — ``--grad-comm`` and the ``--fp8-*`` flags for argparse
  trainers (flag, then ``FP8_COMM_<FIELD>``, then the default) and ``register_grad_comm``;
- :mod:`fp8_comm_hook.integrations.lightning` — ``FP8DDPStrategy`` / ``lightning_strategy(config)``
  for PyTorch Lightning (``pip install lightning``);
- :mod:`fp8_comm_hook.integrations.accelerate` — ``register_accelerate_hook(accelerator, model, config)``
  for Hugging Face Accelerate (``pip install accelerate``), after ``accelerator.prepare``;
- :mod:`fp8_comm_hook.integrations.transformers` — ``register_trainer_hook(trainer, config)`` for the
  Hugging Face ``Trainer`` (``pip install transformers``).
"""

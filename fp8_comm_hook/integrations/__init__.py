"""Trainer integrations, each importing its framework only when used:

- :mod:`fp8_comm_hook.integrations.lightning` — ``FP8DDPStrategy`` / ``lightning_strategy(config)``
  for PyTorch Lightning (``pip install lightning``);
- :mod:`fp8_comm_hook.integrations.accelerate` — ``register_accelerate_hook(accelerator, model, config)``
  for Hugging Face Accelerate (``pip install accelerate``), after ``accelerator.prepare``.
"""

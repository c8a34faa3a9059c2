"""Fine-tuning kit trainer package: config, families, data, loop, checkpoints, run logs."""

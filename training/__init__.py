"""The training loop and what it owns: optimizer, schedule, precision, metrics, checkpoints, loggers."""

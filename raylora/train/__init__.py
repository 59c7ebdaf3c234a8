"""Training: the driver (fit), the Ray Train worker loop, checkpoints, the single-process quickstart."""

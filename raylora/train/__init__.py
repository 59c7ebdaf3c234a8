"""Training: the single-process quickstart loop now; the Ray Train worker loop and fit() build on it."""

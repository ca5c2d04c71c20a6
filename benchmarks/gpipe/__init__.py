"""The single-process GPipe executor: per-micro-batch overhead and activation memory."""

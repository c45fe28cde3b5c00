"""Watching a run: events, metric sinks (JSONL, TensorBoard, W&B), the console's progress line,
per-role time profiles, the live dashboard (its page in page/) and the end-of-run report."""

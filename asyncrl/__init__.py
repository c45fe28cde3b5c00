"""asyncrl: asynchronous RL post-training for language models (see README.md)."""

__version__ = "0.1.0"

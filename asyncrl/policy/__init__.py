"""The policy: loading any Hugging Face causal LM, and building and warm-starting the tiny ones."""

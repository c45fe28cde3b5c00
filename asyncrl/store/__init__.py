"""What a run keeps durably: the sample ledger and the trainer's checkpoints."""

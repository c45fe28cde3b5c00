"""How data moves between the roles: versioned weights (files, sparse patches, Ray, NCCL: weights,
weight_sender), batches staged for the trainer and the orchestrator's link to it (staging,
trainer_link: batches out, versions and checkpoints back)."""

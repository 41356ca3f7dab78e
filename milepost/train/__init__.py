"""The trainer: advantages, losses, and training backends behind `TrainBackend` (FSDP2 first)."""

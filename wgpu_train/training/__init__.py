"""Layer 5, the trainer: TrainConfig, the Trainer with its setup and records, checkpoints, run folders, metrics and
trackers, schedules, evaluation."""

"""Training: state, the loop, optimizers and schedules, evaluation."""

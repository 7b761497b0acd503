"""The training path of an op: validation, teacher-forced logprobs, losses, the optimizer, state on disk."""

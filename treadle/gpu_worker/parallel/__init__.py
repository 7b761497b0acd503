"""Data parallelism over several devices: the device group and its distributed training step."""

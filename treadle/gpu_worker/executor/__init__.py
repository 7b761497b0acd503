"""The ordered op executor: Celery tasks, the per-session sequencer, failover, usage."""

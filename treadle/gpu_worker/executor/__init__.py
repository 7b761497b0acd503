"""The ordered op executor: Celery tasks, the per-session sequencer and hand-off, failover, usage."""

"""Who runs on the device when: the device lock, fair tags, turns, the hand-off wait, compute and CPU threads."""

"""Sessions hosted on a worker: creation and adoption, op handlers, autosave, expiry, checkpoint I/O."""

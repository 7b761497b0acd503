"""Operational signals of treadle processes: Prometheus metrics (`treadle.observability.metrics`)."""

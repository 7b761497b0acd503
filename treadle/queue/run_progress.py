"""A batch run's progress: when its loop last had an op answered, for the runner's stall watch.

A runner starts each attempt of a batch run with `TREADLE_RUN_NAME` in its environment (`treadle.runs`). An
OpsClient in that process, the one the treadle SDK waits through, records the time whenever a wait gets its
answer, at most once per `REPORT_EVERY_S`. The runner restarts an attempt that has recorded progress and then
none for its run's `stall_s` (`Runner.supervise`), as it restarts one that crashed.
"""

from __future__ import annotations

import os
import time

from treadle.queue import names
from treadle.queue.outages import REDIS_ERRORS

RUN_NAME_ENV = "TREADLE_RUN_NAME"
# Often enough for any stall bound worth setting, rare enough to cost a loop of fast ops nothing.
REPORT_EVERY_S = 1.0
# The record outlives any wait between a loop's answered ops; a finished run's goes on its own.
_RECORD_TTL_S = 7 * 24 * 3600


class RunProgress:
    """Records answered ops for the batch run this process is an attempt of; does nothing outside a run."""

    def __init__(self, redis, run_name: str | None = None):
        self.redis = redis
        self.run_name = run_name if run_name is not None else os.environ.get(RUN_NAME_ENV)
        self._reported = 0.0

    def answered(self) -> None:
        if not self.run_name:
            return
        now = time.time()
        if now - self._reported < REPORT_EVERY_S:
            return
        self._reported = now
        try:
            self.redis.set(names.batch_run_progress_key(self.run_name), repr(now), ex=_RECORD_TTL_S)
        except REDIS_ERRORS:
            pass  # a report lost to an outage is made up by the next answer; the loop must not fail for it


def last_progress(redis, run_name: str) -> float | None:
    """When the run's loop last had an op answered (Unix seconds), if it ever reported."""
    raw = redis.get(names.batch_run_progress_key(run_name))
    return float(raw) if raw is not None else None

"""Batch runs: a training loop (any command) submitted to the stack, restarted and resumed by a runner.

`treadle runs submit -- python -m treadle.recipes.math_rl ...` records the run in Redis
(`records.py`); a runner process (`runner.py`, `treadle runner`, one in `treadle up`) starts it,
keeps its output in the blob store (`logs.py`), restarts it with its resume arguments when it fails,
and adopts runs whose runner died. `cli.py` holds the `treadle runs ...` sub-commands.
"""

from treadle.runs.records import RunNotFoundError, RunRecord, RunSpec, RunStatus, RunStore, TERMINAL_STATES
from treadle.runs.runner import Runner, RunnerConfig

__all__ = [
    "RunNotFoundError",
    "RunRecord",
    "RunSpec",
    "RunStatus",
    "RunStore",
    "Runner",
    "RunnerConfig",
    "TERMINAL_STATES",
]

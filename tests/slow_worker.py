"""`treadle worker` whose handler of one op sleeps first: widens the window a recovery test kills in.

python -m tests.slow_worker OP SECONDS <treadle worker options...>
"""

from __future__ import annotations

import sys
import time

from treadle.cli import main
from treadle.gpu_worker.sessions import op_handlers
from treadle.queue.ops import op_request


def slow_down(op: str, seconds: float) -> None:
    cls = op_request(op)
    handler = op_handlers.HANDLERS[cls]

    def slow(request, ctx):
        time.sleep(seconds)
        return handler(request, ctx)

    op_handlers.HANDLERS[cls] = slow


if __name__ == "__main__":
    slow_down(sys.argv[1], float(sys.argv[2]))
    main(["worker", *sys.argv[3:]])

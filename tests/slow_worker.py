"""`treadle worker` with a slowed step: widens the window a recovery test kills in.

python -m tests.slow_worker OP SECONDS <treadle worker options...>
    the handler of session op OP sleeps SECONDS first, every time;
python -m tests.slow_worker --when-asked <treadle worker options...>
    a sampler prefill, a sampler decode step, a compute_logprobs batch or a session creation (once it has
    registered the session) sleeps while the test asks for it: the seconds are the value of Redis key `tests:slow:<prefill|step|logprobs|create>`;
    and the worker SIGKILLs itself, as a worker that a request crashes does (an OOM kill, a segfault), when it
    starts a sample or a forward_backward whose tokens hold the token id that Redis key `tests:poison` names.
python -m tests.slow_worker --fail-when-asked <treadle worker options...>
    every decoder layer of this process's models raises RuntimeError while Redis key `tests:fail:layer` is set: a
    forward that fails part-way, as one out of device memory does (a device group's followers are not affected);
    and writing a full session's weights raises OSError (no space left on device) while `tests:fail:write` is set.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import time

import redis

from treadle.cli import main
from treadle.gpu_worker.sessions import op_handlers
from treadle.queue.ops import ForwardBackwardRequest, op_request


def slow_down(op: str, seconds: float) -> None:
    cls = op_request(op)
    handler = op_handlers.HANDLERS[cls]

    def slow(request, ctx):
        time.sleep(seconds)
        return handler(request, ctx)

    op_handlers.HANDLERS[cls] = slow


def slow_when_asked() -> None:
    from treadle.gpu_worker.sampling.hf.scheduler import SampleScheduler
    from treadle.gpu_worker.sessions.hosting import SessionHost

    client = redis.Redis.from_url(os.environ["TREADLE_BROKER_URL"])
    for cls, method, point in [
        (SampleScheduler, "_admit", "prefill"),
        (SampleScheduler, "_step", "step"),
        (SampleScheduler, "_answer_logprobs", "logprobs"),
        (SessionHost, "_load_new", "create"),  # the session is registered and leased: a kill leaves it half made
    ]:
        original = getattr(cls, method)

        @functools.wraps(original)
        def slow(self, *args, _original=original, _point=point):
            if seconds := client.get(f"tests:slow:{_point}"):
                time.sleep(float(seconds))
            return _original(self, *args)

        setattr(cls, method, slow)
    die_when_poisoned(client)


def die_when_poisoned(client: redis.Redis) -> None:
    """A sample or forward_backward holding the token `tests:poison` names kills this process (SIGKILL)."""
    from treadle.gpu_worker.executor.sample_requests import Sampling

    def poisoned(tokens: list[int]) -> bool:
        token = client.get("tests:poison")
        return token is not None and int(token) in tokens

    sample = Sampling.sample

    @functools.wraps(sample)
    def sample_or_die(self, req):
        prompt = req.prompt if isinstance(req.prompt, list) else req.prompt.to_ints()
        if poisoned(prompt):
            os.kill(os.getpid(), signal.SIGKILL)
        return sample(self, req)

    Sampling.sample = sample_or_die
    forward_backward = op_handlers.HANDLERS[ForwardBackwardRequest]

    def forward_backward_or_die(request, ctx):
        if poisoned([t for d in request.data for t in d.model_input.to_ints()]):
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_backward(request, ctx)

    op_handlers.HANDLERS[ForwardBackwardRequest] = forward_backward_or_die


def fail_when_asked() -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer  # every decoder layer's class derives from it

    client = redis.Redis.from_url(os.environ["TREADLE_BROKER_URL"])
    call = GradientCheckpointingLayer.__call__

    def failing(self, *args, **kwargs):
        if client.exists("tests:fail:layer"):
            raise RuntimeError("tests: this decoder layer was asked to fail")
        return call(self, *args, **kwargs)

    GradientCheckpointingLayer.__call__ = failing

    from treadle.gpu_worker.model.full_weights import FullWeights

    write = FullWeights.write

    def failing_write(self, *args, **kwargs):
        if client.exists("tests:fail:write"):
            raise OSError(errno.ENOSPC, "No space left on device (tests: asked to fail)")
        return write(self, *args, **kwargs)

    FullWeights.write = failing_write


if __name__ == "__main__":
    if sys.argv[1] == "--fail-when-asked":
        fail_when_asked()
        main(["worker", *sys.argv[2:]])
    elif sys.argv[1] == "--when-asked":
        slow_when_asked()
        main(["worker", *sys.argv[2:]])
    else:
        slow_down(sys.argv[1], float(sys.argv[2]))
        main(["worker", *sys.argv[3:]])

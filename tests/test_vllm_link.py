"""The vLLM sampler's engine process dies: it is started again and its unanswered requests are re-run
(treadle.gpu_worker.sampling.vllm.link). The child here is `tests/vllm_stand_in.py`, which speaks the engine's
protocol without vLLM, so the restart is checked where vLLM is not installed; `tests/test_sampler_contract.py`
runs the real engine where it is."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from treadle.errors import ServerError
from treadle.gpu_worker.sampling.vllm.link import MAX_TRIES, EngineLink, EngineProcess

STAND_IN = str(Path(__file__).with_name("vllm_stand_in.py"))


@pytest.fixture()
def link():
    started: list[int] = []

    def start() -> EngineProcess:
        process = EngineProcess([sys.executable, STAND_IN], dict(os.environ), "stand-in engine")
        started.append(process.proc.pid)
        return process

    retired: list[str | None] = []
    link = EngineLink(start, "tiny", lambda adapter, callback: (retired.append(adapter), callback()))
    link.started, link.retired = started, retired  # type: ignore[attr-defined]
    yield link
    link.close(10)


def sample(link: EngineLink, prompt: list[int], adapter: str | None = None, **params):
    message = {"op": "sample", "prompt": prompt, "params": params, "lora": None}
    return link.submit(message, lambda answer: answer["sequences"][0]["tokens"], adapter)


def test_a_killed_engine_is_restarted_and_its_requests_run_again(link):
    futures = [sample(link, [1, 2, i], adapter="snap", delay_s=2.0) for i in range(3)]
    retired_after: list[str] = []
    link.when_unused("snap", lambda: retired_after.append("snap"))  # waits for the requests in flight
    first = link.process_id
    os.kill(first, signal.SIGKILL)
    assert [f.result(timeout=60) for f in futures] == [[i, 2, 1] for i in range(3)]
    assert link.restarts == 1 and link.process_id not in (None, first)
    assert retired_after == ["snap"] and link.retired == ["snap"]
    assert sample(link, [7, 8]).result(timeout=60) == [8, 7]  # the new engine takes requests


def test_a_request_that_kills_the_engine_each_time_fails_and_the_engine_goes_on(link):
    deadly = sample(link, [6], crash=True)
    with pytest.raises(ServerError, match=f"exited {MAX_TRIES} times while this request ran"):
        deadly.result(timeout=120)
    assert sample(link, [4, 5]).result(timeout=60) == [5, 4]
    assert len(link.started) == MAX_TRIES + 1  # the first engine and one restart per death

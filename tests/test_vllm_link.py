"""The vLLM sampler's engine process dies: it is started again and its unanswered requests are re-run
(treadle.gpu_worker.sampling.vllm.link); streamed requests stream their tokens once and are cancelled. The child here is `tests/vllm_stand_in.py`, which speaks the engine's
protocol without vLLM, so the restart is checked where vLLM is not installed; `tests/test_sampler_contract.py`
runs the real engine where it is."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from treadle.errors import SampleCancelledError, ServerError
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


class Stream:
    """A streamed request's `TokenStream`, its client cancelling once it has `cancel_after` tokens."""

    def __init__(self, cancel_after: int | None = None):
        self.cancel_after = cancel_after
        self.drawn: list[tuple[int, int, float]] = []
        self.ended: tuple[list[int], int] | None = None
        self.first = threading.Event()

    def drew(self, row, token, logprob, top):
        assert top is None
        self.drawn.append((row, token, logprob))
        self.first.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.drawn) >= self.cancel_after

    def dropped(self, tokens, rows_left):
        self.ended = (tokens, rows_left)

    def rows(self, n: int) -> list[list[tuple[int, float]]]:
        return [[(t, lp) for row, t, lp in self.drawn if row == k] for k in range(n)]


def streamed(link: EngineLink, prompt: list[int], stream: Stream, **params):
    message = {"op": "sample", "prompt": prompt, "params": params, "lora": None}
    return link.submit(message, lambda answer: answer["sequences"], None, stream)


def test_a_stream_carries_its_answer_and_a_cancel_answers_it_with_what_was_drawn(link):
    whole, cancelled, waiting = Stream(), Stream(cancel_after=4), Stream(cancel_after=0)
    # Streamed whole beside one that is cancelled after 2 steps of its 2 rows, and one cancelled before it starts.
    futures = [
        streamed(link, [5, 6, 7], whole, n=2),
        streamed(link, list(range(100, 140)), cancelled, n=2, step_s=0.05),
        streamed(link, [1, 2], waiting, delay_s=30),
    ]
    sequences = futures[0].result(timeout=60)
    assert whole.rows(2) == [list(zip(s["tokens"], s["logprobs"])) for s in sequences]  # every token, once
    assert [row for row, _, _ in whole.drawn] == [0, 1] * 3 and whole.ended is None
    with pytest.raises(SampleCancelledError, match="cancelled it after") as after:
        futures[1].result(timeout=60)
    assert cancelled.ended is not None
    tokens, _ = cancelled.ended
    assert len(tokens) == 2 and tokens[0] == tokens[1] >= 2  # what each row had drawn when it was dropped ...
    assert len(cancelled.drawn) == sum(tokens) == after.value.sampled_tokens  # ... is what went out, and is billed
    assert tokens[0] < 40  # it was dropped, not run to its end
    with pytest.raises(SampleCancelledError, match="before it started") as before:
        futures[2].result(timeout=60)
    assert before.value.sampled_tokens is None and waiting.ended is not None and waiting.ended[0] == [0]
    assert waiting.drawn == []
    assert sample(link, [7, 8]).result(timeout=60) == [8, 7]  # the engine goes on


def test_a_restarted_engine_reruns_a_stream_that_streamed_nothing_and_fails_one_that_did(link):
    begun, unbegun = Stream(), Stream()
    started = streamed(link, list(range(50)), begun, step_s=0.2)
    not_started = streamed(link, [3, 4, 5], unbegun, delay_s=3)
    assert begun.first.wait(60)
    os.kill(link.process_id, signal.SIGKILL)
    with pytest.raises(ServerError, match="after this request streamed its first tokens, and a stream does not resume"):
        started.result(timeout=60)
    assert [s["tokens"] for s in not_started.result(timeout=60)] == [[5, 4, 3]]
    assert [t for _, t, _ in unbegun.drawn] == [5, 4, 3]  # streamed once, by the engine that ran it
    assert link.restarts == 1

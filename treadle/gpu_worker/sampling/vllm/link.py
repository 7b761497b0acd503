"""The worker's end of the vLLM engine process (`VllmSampler`): requests out, answers in, a restart when it dies.

`EngineProcess` is one child speaking JSON lines over a socketpair (the protocol is `server`'s): started with the
socket's descriptor as its last argument, it writes `{"ready": true}` once it can take requests. `EngineLink`
numbers the messages, resolves each request's future from its answer, and keeps what an adapter's retirement
waits for (no request in flight uses it).

A child that dies while it runs requests (killed, out of memory, a crash inside vLLM) is started again, and
every request it had not answered is sent to the new one: each answer comes whole from the one process that
ran it, and a seeded request draws what it would have drawn. The new engine has no adapter loaded; each
request names its own, which vLLM loads on first use, so nothing else is re-sent. A request in flight through
`MAX_TRIES` deaths fails instead, naming them (it may be what kills the engine); so do all of them if the
engine cannot be started again.

A streamed request (one submitted with a `TokenStream`) hands each partial message's tokens to its stream as they
arrive, and its answer resolves its future as any other's. `_watch` reads the open streams' `cancelled` every
`POLL_S`; a cancelled one is sent an abort, and its future fails with `SampleCancelledError` carrying the tokens its
rows drew (what its owner is billed) once the engine says it dropped it (`TokenStream.dropped`). A streamed request
is re-sent to a restarted engine only while it has streamed nothing: one whose tokens went out fails instead, as
a worker refuses to re-run a sample whose stream has tokens (treadle.gpu_worker.executor.control_ops), since a
re-run would stream them a second time.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, cast

from treadle.errors import SampleCancelledError, ServerError

if TYPE_CHECKING:
    from treadle.gpu_worker.sampling.backend import TokenStream

log = logging.getLogger("treadle.sampler.vllm")

STARTUP_TIMEOUT_S = 900.0
# Deaths of the engine process a request may be in flight through before it fails.
MAX_TRIES = 3
# How often the streamed requests in flight are checked for their client's cancel.
POLL_S = 0.1


class EngineProcess:
    """One engine child: `argv` plus the descriptor of its end of the socketpair; ready once it says so."""

    def __init__(self, argv: list[str], env: dict[str, str], what: str):
        self._conn, child = socket.socketpair()
        self.proc = subprocess.Popen([*argv, str(child.fileno())], pass_fds=[child.fileno()], env=env)
        child.close()
        self.lines = self._conn.makefile("rb")
        self._conn.settimeout(STARTUP_TIMEOUT_S)
        first = json.loads(self.lines.readline() or b'{"fatal": "the process exited while starting"}')
        if "fatal" in first:
            self.proc.wait(30)
            raise ServerError(f"{what} failed to start: {first['fatal']}")
        self._conn.settimeout(None)

    def send(self, message: dict) -> None:
        self._conn.sendall((json.dumps(message) + "\n").encode())

    def stop(self, timeout: float) -> None:
        """Close the socket (the child reads EOF and exits), and wait for it; killed if it does not exit."""
        self._conn.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _Pending:
    message: dict
    future: Future | None  # None: an acknowledgement nobody waits for (remove_lora)
    convert: Callable[[dict], object] | None = None
    adapter: str | None = None
    tries: int = 1
    stream: TokenStream | None = None
    drawn: list[int] | None = None  # a streamed request's tokens streamed so far, per row
    aborted: bool = False  # its client cancelled it and the engine was told


class EngineLink:
    """Requests to an engine process and their answers (see the module docstring). `start` starts a process;
    `retire(adapter, callback)` runs once no request in flight uses the adapter (`when_unused`)."""

    def __init__(
        self, start: Callable[[], EngineProcess], name: str, retire: Callable[[str, Callable[[], None]], None]
    ):
        self._start, self.name, self._retire = start, name, retire
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._in_flight: Counter = Counter()
        self._retiring: list[tuple[str | None, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._streaming = threading.Condition(self._lock)  # notified when a streamed request is submitted
        self._closed = False
        self.process: EngineProcess | None = start()
        self.restarts = 0
        threading.Thread(target=self._read, name=f"treadle-vllm-{name}", daemon=True).start()
        threading.Thread(target=self._watch, name=f"treadle-vllm-cancels-{name}", daemon=True).start()

    def submit(
        self,
        message: dict,
        convert: Callable[[dict], object],
        adapter: str | None,
        stream: TokenStream | None = None,
    ) -> Future:
        """Send a request (`message` without its id); the future resolves to `convert(answer)`. With a `stream`, its
        tokens go there as the engine draws them, and its client's cancel aborts it (see the module docstring)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise ServerError(f"sampler of {self.name} is shut down")
            self._in_flight[adapter] += 1
            pending = _Pending({**message, "id": next(self._ids)}, future, convert, adapter)
            if stream is not None:
                pending.message["stream"] = True
                pending.stream, pending.drawn = stream, [0] * message["params"].get("n", 1)
                self._streaming.notify()
            self._send(pending)
        return future

    def notify(self, message: dict) -> None:
        """Send a message whose acknowledgement nobody waits for; nothing once the link is closed."""
        with self._lock:
            if not self._closed:
                self._send(_Pending({**message, "id": next(self._ids)}, None))

    @property
    def process_id(self) -> int | None:
        """The engine process's pid (None while it is being started again)."""
        process = self.process
        return None if process is None else process.proc.pid

    def when_unused(self, adapter: str | None, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._in_flight[adapter]:
                self._retiring.append((adapter, callback))
                return
        self._retire(adapter, callback)

    def close(self, timeout: float) -> None:
        """Stop the engine process; requests not answered yet fail with a ServerError."""
        with self._lock:
            self._closed = True
            self._streaming.notify()
            process = self.process
        if process is not None:
            process.stop(timeout)

    # ------------------------------------------------------------ internals
    def _send(self, pending: _Pending) -> None:
        """Record and send (the caller holds the lock). A process that died meanwhile gets nothing: its
        successor is sent every pending request."""
        self._pending[pending.message["id"]] = pending
        if self.process is not None:
            try:
                self.process.send(pending.message)
            except OSError:
                pass

    def _read(self) -> None:
        while (process := self.process) is not None:
            try:
                for line in process.lines:
                    self._answered(json.loads(line))
            except OSError:  # a killed child can reset the connection rather than close it
                pass
            code = process.proc.wait()
            with self._lock:
                self.process = None
                closed = self._closed
            if closed:
                self._fail_all(f"the vLLM engine process exited (code {code})")
                return
            self._restart(code)

    def _answered(self, answer: dict) -> None:
        if "rows" in answer:
            self._streamed(answer)
            return
        with self._lock:
            pending = self._pending.pop(answer["id"], None)
            if pending is None or pending.future is None:
                return  # an acknowledgement
            ready = self._settled(pending)
        if "cancelled" in answer:
            _cancelled(pending, answer["cancelled"], answer["rows_left"])
        elif "error" in answer:
            pending.future.set_exception(ServerError(f"vLLM sampler: {answer['error']}"))
        else:
            try:
                pending.future.set_result(pending.convert(answer) if pending.convert else answer)
            except Exception as exc:  # a malformed answer fails its request, not the reader
                pending.future.set_exception(ServerError(f"vLLM sampler: bad answer: {type(exc).__name__}: {exc}"))
        self._retire_all(ready)

    def _streamed(self, partial: dict) -> None:
        """A streamed request's new tokens, to its stream (on the reader's thread, which also restarts the engine,
        so `drawn` is what went out when it restarts)."""
        with self._lock:
            pending = self._pending.get(partial["id"])
        if pending is None or pending.stream is None or pending.drawn is None:
            return
        tops = [[(t, lp) for t, lp in step] for step in partial["top"]] if "top" in partial else None
        for i, (row, token, logprob) in enumerate(zip(partial["rows"], partial["tokens"], partial["logprobs"])):
            pending.drawn[row] += 1
            pending.stream.drew(row, token, logprob, None if tops is None else tops[i])

    def _watch(self) -> None:
        """Send an abort for each streamed request in flight whose client cancelled it, every `POLL_S`."""
        while True:
            with self._lock:
                self._streaming.wait_for(
                    lambda: self._closed or any(p.stream is not None for p in self._pending.values())
                )
                if self._closed:
                    return
                gone = [
                    p for p in self._pending.values() if p.stream is not None and not p.aborted and p.stream.cancelled
                ]
                for pending in gone:
                    pending.aborted = True
                    self._send(_Pending({"op": "abort", "request": pending.message["id"], "id": next(self._ids)}, None))
            time.sleep(POLL_S)

    def _settled(self, pending: _Pending) -> list[tuple[str | None, Callable[[], None]]]:
        """A request is out of flight (the caller holds the lock): the retirements that now may run."""
        self._in_flight[pending.adapter] -= 1
        ready = [(a, c) for a, c in self._retiring if not self._in_flight[a]]
        self._retiring = [(a, c) for a, c in self._retiring if self._in_flight[a]]
        return ready

    def _restart(self, code: int) -> None:
        """Start the engine again and send it every request the dead one had not answered (see the module)."""
        with self._lock:
            for mid in [mid for mid, p in self._pending.items() if p.future is None]:
                del self._pending[mid]  # the new engine loaded no adapter to remove, and aborts nothing it never ran
            aborted, ready = self._pop([mid for mid, p in self._pending.items() if p.aborted])
            streamed = [mid for mid, p in self._pending.items() if p.drawn and any(p.drawn)]
            worn = [mid for mid, p in self._pending.items() if p.tries >= MAX_TRIES]
        for pending in aborted:  # its client is gone: it is answered as cancelled with what it streamed
            _cancelled(pending, pending.drawn or [], 0)
        self._retire_all(ready)
        self._fail(
            streamed,
            f"the vLLM engine process exited (code {code}) after this request streamed its first tokens, and a "
            "stream does not resume: send the request again",
        )
        self._fail(worn, f"the vLLM engine process exited {MAX_TRIES} times while this request ran (last code {code})")
        log.warning("the vLLM engine process of %s exited (code %d); starting it again", self.name, code)
        try:
            process = self._start()
        except Exception as exc:  # nothing can run the requests: say so to each
            with self._lock:
                self._closed = True
                self._streaming.notify()
            self._fail(
                list(self._pending), f"the vLLM engine process exited (code {code}) and did not start again: {exc}"
            )
            return
        with self._lock:
            self.process, self.restarts = process, self.restarts + 1
            for pending in self._pending.values():
                pending.tries += 1
            try:
                for pending in self._pending.values():
                    process.send(pending.message)
            except OSError:  # it died already: the reader starts it again
                pass
        log.info("the vLLM engine of %s is back (pid %d); requests sent again", self.name, process.proc.pid)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            ids = list(self._pending)
        self._fail(ids, reason)

    def _fail(self, ids: list[int], reason: str) -> None:
        with self._lock:
            failed, ready = self._pop(ids)
        for pending in failed:
            cast(Future, pending.future).set_exception(ServerError(f"sampler of {self.name}: {reason}"))
        self._retire_all(ready)

    def _pop(self, ids: list[int]) -> tuple[list[_Pending], list[tuple[str | None, Callable[[], None]]]]:
        """Take these requests out of flight (the caller holds the lock): those with a future, and the retirements
        that now may run."""
        taken, ready = [], []
        for mid in ids:
            pending = self._pending.pop(mid, None)
            if pending is not None and pending.future is not None:
                taken.append(pending)
                ready += self._settled(pending)
        return taken, ready

    def _retire_all(self, ready: list[tuple[str | None, Callable[[], None]]]) -> None:
        for adapter, callback in ready:
            self._retire(adapter, callback)


def _cancelled(pending: _Pending, drawn: list[int], rows_left: int) -> None:
    """Answer a streamed request its client cancelled, as the hf sampler does (`SampleScheduler._drop_cancelled`):
    the stream's end record, and SampleCancelledError with the tokens drawn (None: it never started, and costs
    nothing)."""
    cast("TokenStream", pending.stream).dropped(drawn, rows_left)
    if any(drawn):
        error = SampleCancelledError(
            f"sample: its client cancelled it after {max(drawn)} tokens", sampled_tokens=sum(drawn)
        )
    else:
        error = SampleCancelledError("sample: its client cancelled it before it started")
    cast(Future, pending.future).set_exception(error)

"""Control ops on the worker (create_session, sample, compute_logprobs): claimed, run, answered once.

A control op's message is a doorbell naming a request held in Redis (treadle.queue.control_requests). The worker
claims the request before it runs it, and holds the claim (a lease the heartbeat renews, `renew`) until the
answer is stored; a doorbell for a request claimed elsewhere or answered runs nothing. The caretaker (`recover`)
runs again every request of a served model whose claimer died: sampling from its prompt and seed (the CPU
sampler's rows do not depend on their batch, so a re-run gives the same tokens and logprobs), a session creation
by adopting what its first run made (`rerun` handlers) or making it. A streamed sample is re-run only if it had
streamed nothing yet; one whose stream has tokens fails with an error that says so (`_not_rerun`). A request
whose earlier claimers died running it `max_crashes` times is answered with CrashingRequestError instead (it
would most likely kill this worker too), and logged.

A handler may answer with a future (sampling does): its result is stored when it resolves, and the task returns
at once, so the pool thread is free for the next message meanwhile. The future resolves on the thread that
computed it, holding the device (the sampler's decode loop): the answer is encoded, metered and stored on the
`deliver` executor instead, so its Redis writes never keep the device, and the other rows' decode steps, waiting.

The answer is one MULTI/EXEC when results live in the broker's Redis (the default), as a session op's is
(treadle.gpu_worker.executor.op_record): the op's meter record, the release of a sample's rows from its owner's
bound, the result and the end of the held request, under a WATCH of the claim. A worker whose claim lapsed (it
was paused past the lease, or gave the request back at shutdown) has its answer dropped: the request is, or
will be, answered by the worker that claimed it next; and, being alive, it says so, so that its lapse counts as
no death (`ControlRequests.alive`, also when the heartbeat finds the claim lost). An answer already stored stays
(`first_only`), and the meter counts a request once (it is keyed by the future id), so fair turns, row bounds and
metering count a re-run request once.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, Future
from typing import Callable

from pydantic import BaseModel
from redis.exceptions import WatchError

from treadle.errors import CrashingRequestError, ServerError, TreadleError
from treadle.gpu_worker.executor.usage import UsageRecorder
from treadle.metering import SDK_OWNER
from treadle.queue import names, sample_stream
from treadle.queue.control_requests import ClaimedRequest, ControlRequests
from treadle.queue.ops import OpRequest, SampleRequest, encode_result
from treadle.queue.results import ResultStore
from treadle.queue.sessions import SessionRegistry

log = logging.getLogger("treadle.worker")
# Tries to store an answer whose WATCHed claim a heartbeat renewed meanwhile (a renewal every few seconds).
_ANSWER_TRIES = 3

# A request's handler: it takes the request of its own class.
Handler = Callable[..., BaseModel | Future]


class ControlOps:
    """This worker's control ops: a doorbell's request (`run`), re-runs (`recover`), the claims it holds."""

    def __init__(
        self,
        requests: ControlRequests,
        handlers: dict[type[OpRequest], Handler],
        *,
        models: list[str],
        registry: SessionRegistry,
        usage: UsageRecorder,
        results: ResultStore,
        deliver: Executor,
        one_write: bool,
        rerun: dict[type[OpRequest], Handler] | None = None,
        max_crashes: int = 2,
    ):
        """`one_write`: results live in the broker's Redis (`ResultStore.in_redis`), so an answer is one transaction.
        `rerun`: the handler of a request an earlier claim ran (in part), where it differs from the first run's.
        `max_crashes`: the worker's `max_request_crashes`."""
        self.requests, self.handlers, self.rerun = requests, handlers, rerun or {}
        self.max_crashes = max_crashes
        self.models, self.registry, self.usage, self.results = models, registry, usage, results
        self.deliver, self.one_write = deliver, one_write
        self._held: dict[str, int] = {}  # future id -> epoch of this worker's claim
        self._lock = threading.Lock()

    # ------------------------------------------------------------ entry points
    def recover(self) -> None:
        """Run every request of a served model that nobody runs (its claimer died), oldest first."""
        for model in self.models:
            for future_id in self.requests.orphans(model):
                if self.run(future_id):
                    log.info("took over control request %s, whose worker stopped", future_id)

    def renew(self) -> None:
        """Renew this worker's claims (the heartbeat's, with the session leases)."""
        with self._lock:
            held = dict(self._held)
        for future_id in self.requests.claims.renew_all(held):
            log.warning("lost the claim on control request %s; its answer will be dropped", future_id)
            self.requests.alive(future_id, held[future_id])  # paused past the lease, not dead: no crash to count
            with self._lock:
                self._held.pop(future_id, None)

    def release_all(self) -> None:
        """Give back every claim (a warm shutdown): other workers run those requests at once, and the answers this
        worker still gives them are dropped."""
        with self._lock:
            held, self._held = dict(self._held), {}
        for future_id, epoch in held.items():
            self.requests.release(future_id, epoch)

    # ------------------------------------------------------------ a request
    def run(self, future_id: str) -> bool:
        """Claim the request and run it; False when it is answered, expired or claimed elsewhere."""
        claim = self.requests.claim(future_id, self.max_crashes)
        if claim is None:
            return False
        with self._lock:
            self._held[future_id] = claim.epoch
        started = time.monotonic()
        try:
            request = claim.request()
        except TreadleError as exc:
            self.answer(claim, None, None, None, exc, 0.0)
            return True
        if claim.rerun and (error := self._not_rerun(claim, request)) is not None:
            self.answer(claim, request, None, None, error, 0.0)
            return True
        handler = self.handlers[type(request)]
        if claim.rerun:
            handler = self.rerun.get(type(request), handler)
        answer: Future = Future()
        try:
            outcome = handler(request)
        except Exception as exc:
            answer.set_exception(exc)
        else:
            if isinstance(outcome, Future):
                answer = outcome
            else:
                answer.set_result(outcome)
        if answer.done():  # answered in this thread (create_session, a refused request): stored here, in order
            self._finish(claim, request, started, answer.result)
        else:
            answer.add_done_callback(
                lambda done: self.deliver.submit(self._finish, claim, request, started, done.result)
            )
        return True

    def _not_rerun(self, claim: ClaimedRequest, request: OpRequest) -> TreadleError | None:
        """Why a request an earlier claim ran may not run again: its claimers died running it `max_crashes` times (it
        would most likely kill this worker too), or it is a streamed sample whose stream has tokens (a re-run would
        stream them a second time; a stream does not resume on another worker)."""
        if claim.crashes >= self.max_crashes:
            log.error(
                "not running %s request %s: %d workers died running it (--max_request_crashes %d); answered with "
                "CrashingRequestError",
                request.op,
                claim.future_id,
                claim.crashes,
                self.max_crashes,
            )
            return CrashingRequestError.after(request.op, claim.future_id, claim.crashes, self.max_crashes)
        stream_id = request.stream_id if isinstance(request, SampleRequest) else None
        if stream_id is None or not sample_stream.started(self.requests.redis, stream_id):
            return None
        return ServerError(
            f"sample request {claim.future_id}: the worker streaming it stopped after its first tokens, and a stream "
            "does not resume on another worker: send the request again"
        )

    def _finish(self, claim: ClaimedRequest, request: OpRequest, started: float, result: Callable[[], BaseModel]):
        response, payload, error = None, None, None
        try:
            response = result()
            payload = encode_result(request.op, response)
        except TreadleError as exc:
            error = exc
        except Exception as exc:  # a bug or a broken model must still answer the client
            log.exception("%s failed", request.op)
            error = ServerError(f"{request.op} failed: {type(exc).__name__}: {exc}")
        self.answer(claim, request, response, payload, error, time.monotonic() - started)

    def answer(
        self,
        claim: ClaimedRequest,
        request: OpRequest | None,
        response: BaseModel | None,
        payload: dict | None,
        error: TreadleError | None,
        seconds: float,
    ) -> bool:
        """Meter the op and store its answer (see the module's docstring): `error` if it failed, else `payload`;
        `request` is None when it did not parse. False, and nothing written, once the claim is not ours."""
        with self._lock:
            self._held.pop(claim.future_id, None)
        metered = None
        if request is not None:
            outcome = "ok" if error is None else f"{error.category}_error"
            metered = self.usage.control_op_finished(
                self.registry, claim.future_id, request, response, seconds, outcome, error
            )
        claim_key = names.control_claim_key(claim.future_id)
        # A heartbeat that renewed the claim (PEXPIRE) between WATCH and EXEC aborts the transaction though the claim
        # is still ours: try again, and let `is_ours` say when it is not.
        for _ in range(_ANSWER_TRIES):
            with self.requests.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(claim_key)
                    if not self.requests.claims.is_ours(pipe.get(claim_key), claim.epoch):
                        log.warning("dropped the answer to %s: this worker's claim on it lapsed", claim.future_id)
                        self.requests.alive(claim.future_id, claim.epoch)  # it ran the request and lived
                        return False
                    pipe.multi()
                    if metered is not None:  # a billed op: metered before its answer shows
                        self.usage.record(metered, client=pipe)
                    if isinstance(request, SampleRequest):
                        pipe.hdel(names.owner_sample_rows_key(request.owner or SDK_OWNER), claim.future_id)
                        pipe.expire(names.submitted_key(claim.future_id), self.results.backend.expires)
                    if self.one_write:
                        self.results.queue_store(pipe, claim.future_id, payload, error, first_only=True)
                    self.requests.queue_done(pipe, claim.future_id, claim.base_model)
                    pipe.execute()
                    break
                except WatchError:
                    continue
        else:
            log.warning("dropped the answer to %s: its claim changed while it was stored", claim.future_id)
            self.requests.alive(claim.future_id, claim.epoch)
            return False
        if not self.one_write:
            self.results.store(claim.future_id, payload, error)
        return True

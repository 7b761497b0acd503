"""The client half of the queue contract: publish ops, create sessions, read results.

Both the treadle SDK and the HTTP gateway talk to workers only through this class, so there is one
execution path. It imports neither torch nor the worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, cast

import redis as redis_lib
from redis.client import Pipeline

from treadle.errors import (
    BrokerUnavailableError,
    CapacityError,
    FutureTimeoutError,
    InvalidRequestError,
    NoWorkerError,
    NotFoundError,
    SessionNotFoundError,
    UnknownModelError,
)
from treadle.metering import SDK_OWNER
from treadle.queue import names
from treadle.queue.celery_app import RESULT_EXPIRES_S, make_app
from treadle.queue.connections import connect_redis, ring
from treadle.queue.control_requests import CONTROL_REQUEST_TTL_S, ControlRequest, ControlRequests
from treadle.queue.journal import Journal
from treadle.queue.outages import REDIS_ERRORS, REDIS_OUTAGE_TOLERANCE_S, through_outages
from treadle.queue.ops import CreateSessionRequest, OpRequest, SampleRequest, task_name
from treadle.queue.results import ResultStore
from treadle.queue.run_progress import RunProgress
from treadle.queue.sessions import SessionRecord, SessionRegistry, inactive_error
from treadle.queue.wait_bounds import (
    CHECK_EVERY_S,
    CHECK_FIRST_S,
    PendingRequest,
    WaitBounds,
    pending_sample,
    sample_marker,
)
from treadle.queue.workers import ServedModel, WorkerRegistry
from treadle.settings import WaitSettings


# KEYS: the owner's queued sample rows (hash future id -> "rows deadline"), the workers' limits. ARGV: the future
# id, its rows, now, the entry's lifetime, the hash's lifetime. Entries past their deadline (a request lost with its
# worker, or with its client before it was held) no longer count. Answers {-1, the limit} when admitted (the entry
# is added; {-1, 0}: no limit, no entry), else {rows queued, the limit}.
_ADMIT_ROWS = """
local limit = tonumber(redis.call('HGET', KEYS[2], 'max_queued_sample_rows_per_owner') or '0') or 0
if limit <= 0 then return {-1, 0} end
local queued, now = 0, tonumber(ARGV[3])
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local rows, deadline = string.match(entries[i + 1], '(%d+) ([%d.]+)')
  if tonumber(deadline) < now then redis.call('HDEL', KEYS[1], entries[i]) else queued = queued + tonumber(rows) end
end
if queued > 0 and queued + tonumber(ARGV[2]) > limit then return {queued, limit} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. (now + tonumber(ARGV[4])))
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {-1, limit}
"""
# How long a sample request counts against its owner's queued rows if no worker answers it.
SAMPLE_ROWS_TTL_S = 600
# How long its rows count from admission until the request is held: a client that dies in between (a loop killed
# as it submits) leaves no request to answer, and its rows held the owner's later samples for SAMPLE_ROWS_TTL_S.
# The hold's transaction gives the entry its full lifetime.
ADMITTED_UNHELD_S = 30
# A sample's rows free within a few decode steps of each other; a retry a second later usually fits.
SAMPLE_RETRY_AFTER_S = 1.0


class OpsClient:
    def __init__(
        self,
        broker_url: str,
        result_url: str | None = None,
        storage_url: str | None = None,
        wait_settings: WaitSettings | None = None,
    ):
        self.broker_url = broker_url
        self.result_url = result_url or broker_url
        self.storage_url = storage_url
        self.redis = connect_redis(broker_url)
        self.app = make_app(broker_url, self.result_url)
        self.results = ResultStore(self.app)
        self.sessions = SessionRegistry(self.redis)
        self.workers = WorkerRegistry(self.redis)
        self.bounds = WaitBounds(self.workers, wait_settings)
        self.progress = RunProgress(self.redis)
        self.journal = Journal(self.redis)
        self.control = ControlRequests(self.redis)
        self._admit_rows = self.redis.register_script(_ADMIT_ROWS)
        self._publish_lock = threading.Lock()

    # ------------------------------------------------------------ models and sessions
    def served_models(self) -> list[ServedModel]:
        return self.workers.served_models()

    def require_model(self, base_model: str) -> ServedModel:
        served = self.served_models()
        for m in served:
            if m.name == base_model:
                return m
        if not served:
            raise NoWorkerError(
                f"base_model: no worker is running, so nothing serves {base_model!r}; start one with "
                f"`treadle worker --model {base_model}` (or `treadle up`)"
            )
        raise UnknownModelError(
            f"base_model: {base_model!r} is not served; served models: {', '.join(m.name for m in served)}"
        )

    def create_session(self, request: CreateSessionRequest, *, timeout: float = 300) -> SessionRecord:
        """Ask a worker serving the model to create the session; returns its record once it exists."""
        self.require_model(request.base_model)
        fid = names.create_future_id(request.session_id)
        self._hold_and_ring(fid, request)
        self.wait(
            fid, timeout=timeout, what=f"creating a session on {request.base_model!r}", base_model=request.base_model
        )
        record = self.sessions.get(request.session_id)
        if record is None:
            raise SessionNotFoundError(f"session {request.session_id} vanished right after creation")
        return record

    @staticmethod
    def new_session_id() -> str:
        return uuid.uuid4().hex[:12]

    def session_info(self, session_id: str) -> SessionRecord | None:
        return self.sessions.get(session_id)

    # ------------------------------------------------------------ ops
    def submit(self, session_id: str, request: OpRequest, seq: int | None = None) -> str:
        """Publish one op of a session; returns its future id at once.

        The journal gets the op's only copy; the message is a doorbell naming (session_id, seq).
        """
        with self._publish_lock:
            # One token per submit: a retry after a lost reply gets the seq the first try took (see Journal).
            token, wanted = uuid.uuid4().hex, seq
            seq, needs_doorbell = self._retrying(
                lambda: self.journal.append(session_id, request, token=token, seq=wanted)
            )
            if seq < 0:  # nothing would run it: fail now, saying why (stopped, expired with its checkpoint, ...)
                raise inactive_error(session_id, self.sessions.get(session_id))
            # Journaled first, then the doorbell: a doorbell lost with a crashed worker cannot lose the op
            # (the session's next owner runs what the journal holds). A repeated doorbell is harmless
            # (the worker dedupes by seq). An op behind one not yet applied needs none (see Journal).
            fid = names.future_id(session_id, seq)
            if needs_doorbell:
                self._retrying(lambda: self.ring(session_id, seq, request.op))
        return fid

    def ring(self, session_id: str, seq: int, op: str) -> None:
        ring(self.app, session_id, seq, op)

    def _retrying(self, fn):
        """Run a Redis call, riding out an outage (restart, failover) as treadle.queue.outages does."""
        try:
            return through_outages(fn, what=f"publishing to {self.broker_url}")
        except REDIS_ERRORS as exc:
            raise BrokerUnavailableError(
                f"Redis at {self.broker_url} unreachable for over {REDIS_OUTAGE_TOLERANCE_S:.0f} s: {exc}"
            ) from None

    def _hold_and_ring(
        self,
        fid: str,
        request: ControlRequest,
        ttl_s: float = CONTROL_REQUEST_TTL_S,
        marks: dict | None = None,
        also: Callable[[Pipeline], None] | None = None,
    ) -> None:
        """Hold a control request in Redis until a worker answers it or `ttl_s` passes (treadle.queue.control_requests),
        with `marks` (key -> value, kept as long as a result lives) and what `also` queues, in one transaction; then
        ring its base model's control queue: the message names the request, which survives the worker that runs it."""

        def hold() -> None:
            with self.redis.pipeline(transaction=True) as pipe:
                self.control.queue_hold(pipe, fid, request, ttl_s)
                for key, value in (marks or {}).items():
                    pipe.set(key, value, ex=RESULT_EXPIRES_S)
                if also is not None:
                    also(pipe)
                pipe.execute()

        self._retrying(hold)
        self.app.send_task(
            task_name(request.op),
            queue=names.model_queue(request.base_model),
            task_id=fid,
            ignore_result=True,
        )

    def submit_sample(self, request: SampleRequest) -> str:
        """Hold a sample request until it is answered and ring its base model's control queue (`_hold_and_ring`).
        CapacityError when its owner's queued sample rows would pass the workers' bound (nothing is queued)."""
        fid = names.sample_future_id(uuid.uuid4().hex)
        owner = request.owner or SDK_OWNER
        rows_key = names.owner_sample_rows_key(owner)
        queued, limit = self._retrying(
            lambda: self._admit_rows(
                keys=[rows_key, names.LIMITS_KEY],
                args=[fid, request.num_samples, repr(time.time()), ADMITTED_UNHELD_S, SAMPLE_ROWS_TTL_S],
            )
        )
        if queued >= 0:
            raise CapacityError(
                f"max_queued_sample_rows_per_owner: owner {owner!r} has {queued} sample rows queued and the limit is {limit}; "
                f"this request's {request.num_samples} were not queued: submit again in a second or two, as earlier ones are answered",
                retry_after_s=SAMPLE_RETRY_AFTER_S,
                bound="max_queued_sample_rows_per_owner",
            )
        # Marked submitted before it is published, so a wait tells a pending sample from an id never submitted, and knows
        # its model and lifetime (`treadle.queue.wait_bounds`); the mark is kept as long as its result would be. The
        # request is held as long as that lifetime: past it, no worker runs it.
        ttl_s = self.bounds.settings.sample_ttl_s
        marker = sample_marker(request.base_model, ttl_s)

        def counted_while_held(pipe: Pipeline) -> None:  # the admitted entry's full lifetime, with the hold
            pipe.hset(rows_key, fid, f"{request.num_samples} {time.time() + SAMPLE_ROWS_TTL_S!r}")
            pipe.expire(rows_key, SAMPLE_ROWS_TTL_S)

        marks = {names.submitted_key(fid): marker}
        self._hold_and_ring(fid, request, ttl_s, marks, counted_while_held if limit > 0 else None)
        return fid

    def tokenizer_files(self, base_model: str) -> dict[str, bytes]:
        """The tokenizer files a worker published for a served model (so clients need no hub access)."""
        raw = cast(dict[bytes, bytes], self.redis.hgetall(names.tokenizer_key(base_model)))  # a sync client
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}

    # ------------------------------------------------------------ results
    def check_future(self, future_id: str, base_model: str | None = None) -> None:
        """Raise if a pending future's request can no longer be answered. At once: an id of no known form, a seq
        below 1, no such session, a seq never submitted, a session that stopped, expired or was lost without running
        it, a sample id never submitted. Past a bound (`treadle.queue.wait_bounds`): a sample past its lifetime, a
        request whose model no live worker has served for the grace. `base_model`: the request's model where the
        caller knows it (a session creation); a sample's and a session op's are found here. A Redis outage passes
        (the result poll reports it). Only call it while the result is not stored."""
        try:
            request = self._pending(future_id, base_model)
            error = None if request is None else self.bounds.past(request, lambda: self._describe(future_id))
            if error is not None and not self.done(future_id):  # answered meanwhile: the poll will read it
                raise error
        except REDIS_ERRORS:
            return

    def _pending(self, future_id: str, base_model: str | None) -> PendingRequest | None:
        """The request behind a future not yet answered, for its bounds; None if it was answered meanwhile.
        Raises when it can never be answered."""
        if names.is_create_future(future_id):
            return PendingRequest(future_id, base_model)
        session_id, _, tail = future_id.rpartition(":")
        if names.is_sample_future(future_id):
            marker = self.redis.get(names.submitted_key(future_id))
            if marker is not None:
                return pending_sample(future_id, marker)
            if self.done(future_id):
                return None
            raise InvalidRequestError(
                f"future {future_id}: no sample was submitted under this id (or its result has expired)"
            )
        if not (tail.isascii() and tail.isdigit() and session_id):
            raise InvalidRequestError(
                f"future {future_id!r}: not a future id; ids are <session_id>:<seq>, sample:<id> or create:<session_id>"
            )
        if int(tail) < 1:
            raise InvalidRequestError(
                f"future {future_id}: seq {tail} was never submitted; a session's seqs start at 1"
            )
        record = self.sessions.get(session_id)
        if record is not None and record.applied >= int(tail):  # it ran: its result was stored before this mark
            if self.done(future_id):
                return None
            raise NotFoundError(
                f"future {future_id}: op {tail} of session {session_id} ran, but its result has expired: workers "
                "keep results for --result_ttl_s seconds (7 days unless set)"
            )
        if record is not None and record.status == "active" and int(tail) <= self.next_seq(session_id):
            return PendingRequest(future_id, base_model or record.base_model)
        if self.done(future_id):  # stored meanwhile
            return None
        if record is not None and record.status == "active":
            raise InvalidRequestError(
                f"future {future_id}: seq {tail} was never submitted to session {session_id} "
                f"(its last op is {self.next_seq(session_id)})"
            )
        raise inactive_error(session_id, record)

    def _describe(self, future_id: str) -> str:
        """A pending request as an error names it: its op, its session or its id."""
        if names.is_create_future(future_id):
            return f"create_session of session {future_id.partition(':')[2]} (future {future_id})"
        if names.is_sample_future(future_id):
            return f"sample request {future_id}"
        session_id, _, seq = future_id.rpartition(":")
        entry = self.journal.get(session_id, int(seq))
        return f"{entry.op if entry else 'op'} {seq} of session {session_id} (future {future_id})"

    def next_seq(self, session_id: str) -> int:
        return self.sessions.next_seq(session_id)

    def poll(self, future_id: str) -> dict | None:
        done, value = self.results.poll(future_id)
        return value if done else None

    def done(self, future_id: str) -> bool:
        return self.results.is_done(future_id)

    def wait(
        self, future_id: str, timeout: float | None = None, *, what: str | None = None, base_model: str | None = None
    ) -> dict:
        """Block until the op's result is stored; re-raises its error. Rides out Redis outages.

        The wait sleeps on the result's channel (see `ResultStore.watch`) and polls when woken, and at
        least every `WATCHED_POLL_S` in case a wake-up was lost (a reconnect); without a subscription
        it polls every ~1 ms while the op is young, then backs off to 20 ms."""
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.monotonic()
        # The first check comes soon: a future that can never resolve fails within a second.
        delay, outage_since, next_check = 0.0005, None, started + CHECK_FIRST_S
        published = None
        with self.results.watch(future_id) as watch:
            while True:
                try:
                    done, value = self.results.poll(future_id, published)
                    outage_since = None
                except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError) as exc:
                    outage_since = outage_since or time.monotonic()
                    if time.monotonic() - outage_since > REDIS_OUTAGE_TOLERANCE_S:
                        raise BrokerUnavailableError(
                            f"lost Redis at {self.result_url} for over {REDIS_OUTAGE_TOLERANCE_S:.0f} s while waiting for {future_id}: {exc}"
                        ) from None
                    done, value, delay = False, None, 0.5
                if done:
                    self.progress.answered()
                    return cast(dict, value)  # a stored op result is its response as a dict
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise FutureTimeoutError(f"{what or future_id}: no result within {timeout} s")
                if now >= next_check:
                    next_check = now + CHECK_EVERY_S
                    self.check_future(future_id, base_model)
                if watch.subscribed and outage_since is None:
                    pause = min(WATCHED_POLL_S, next_check - now)
                else:
                    pause = min(delay, 0.001 if now - started < 0.25 else 0.02)
                    delay *= 1.5
                published = watch.sleep(max(0.0, pause if deadline is None else min(pause, deadline - now)))


# How often a wait that sleeps on its result's channel polls anyway (a wake-up lost in a reconnect).
WATCHED_POLL_S = 0.25

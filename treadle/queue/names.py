"""Every Redis key and Celery queue name treadle uses, and the form of every future id and session id, in one
place: the futures of ops, session creations and samples (each also a Celery task id), the gateway's own
request ids, and the Tinker ids the gateway hands out (client sessions, models, whose ids are also their
treadle sessions' ids, and sampling sessions). The random part of an id is drawn by its caller."""

from __future__ import annotations

PREFIX = "treadle"


def session_queue(session_id: str) -> str:
    """The queue of one session's ordered ops; only the owning worker consumes it."""
    return f"{PREFIX}.s.{session_id}"


def model_queue(base_model: str) -> str:
    """The control queue of one base model: session creation and sampling, any worker serving it."""
    return f"{PREFIX}.m.{base_model}"


def future_id(session_id: str, seq: int) -> str:
    """The future of a session's op number `seq`."""
    return f"{session_id}:{seq}"


def split_future_id(fid: str) -> tuple[str, int]:
    session_id, _, seq = fid.rpartition(":")
    return session_id, int(seq)


_CREATE, _SAMPLE = "create:", "sample:"


def create_future_id(session_id: str) -> str:
    """The future of a session's creation."""
    return _CREATE + session_id


def sample_future_id(token: str) -> str:
    """The future of one sample request, named by a token its submitter draws."""
    return _SAMPLE + token


def is_create_future(fid: str) -> bool:
    return fid.startswith(_CREATE)


def is_sample_future(fid: str) -> bool:
    return fid.startswith(_SAMPLE)


# ---------------------------------------------------------------- the gateway's Tinker ids (treadle.gateway)

_TRAIN = ":train:"


def client_session_id(token: str) -> str:
    """A Tinker client session (`create_session`), named by a token the gateway draws."""
    return f"s-{token}"


def gateway_request_id(kind: str, subject: str) -> str:
    """A request the gateway settles itself (`treadle.gateway.local_futures`): `create_model:<model id>`,
    `load_weights:<model id>`, or `failed:<token>` for a request refused before anything ran."""
    return f"{kind}:{subject}"


def tinker_model_id(client_session: str, model_seq: int) -> str:
    """A training model's id, Tinker's `<client session>:train:<n>`: also the id of its treadle session."""
    return f"{client_session}{_TRAIN}{model_seq}"


def model_client_session(model_id: str) -> str:
    """The Tinker client session a model id (`tinker_model_id`) belongs to."""
    return model_id.rsplit(_TRAIN, 1)[0]


def tinker_sampler_id(client_session: str, seq: int) -> str:
    """A sampling session's id, Tinker's `<client session>:sample:<n>`."""
    return f"{client_session}:sample:{seq}"


# Control requests (treadle.queue.control_requests): held until answered, claimed by the worker that runs them.
CONTROL_PENDING_PREFIX = f"{PREFIX}:creqs:"


def control_request_key(future_id: str) -> str:
    """Hash: op, model, body (the request), at (submitted), epoch (claims so far), worker (the last claimer)."""
    return f"{PREFIX}:creq:{future_id}"


def control_claim_key(future_id: str) -> str:
    """A worker's claim on a control request it runs: a lease (treadle.queue.lease), `<worker>:<epoch>`."""
    return f"{PREFIX}:claim:{future_id}"


def control_pending_key(base_model: str) -> str:
    """Sorted set: the future ids of a base model's control requests not yet answered, by submission time."""
    return CONTROL_PENDING_PREFIX + base_model


def submitted_key(future_id: str) -> str:
    """Marks a sample's future id as submitted (see `OpsClient.check_future`)."""
    return f"{PREFIX}:submitted:{future_id}"


def sample_stream_key(stream_id: str) -> str:
    """Stream of a streamed sample's tokens as its rows draw them, and its cancel record (treadle.queue.sample_stream)."""
    return f"{PREFIX}:sstream:{stream_id}"


def sample_cancel_key(stream_id: str) -> str:
    """Set when a streamed sample's client goes away: its worker drops the sample's rows."""
    return f"{PREFIX}:scancel:{stream_id}"


def worker_key(hostname: str) -> str:
    return f"{PREFIX}:worker:{hostname}"


WORKER_PATTERN = f"{PREFIX}:worker:*"


def session_key(session_id: str) -> str:
    """Hash: base_model, run_id, lora, owner, epoch, applied, ..."""
    return f"{PREFIX}:session:{session_id}"


SESSION_PATTERN = f"{PREFIX}:session:*"


OWNER_PREFIX = f"{PREFIX}:owner:"
OWNER_SESSIONS_SUFFIX = ":sessions"  # the journal's append script builds an owner's key from these two


def owner_sessions_key(owner: str) -> str:
    """Set of an owner's sessions whose queued ops count against its bound (treadle.queue.journal); `sdk` for the SDK's."""
    return f"{OWNER_PREFIX}{owner}{OWNER_SESSIONS_SUFFIX}"


def owner_sample_rows_key(owner: str) -> str:
    """Hash sample future id -> rows and deadline of an owner's sample requests submitted and not yet answered."""
    return f"{OWNER_PREFIX}{owner}:sample_rows"


LIMITS_KEY = f"{PREFIX}:limits"  # hash: the bounds workers publish for clients to check at submit (sample rows)


def lease_key(session_id: str) -> str:
    return f"{PREFIX}:lease:{session_id}"


def journal_key(session_id: str) -> str:
    """Hash seq -> journal entry (op, time, request JSON) of every op not yet covered by a checkpoint."""
    return f"{PREFIX}:journal:{session_id}"


def submit_key(session_id: str, token: str) -> str:
    """The seq one submit was given, kept a few minutes, so a retried submit gets it again (see treadle.queue.journal)."""
    return f"{PREFIX}:submit:{session_id}:{token}"


def tokenizer_key(base_model: str) -> str:
    """Hash filename -> bytes of a served model's tokenizer files, published by its workers."""
    return f"{PREFIX}:tokenizer:{base_model}"


# A worker's hand-off (treadle.gpu_worker.scheduling.linger): set while its op thread waits for the next op of a session
# it owns; an op journaled meanwhile goes onto its wake list instead of ringing a Celery doorbell.
IDLE_PREFIX = f"{PREFIX}:idle:"
WAKE_PREFIX = f"{PREFIX}:wake:"


def idle_key(hostname: str) -> str:
    return IDLE_PREFIX + hostname


def wake_key(hostname: str) -> str:
    return WAKE_PREFIX + hostname


# ---------------------------------------------------------------- usage metering (treadle.metering)


def usage_ops_key(session_id: str) -> str:
    return f"{PREFIX}:usage:ops:{session_id}"


def usage_totals_key(kind: str, name: str) -> str:
    return f"{PREFIX}:usage:{kind}:{name}"


def usage_timeline_key(owner: str) -> str:
    return f"{PREFIX}:usage:timeline:{owner}"


USAGE_OWNERS_KEY = f"{PREFIX}:usage:owners"


def quota_sessions_key(owner: str) -> str:
    """The owner's active sessions (treadle.quotas)."""
    return f"{PREFIX}:quota:sessions:{owner}"


def quota_memory_key(owner: str) -> str:
    """The bytes each of the owner's admitted full fine-tuning sessions holds (treadle.quotas)."""
    return f"{PREFIX}:quota:memory:{owner}"


# ---------------------------------------------------------------- the gateway's own state (treadle.gateway.store)


def gateway_key(*parts: str) -> str:
    """`treadle:gw:<part>:<part>...`: gateway sessions, samplers, in-flight requests, downloads, copies."""
    return ":".join([f"{PREFIX}:gw", *parts])


# ---------------------------------------------------------------- batch runs (treadle.runs)

BATCH_RUNS_KEY = f"{PREFIX}:bruns"
OPEN_BATCH_RUNS_KEY = f"{PREFIX}:bruns:open"
RUNNER_PREFIX = f"{PREFIX}:brunner:"


def batch_run_key(name: str) -> str:
    return f"{PREFIX}:brun:{name}"


def batch_run_lease_key(name: str) -> str:
    return f"{PREFIX}:brun-lease:{name}"


def batch_run_progress_key(name: str) -> str:
    """When the run's loop last had an op answered (`treadle.queue.run_progress`)."""
    return f"{PREFIX}:brun-progress:{name}"

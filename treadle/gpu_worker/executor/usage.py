"""What each op consumed, counted once: metering (durable, per session and owner) and the worker's metrics.

Tokens count what the loop sent, never padding: `forward_backward` trains the input tokens of its
datums, `forward` prefills them, `sample` prefills its prompt once and samples what it returns (every
sequence's tokens). Other ops (optim_step, checkpoints) cost only compute seconds.

The sequencer meters an op after its handler, in the same transaction that stores its result and marks
its seq applied (before them when results live in another Redis). A worker killed in between leaves the
seq unapplied, so the op runs again on the adopting worker, whose record of the same `(session, seq)` the meter ignores: the op is counted once either way.
Ops a rebuild replays (seq at or below applied) were counted when they first ran and are not seen here.

Control ops are keyed by their future id, which a re-run after a crash keeps (treadle.queue.control_requests). A sample is billed to the session
whose snapshot it samples (a run's id is its session's id), a sample of the bare base model to
`base:<model>`; its owner is the caller the gateway names on the request, else the sampled session's
owner, else `sdk`. A streamed sample whose client cancelled it is billed for its prompt and the tokens its rows
drew before they left the batch (nothing if it left before its prefill). Batched sampling shares each decode step among
the requests in the batch, so a sample's compute_s is its time in the scheduler, not an exclusive share.
"""

from __future__ import annotations

import logging
from typing import cast

from pydantic import BaseModel

from treadle.errors import SampleCancelledError, TreadleError
from treadle.metering import SDK_OWNER, Meter, OpUsage
from treadle.observability import metrics
from treadle.queue.ops import CreateSessionRequest, ForwardRequest, OpRequest, SampleRequest
from treadle.queue.sessions import SessionRegistry
from treadle.storage.paths import CheckpointPath
from treadle.types import EncodedTextChunk, ModelInput, SampleResponse

log = logging.getLogger("treadle.worker")


def positions(model_input: ModelInput) -> int:
    """Tokens of an input as metered: an image chunk counts its expected_tokens (the worker refused any other
    count; one sent without it counts 0)."""
    return sum(len(c.tokens) if isinstance(c, EncodedTextChunk) else c.expected_tokens or 0 for c in model_input.chunks)


def cancelled_counts(request: SampleRequest, sampled_tokens: int) -> dict[str, int]:
    """A cancelled stream's tokens: its prompt, prefilled, and what its rows drew before they left the batch."""
    prompt = positions(request.prompt) if isinstance(request.prompt, ModelInput) else len(request.prompt)
    return {"prefill_tokens": prompt, "sampled_tokens": sampled_tokens}


def token_counts(request: OpRequest, response: BaseModel | None) -> dict[str, int]:
    if isinstance(request, ForwardRequest):  # and ForwardBackwardRequest, its subclass
        tokens = sum(positions(d.model_input) for d in request.data)
        return {"trained_tokens": tokens} if request.stateful else {"prefill_tokens": tokens}
    if isinstance(request, SampleRequest) and isinstance(response, SampleResponse):
        return cancelled_counts(request, sum(len(s.tokens) for s in response.sequences))
    return {}


class UsageRecorder:
    def __init__(self, redis):
        self.meter = Meter(redis)

    def observe(
        self,
        *,
        session_id: str,
        op_id: str,
        request: OpRequest,
        response: BaseModel | None,
        owner: str | None,
        base_model: str,
        seconds: float,
        outcome: str,
        memory_bytes: int = 0,
        billed_tokens: dict[str, int] | None = None,
    ) -> OpUsage | None:
        """The worker's metrics of one op; returns the usage to meter (None for a failed op, which is not billed,
        unless `billed_tokens` says what it consumed all the same: a cancelled stream's).
        `memory_bytes`: what the session's trained weights hold (`SessionRecord.memory_bytes`)."""
        billed = outcome == "ok" or billed_tokens is not None
        if billed_tokens is None:
            billed_tokens = token_counts(request, response) if outcome == "ok" else {}
        usage = OpUsage(
            session_id=session_id,
            op_id=op_id,
            op=request.op,
            owner=owner or SDK_OWNER,
            base_model=base_model,
            compute_s=seconds,
            memory_gib_s=memory_bytes / 2**30 * seconds,
            **billed_tokens,
        )
        metrics.observe_op(request.op, base_model, seconds, outcome, usage if billed else None)
        return usage if billed else None

    def record(self, usage: OpUsage, client=None) -> None:
        """Meter it durably, once per (session, op id); `client`: a pipeline to queue the record on."""
        if not self.meter.record(usage, client=client):
            log.info(
                "usage of %s op %s was recorded before (a replay or redelivery): not counted again",
                usage.session_id,
                usage.op_id,
            )

    def control_op_finished(
        self,
        sessions: SessionRegistry,
        future_id: str,
        request: OpRequest,
        response: BaseModel | None,
        seconds: float,
        outcome: str,
        error: TreadleError | None = None,
    ) -> OpUsage | None:
        """Observe an op of a base model's control queue (create_session, sample); returns the usage to meter (`record`)
        if it succeeded, or if it is a stream its client cancelled after its prefill (`error`), which is billed for the
        tokens it consumed. A sample's owner is read from its session's record only when the request names none; a
        create counts the memory its new session holds."""
        memory, billed_tokens = 0, None
        if isinstance(error, SampleCancelledError) and error.sampled_tokens is not None:
            outcome, billed_tokens = "cancelled", cancelled_counts(cast(SampleRequest, request), error.sampled_tokens)
        if isinstance(request, CreateSessionRequest):
            session_id, owner = request.session_id, request.owner
            if outcome == "ok" and (created := sessions.get(session_id)) is not None:
                memory = created.memory_bytes
        elif isinstance(request, SampleRequest) and request.model_path is not None:
            session_id, owner = CheckpointPath.parse(request.model_path).run_id, request.owner
            if owner is None and (record := sessions.get(session_id)) is not None:
                owner = record.owner
        else:
            session_id, owner = f"base:{request.base_model}", getattr(request, "owner", None)
        return self.observe(
            session_id=session_id,
            op_id=future_id,
            request=request,
            response=response,
            owner=owner,
            base_model=request.base_model,
            seconds=seconds,
            outcome=outcome,
            memory_bytes=memory,
            billed_tokens=billed_tokens,
        )

"""The op envelope: what one Celery message of a session carries.

Small payloads ride inline; above INLINE_LIMIT the payload is stored once as a Redis blob (with a TTL)
and the message carries its key, because every Celery message is base64'd by the Redis transport and
copied again into `unacked` while it runs.
"""

from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel, Field

from treadle.queue import names

INLINE_LIMIT = 64 * 1024
BLOB_TTL_S = 7 * 24 * 3600


class OpEnvelope(BaseModel):
    session_id: str = Field(description="The session the op belongs to.")
    seq: int = Field(ge=1, description="Position of the op in its session; ops run in seq order.")
    op: str = Field(description="forward | forward_backward | optim_step | save_state | ...")
    payload: dict | None = Field(default=None, description="The op's arguments, when small.")
    payload_ref: str | None = Field(default=None, description="Redis key of the payload blob, when large.")
    submitted_at: float = Field(default_factory=time.time)

    @property
    def future_id(self) -> str:
        return names.future_id(self.session_id, self.seq)


def pack(redis, session_id: str, seq: int, op: str, payload: dict) -> OpEnvelope:
    body = json.dumps(payload, separators=(",", ":"))
    if len(body) <= INLINE_LIMIT:
        return OpEnvelope(session_id=session_id, seq=seq, op=op, payload=payload)
    key = names.blob_key(f"{session_id}:{seq}:{uuid.uuid4().hex[:8]}")
    redis.set(key, body, ex=BLOB_TTL_S)
    return OpEnvelope(session_id=session_id, seq=seq, op=op, payload_ref=key)


def store_blob(redis, payload: dict) -> str:
    key = names.blob_key(uuid.uuid4().hex)
    redis.set(key, json.dumps(payload, separators=(",", ":")), ex=BLOB_TTL_S)
    return key


def load_payload(redis, envelope: OpEnvelope) -> dict:
    if envelope.payload is not None:
        return envelope.payload
    body = redis.get(envelope.payload_ref)
    if body is None:
        from treadle.errors import SessionLostError

        raise SessionLostError(f"payload of op {envelope.future_id} expired from Redis ({envelope.payload_ref})")
    return json.loads(body)

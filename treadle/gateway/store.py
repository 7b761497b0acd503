"""What the gateway itself remembers, kept in Redis so that any gateway replica can answer any call.

- Tinker client sessions (`create_session`): owner, tags, metadata, the models and samplers made in it.
- Sampling sessions: sampler id -> base model and (treadle) checkpoint path.
- Requests: request id -> what to turn the op's result into, who may read it, and a digest of the
  request for the `(model_id, seq_id)` retry rule (same digest: same future; different: 409).
- Gateway-side futures: operations the gateway runs itself (session creation, an op it refused),
  whose outcome is written here for `retrieve_future`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, Field

from treadle.queue import names


class ClientSession(BaseModel):
    session_id: str
    owner: str
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict | None = None
    display_name: str | None = Field(default=None, description="The client's name for the session (search matches it).")
    created_at: float = Field(default_factory=time.time)


class Sampler(BaseModel):
    sampler_id: str
    owner: str
    base_model: str
    model_path: str | None = Field(
        default=None, description="treadle:// sampler checkpoint; None samples the base model."
    )
    inflight_of: str | None = Field(
        default=None,
        description="kind='inflight': the training model whose newest inflight "
        "save this sampler samples, whatever model_path it was created with.",
    )


class RequestRecord(BaseModel):
    request_id: str
    kind: str = Field(description="How retrieve_future renders the result: forward_backward, optim_step, sample, ...")
    owner: str
    future_id: str | None = Field(default=None, description="Queue future id; None for a gateway-side future.")
    model_id: str | None = None
    digest: str | None = Field(default=None, description="Hash of the request body, for the seq_id retry rule.")
    extra: dict[str, Any] = Field(default_factory=dict)


class GatewayStore:
    def __init__(self, redis, ttl_seconds: int):
        self.redis = redis
        self.ttl = ttl_seconds

    # ------------------------------------------------------------ client sessions
    def put_session(self, session: ClientSession) -> None:
        self.redis.set(names.gateway_key("session", session.session_id), session.model_dump_json(), ex=self.ttl)

    def get_session(self, session_id: str) -> ClientSession | None:
        raw = self.redis.get(names.gateway_key("session", session_id))
        return ClientSession.model_validate_json(raw) if raw else None

    def touch_session(self, session_id: str) -> None:
        self.redis.expire(names.gateway_key("session", session_id), self.ttl)

    def add_member(self, session_id: str, kind: str, member_id: str) -> None:
        key = names.gateway_key("session", session_id, kind)
        self.redis.sadd(key, member_id)
        self.redis.expire(key, self.ttl)

    def members(self, session_id: str, kind: str) -> list[str]:
        return sorted(
            m.decode() if isinstance(m, bytes) else m
            for m in self.redis.smembers(names.gateway_key("session", session_id, kind))
        )

    def sessions_of(self, owner: str) -> list[ClientSession]:
        out = []
        for key in self.redis.scan_iter(names.gateway_key("session", "*"), count=500):
            name = key.decode() if isinstance(key, bytes) else key
            if name.count(":") != 3:  # skip the :models / :samplers sets
                continue
            session = self.get_session(name.split(":", 3)[3])
            if session is not None and session.owner == owner:
                out.append(session)
        return sorted(out, key=lambda s: s.created_at)

    # ------------------------------------------------------------ samplers
    def put_sampler(self, sampler: Sampler) -> None:
        self.redis.set(names.gateway_key("sampler", sampler.sampler_id), sampler.model_dump_json(), ex=self.ttl)

    def get_sampler(self, sampler_id: str) -> Sampler | None:
        raw = self.redis.get(names.gateway_key("sampler", sampler_id))
        return Sampler.model_validate_json(raw) if raw else None

    def add_inflight_target(self, model_id: str, seq: int, path: str) -> None:
        """One inflight save of a model; a sorted set by seq, so saves rendered out of order still rank right."""
        key = names.gateway_key("inflight", model_id)
        self.redis.zadd(key, {path: seq})
        self.redis.zremrangebyrank(key, 0, -2)  # only the newest is ever read
        self.redis.expire(key, self.ttl)

    def inflight_target(self, model_id: str) -> str | None:
        newest = self.redis.zrevrange(names.gateway_key("inflight", model_id), 0, 0)
        return (newest[0].decode() if isinstance(newest[0], bytes) else newest[0]) if newest else None

    # ------------------------------------------------------------ requests
    def claim_request(self, record: RequestRecord) -> RequestRecord | None:
        """Store the record unless one with that id exists; returns the existing one, or None if stored."""
        key = names.gateway_key("req", record.request_id)
        if self.redis.set(key, record.model_dump_json(), nx=True, ex=self.ttl):
            return None
        raw = self.redis.get(key)
        return RequestRecord.model_validate_json(raw) if raw else None

    def put_request(self, record: RequestRecord) -> None:
        self.redis.set(names.gateway_key("req", record.request_id), record.model_dump_json(), ex=self.ttl)

    def forget_request(self, request_id: str) -> None:
        self.redis.delete(names.gateway_key("req", request_id))

    def get_request(self, request_id: str) -> RequestRecord | None:
        raw = self.redis.get(names.gateway_key("req", request_id))
        return RequestRecord.model_validate_json(raw) if raw else None

    # ------------------------------------------------------------ gateway-side futures
    def set_outcome(self, request_id: str, *, result: dict | None = None, error: dict | None = None) -> None:
        value = {"result": result} if error is None else {"error": error}
        self.redis.set(names.gateway_key("outcome", request_id), json.dumps(value), ex=self.ttl)

    def get_outcome(self, request_id: str) -> dict | None:
        raw = self.redis.get(names.gateway_key("outcome", request_id))
        return json.loads(raw) if raw else None

    def copy_done(self, owner: str, idempotency_key: str) -> str | None:
        """The path a checkpoint copy with this idempotency key already made, if any."""
        raw = self.redis.get(names.gateway_key("copy", owner, idempotency_key))
        return raw.decode() if isinstance(raw, bytes) else raw

    def remember_copy(self, owner: str, idempotency_key: str, path: str, ttl_s: int) -> None:
        self.redis.set(names.gateway_key("copy", owner, idempotency_key), path, ex=ttl_s)

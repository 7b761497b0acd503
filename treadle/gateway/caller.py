"""`Call`: what every authenticated route starts from, as one FastAPI dependency.

A route declares `call: Call` and gets the owner behind the request's API key (a 401 comes before the
body is read), the app's `Backend`, and the request with the steps every route repeats: the body
parsed as a typed request, an id checked to be the caller's, a blocking call run off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from treadle.gateway.auth import require_owner
from treadle.gateway.backend import Backend, get_backend
from treadle.gateway.store import ClientSession, Sampler
from treadle.queue.ops import parse_request
from treadle.queue.sessions import SessionRecord

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass(frozen=True)
class Caller:
    request: Request
    owner: str
    backend: Backend

    async def body(self) -> bytes:
        """The raw body (zstd already decompressed, within the body limits of gateway/bodies.py)."""
        return await self.request.body()

    async def json(self) -> Any:
        return await self.request.json()

    async def parse(self, request_type: type[RequestT]) -> RequestT:
        """The JSON body as `request_type`; a bad field is a 400 that names it."""
        return parse_request(request_type, await self.json())

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a worker thread: everything behind `Backend` blocks on Redis or the store."""
        return await run_in_threadpool(fn, *args, **kwargs)

    async def session(self, session_id: str) -> ClientSession:
        """The caller's client session; anyone else's, or none, is a 404."""
        return await self.run(self.backend.owners.client_session, session_id, self.owner)

    async def model(self, model_id: str) -> SessionRecord:
        """The caller's training model; anyone else's, or none, is a 404."""
        return await self.run(self.backend.owners.model, model_id, self.owner)

    async def sampler(self, sampler_id: str) -> Sampler:
        """The caller's sampling session; anyone else's, or none, is a 404."""
        return await self.run(self.backend.owners.sampler, sampler_id, self.owner)


async def _caller(
    request: Request, owner: str = Depends(require_owner), backend: Backend = Depends(get_backend)
) -> Caller:
    return Caller(request, owner, backend)


Call = Annotated[Caller, Depends(_caller)]

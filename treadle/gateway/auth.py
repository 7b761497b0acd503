"""API-key authentication: a key names an owner, and an owner sees only what it created.

The Tinker SDK sends the key as `X-API-Key`; the OpenAI client sends `Authorization: Bearer <key>`.
A missing or unknown key is a 401 (what an owner may see is `ownership.py`'s job).
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


class KeyRing:
    def __init__(self, keys: dict[str, str]):
        self._keys = dict(keys)

    def owner_of(self, key: str | None) -> str | None:
        if not key:
            return None
        for known, owner in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return owner
        return None


def presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def require_owner(request: Request) -> str:
    """FastAPI dependency: the owner behind the request's API key, or a 401."""
    keyring: KeyRing = request.app.state.keyring
    key = presented_key(request)
    owner = keyring.owner_of(key)
    if owner is None:
        detail = "missing API key (send X-API-Key or Authorization: Bearer)" if not key else "invalid API key"
        raise HTTPException(status_code=401, detail=detail)
    return owner

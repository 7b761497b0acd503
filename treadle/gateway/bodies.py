"""Request bodies: size limits, compressed and decompressed, before any route reads them.

A pure ASGI middleware, so that a body over the limit is refused while it streams in (never held
whole), and a zstd body is decompressed in bounded chunks, refused the moment its output passes
`max_decompressed_bytes`: a small compressed body can expand a thousandfold, and the route would
otherwise hold all of it. Routes then see a plain body without `content-encoding`, so the seq_id retry
rule compares the same request sent compressed or not as equal. Errors are the app's JSON error form.
"""

from __future__ import annotations

import json

import zstandard

_MIN_STEP, _MAX_STEP = 64, 1 << 16  # compressed bytes fed per step
_STEP_OUTPUT = 1 << 20  # a step that yields more than this drops back to the smallest


class BodyTooLarge(Exception):
    pass


class BodyLimits:
    def __init__(self, app, *, max_body_bytes: int, max_decompressed_bytes: int):
        self.app = app
        self.max_body = max_body_bytes
        self.max_decompressed = max_decompressed_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return await _refuse(scope, send, 413, self._too_large(f"{int(declared)} bytes (content-length)"))
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return await _refuse(scope, send, 413, self._too_large(f"over {self.max_body} bytes"))
        encoding = headers.get(b"content-encoding", b"").decode("latin-1").strip().lower()
        if encoding in ("", "identity"):
            data = bytes(body)
        elif encoding == "zstd":
            try:
                data = decompress_zstd(bytes(body), self.max_decompressed)
            except BodyTooLarge:
                return await _refuse(
                    scope,
                    send,
                    413,
                    f"body: decompresses to over max_decompressed_bytes = {self.max_decompressed} "
                    f"({len(body)} bytes compressed)",
                )
            except zstandard.ZstdError as exc:
                return await _refuse(scope, send, 400, f"body: not valid zstd data ({exc})")
            scope = {
                **scope,
                "headers": [
                    (k, v) for k, v in scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")
                ],
            }
        else:
            return await _refuse(
                scope, send, 415, f"content-encoding: {encoding!r} is not supported; send zstd or none"
            )

        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)

    def _too_large(self, size: str) -> str:
        return f"body: {size} is over max_body_bytes = {self.max_body}"


def decompress_zstd(data: bytes, limit: int) -> bytes:
    """Decompress zstd frames, checking the output against `limit` as it grows; BodyTooLarge past it.

    Input is fed in steps that start tiny and grow only while the output stays small: a few bytes of
    zstd can expand to 128 kB, so a bomb advances 64 bytes at a time (a few MB of output per step at
    most) while an ordinary body soon moves 64 kB per step. A frame cut short is an error."""
    out, pos, step = bytearray(), 0, _MIN_STEP
    frame = zstandard.ZstdDecompressor().decompressobj()
    while pos < len(data):
        piece = frame.decompress(data[pos : pos + step])
        pos += step
        out += piece
        if len(out) > limit:
            raise BodyTooLarge()
        step = min(step * 2, _MAX_STEP) if len(piece) < _STEP_OUTPUT else _MIN_STEP
        if frame.eof and (frame.unused_data or pos < len(data)):  # another frame follows
            data, pos = frame.unused_data + data[pos:], 0
            frame = zstandard.ZstdDecompressor().decompressobj()
    if data and not frame.eof:
        raise zstandard.ZstdError("the last frame is incomplete (truncated body)")
    return bytes(out)


def error_payload(path: str, message: str, category: str) -> dict:
    """The one error form of each API: Tinker's routes `{"error", "category", "detail"}`; OpenAI's (under
    /v1) `{"error": {"message", "type", ...}}`, which OpenAI clients parse."""
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if category == "user" else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return {"error": message, "category": category, "detail": message}


async def _refuse(scope, send, status: int, message: str) -> None:
    payload = json.dumps(error_payload(scope.get("path", ""), message, "user")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})

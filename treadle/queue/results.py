"""Op results in the Celery result backend, keyed by future id (`<session_id>:<seq>`).

The worker stores results itself (tasks run with ignore_result) because an op may run under a
different message than its own: an early arrival is parked in the journal and run later, when its
predecessor arrives. Errors are stored as Celery FAILURE with a `treadle.errors` class, so the
client re-raises the same typed error. Any process that knows the id can read the result.

A waiting client need not poll: Celery's Redis backend publishes every stored result on a channel
named by the result's key, and `watch` subscribes to it (one subscription per thread, reused), so a
waiter sleeps on its socket and wakes the moment the result lands. Busy polling every millisecond took
CPU from the worker on a small machine, and added up to a millisecond to every op.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import redis as redis_lib
from celery import Celery, states

from treadle.errors import ServerError, TreadleError


# KEYS: the result's key. ARGV: the encoded meta, its lifetime in seconds (0: none). Stores and publishes it
# unless an answer is stored already.
_STORE_FIRST = """
local stored
if tonumber(ARGV[2]) > 0 then
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
else
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if stored then redis.call('PUBLISH', KEYS[1], ARGV[1]) end
return stored and 1 or 0
"""


class ResultStore:
    def __init__(self, app: Celery):
        self.backend = app.backend
        self._local = threading.local()  # each thread's own subscription (a PubSub is not thread-safe)
        self._store_first = None  # `_STORE_FIRST`, registered on the results' Redis at its first use

    def store_ok(self, future_id: str, value: dict | None) -> None:
        self.backend.store_result(future_id, value, states.SUCCESS)

    def store_error(self, future_id: str, error: TreadleError) -> None:
        self.backend.store_result(future_id, error, states.FAILURE)

    def store(self, future_id: str, value: dict | None, error: TreadleError | None) -> None:
        """An op's answer: its error if it failed, else its value (`queue_store`'s arguments)."""
        if error is None:
            self.store_ok(future_id, value)
        else:
            self.store_error(future_id, error)

    def in_redis(self, url: str) -> bool:
        """Whether results live in the Redis at `url` (so a pipeline there can carry their writes)."""
        return isinstance(getattr(self.backend, "client", None), redis_lib.Redis) and self.backend.url == url

    def queue_store(
        self, pipe, future_id: str, value: dict | None, error: TreadleError | None, *, first_only: bool = False
    ) -> None:
        """Queue on `pipe` (a pipeline on the results' Redis, see `in_redis`) what `store_ok`/`store_error`
        write: the result's meta under its key, and its publication to waiters. Celery's own store first
        reads the key to never overwrite a SUCCESS; the sequencer stores each seq once, so it need not.
        `first_only`: an answer already stored stays, and this one is neither written nor published (a control
        request answers under its claim, so a second answer is a guard, not a path)."""
        state = states.SUCCESS if error is None else states.FAILURE
        result = self.backend.encode_result(value if error is None else error, state)
        # The meta Celery's result backend stores for a finished task with no request (its own
        # `_get_result_meta`, which is private): readers (`get_task_meta`, `AsyncResult`) need these keys.
        meta = {
            "status": state,
            "result": result,
            "traceback": None,
            "children": [],
            "date_done": self.backend.app.now().isoformat(),
            "task_id": future_id,
        }
        key, encoded = self.backend.get_key_for_task(future_id), self.backend.encode(meta)
        if first_only:
            if self._store_first is None:
                self._store_first = self.backend.client.register_script(_STORE_FIRST)
            self._store_first(keys=[key], args=[encoded, int(self.backend.expires or 0)], client=pipe)
            return
        pipe.set(key, encoded, ex=self.backend.expires or None)
        pipe.publish(key, encoded)

    def poll(self, future_id: str, published: bytes | None = None) -> tuple[bool, dict | None]:
        """(done, value). Raises the stored TreadleError if the op failed. `published`: the result as its
        channel carried it (see `ResultWatch.sleep`), which spares the read."""
        meta = self.backend.get_task_meta(future_id) if published is None else self.backend.decode_result(published)
        status = meta.get("status")
        if status == states.SUCCESS:
            return True, meta.get("result")
        if status == states.FAILURE:
            error = meta.get("result")
            if isinstance(error, TreadleError):
                raise error
            raise ServerError(f"operation {future_id} failed: {error!r}")
        return False, None

    def is_done(self, future_id: str) -> bool:
        return self.backend.get_task_meta(future_id).get("status") in (states.SUCCESS, states.FAILURE)

    @contextmanager
    def watch(self, future_id: str) -> Iterator["ResultWatch"]:
        """Subscribe to the result's channel for the block; poll inside it, then `watch.sleep` between polls.

        Subscribing comes before the first poll, so a result stored in between still wakes the sleep."""
        watch = ResultWatch(self._pubsub(), self.backend.get_key_for_task(future_id))
        try:
            yield watch
        finally:
            watch.close()
            if watch.broken:
                self._local.pubsub = None

    def _pubsub(self):
        pubsub = getattr(self._local, "pubsub", None)
        client = getattr(self.backend, "client", None)  # only Celery's Redis backends publish results
        if pubsub is None and isinstance(client, redis_lib.Redis):
            pubsub = self._local.pubsub = client.pubsub(ignore_subscribe_messages=True)
        return pubsub


class ResultWatch:
    """A subscription to one result's channel; without one (or once its connection broke) it just sleeps."""

    def __init__(self, pubsub, channel: bytes | str):
        self.channel = channel.encode() if isinstance(channel, str) else channel
        self.pubsub, self.broken = pubsub, False
        if pubsub is not None:
            self._guard(lambda: pubsub.subscribe(self.channel))

    @property
    def subscribed(self) -> bool:
        return self.pubsub is not None

    def sleep(self, seconds: float) -> bytes | None:
        """Return after `seconds` (None), or as soon as the result is published (what was published: the
        stored result itself, so the waiter need not read it back)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.pubsub is None:
                time.sleep(left)
                return None
            pubsub = self.pubsub
            message = self._guard(lambda: pubsub.get_message(timeout=left))
            if message is not None and message.get("channel") == self.channel:
                return message.get("data")  # other channels' messages are late ones of earlier watches on this thread
        return None

    def close(self) -> None:
        if (pubsub := self.pubsub) is not None:
            self._guard(lambda: pubsub.unsubscribe(self.channel))

    def _guard(self, call):
        """Run a PubSub call; a broken connection turns this watch into plain sleeping (the poll reports outages)."""
        try:
            return call()
        except (redis_lib.ConnectionError, redis_lib.TimeoutError, OSError):
            try:
                if self.pubsub is not None:
                    self.pubsub.close()
            except Exception:  # noqa: BLE001 - closing a broken connection; nothing left to save
                pass
            self.pubsub, self.broken = None, True
            return None

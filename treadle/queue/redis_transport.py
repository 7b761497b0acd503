"""kombu's Redis transport, keeping one Redis client object per channel instead of one per command; and the
order a worker's consumer reads its queues in, control queues first.

kombu builds a new `redis.Redis` for every publish, every delivery's bookkeeping and every ack
(`Channel.conn_or_acquire`). With redis-py 8 building one takes longer than the Redis round trip it is
for (measured here: 180 us against 90 us for a GET on loopback), and a training op pays for three of
them. A client object is only a handle on the channel's connection pool and is thread-safe, so one per
pool serves them all; a new pool (kombu makes one after a reconnect) gets a new client.
"""

from __future__ import annotations

from kombu.transport import redis as kombu_redis
from kombu.utils.scheduling import round_robin_cycle

from treadle.queue import names


class Channel(kombu_redis.Channel):
    _sync_client = None

    def _create_client(self, asynchronous: bool = False):
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._sync_client
        if client is None or client.connection_pool is not pool:
            client = self._sync_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


# What `make_app` passes to Celery as `broker_transport` for redis:// URLs.
TRANSPORT = f"{__name__}:Transport"


class SessionsLast(round_robin_cycle):
    """The order a worker's BRPOP names its queues in: control queues (sample requests, sessions to create) before
    session queues (doorbells), each group in kombu's round robin. A sequencer pass ends as soon as a control
    message waits, and rings the doorbell of the sessions it left. In plain round robin the queue just read goes
    last, so after one control message that doorbell went first, and each further control message waited for one
    more pass, an op or more of a tenant that pipelines: a light tenant's sample request behind a heavy tenant's
    requests waited for several of its ops (docs/benchmarks.md, two tenants)."""

    def consume(self, n: int) -> list[str]:
        queues = self.items[:n]
        return [q for q in queues if not _is_session(q)] + [q for q in queues if _is_session(q)]


def _is_session(queue: str) -> bool:
    return queue.startswith(names.session_queue(""))


# What `make_app` passes as the transport's `queue_order_strategy` (every Redis scheme).
QUEUE_ORDER = f"{__name__}:SessionsLast"

"""A worker's device group: rank 0 (the Celery consumer) and follower ranks 1..N-1, one process each.

`treadle worker --devices N` runs rank 0 in its own process and spawns the followers with
`python -m treadle.gpu_worker.parallel.device_group SPEC`. Every rank loads the same base models on its own
device (`cuda:<local rank>`, or the CPU), whole or (`--shard`) as its FSDP2 shards, and joins one
`torch.distributed` process group (NCCL on CUDA, gloo on CPU), which carries the gradient all-reduce and the
shards' all-gathers. Calls travel over one socket per follower: rank 0 writes a call (a length-prefixed JSON
frame; tensors inside it as the wire format's raw little-endian bytes, never a pickle), the follower runs it on
its own engine replica and answers with one frame. `treadle.gpu_worker.parallel.distributed.GroupEngine`
decides what is sent.

Across hosts (`--nnodes M --node_rank K --master_addr A --master_port P`, the names torchrun uses): the group
has M x N ranks, rank K x N + i on host K. Every rank meets the others at A:P (torch.distributed's TCP
rendezvous); the followers of the other hosts call rank 0 back at A:P+1, and rank 0 stays the only Celery
consumer. On a host K > 0, `treadle worker` is no consumer: it spawns its N ranks and ends when any of them does
(`node_main`).

Failure: the group lives and dies as one. A follower that exits is seen by rank 0's watchdog within
`WATCHDOG_PERIOD_S` (or at once, by the call or collective that talks to it); rank 0 then kills the
remaining followers and exits with status 1, without answering the op in flight. A rank 0 that dies
closes the sockets: each follower reads end-of-file and exits at once with status 1, and so does the
`treadle worker` of every other host (the kernel's parent-death signal kills a follower stuck in a
collective); one that stops in order tells them first (`DeviceGroup.end`), and they exit 0. The sessions' leases then expire and another worker
adopts them from their checkpoint and journal, as after any worker crash. A follower that hangs
without dying is bounded by `CALL_TIMEOUT_S`, both on rank 0's wait for its answer and inside the
collectives.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from treadle.net import free_port

log = logging.getLogger("treadle.worker")

WATCHDOG_PERIOD_S = 0.5
# The longest one rank may wait for another inside one call: a forward_backward's imbalance between
# ranks, or a model load at start-up. A hung (not dead) rank takes the group down after this.
CALL_TIMEOUT_S = 600.0
_HEADER = struct.Struct(">Q")


# ---------------------------------------------------------------- frames


def send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> dict | None:
    """The next frame, or None when the other end closed the socket."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(sock, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return json.loads(body)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- ranks


def rank_device(device: str | None, rank: int) -> str:
    """Rank r's device: `cuda:r` when the worker runs on CUDA, else the CPU."""
    if device in (None, "cuda") and torch.cuda.is_available():
        return f"cuda:{rank}"
    if device is not None and device.startswith("cuda"):
        raise ValueError(
            f"device: {device!r} names one GPU; a worker with --devices N uses cuda:0..N-1 (pass cuda or nothing)"
        )
    return device or "cpu"


def join_process_group(spec: dict, rank: int) -> None:
    if spec["backend"] == "nccl":
        torch.cuda.set_device(rank % spec["local_size"])
    dist.init_process_group(
        spec["backend"],
        init_method=spec["init_method"],
        rank=rank,
        world_size=spec["world_size"],
        timeout=timedelta(seconds=CALL_TIMEOUT_S),
    )


def _die_with_parent() -> None:
    # A follower is useless without rank 0: the kernel kills it when rank 0 goes, even mid-collective.
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def group_spec(config) -> dict:
    """What every rank of the group of `config` (a WorkerConfig) needs to know, the same on every host."""
    backend = "nccl" if rank_device(config.device, 0).startswith("cuda") else "gloo"
    across = config.nnodes > 1
    return {
        "model": list(config.model),
        "device": config.device,
        "dtype": config.dtype,
        "max_tokens_per_microbatch": config.max_tokens_per_microbatch,
        "activation_checkpointing": config.activation_checkpointing,
        "loglevel": config.loglevel,
        "backend": backend,
        "shard": config.shard,
        "init_method": f"tcp://{config.master_addr}:{config.master_port}"
        if across
        else f"tcp://127.0.0.1:{free_port()}",
        # Where the followers of other hosts call rank 0 back.
        "call_address": [config.master_addr, config.master_port + 1] if across else None,
        "local_size": config.devices,
        "world_size": config.nnodes * config.devices,
    }


def spawn_rank(spec: dict, rank: int, fd: int | None = None) -> subprocess.Popen:
    """Start one follower: rank `rank` of the group, talking to rank 0 over `fd` (or calling it back over TCP)."""
    rank_spec = {**spec, "rank": rank, "fd": fd}
    # Its own session: a Ctrl-C or SIGTERM meant for the worker reaches rank 0 alone, which
    # hands its sessions over before the followers go (they follow it out).
    return subprocess.Popen(
        [sys.executable, "-m", "treadle.gpu_worker.parallel.device_group", json.dumps(rank_spec)],
        pass_fds=[fd] if fd is not None else [],
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


class DeviceGroup:
    """Rank 0's side: the follower processes, a socket to each, and the watchdog over them."""

    def __init__(self, config):
        self.spec = group_spec(config)
        self.size = self.spec["world_size"]
        self.shard = config.shard
        self.device = rank_device(config.device, 0)
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        self._remote: list[socket.socket] = []  # the followers of other hosts, watched through their sockets
        self._joined = False
        self._failing = threading.Lock()

    def spawn(self) -> None:
        """Start this host's ranks 1..N-1 (they load their models while rank 0 loads its own) and take the calls
        of the other hosts' ranks."""
        for rank in range(1, self.spec["local_size"]):
            mine, theirs = socket.socketpair()
            proc = spawn_rank(self.spec, rank, theirs.fileno())
            theirs.close()
            mine.settimeout(CALL_TIMEOUT_S)
            self.procs.append(proc)
            self.socks.append(mine)
            log.info("device group: rank %d is pid %d", rank, proc.pid)
        if self.spec["call_address"]:
            self._accept_remote(self.size - self.spec["local_size"])
        threading.Thread(target=self._watchdog, name="treadle-group-watchdog", daemon=True).start()
        atexit.register(self.end)

    def _accept_remote(self, count: int) -> None:
        listener = socket.create_server(("", self.spec["call_address"][1]))
        listener.settimeout(CALL_TIMEOUT_S)
        remote = {}
        while len(remote) < count:
            sock, peer = listener.accept()
            sock.settimeout(CALL_TIMEOUT_S)
            keep_alive(sock)
            hello = recv_frame(sock)
            if hello is None:
                continue
            remote[hello["rank"]] = sock
            log.info("device group: rank %d calls in from %s", hello["rank"], peer[0])
        listener.close()
        self._remote = [remote[rank] for rank in sorted(remote)]
        self.socks += self._remote

    def join_group(self) -> None:
        """Join the process group (it waits for every rank: on a replicated group, for their models)."""
        if not self._joined:
            join_process_group(self.spec, 0)
            self._joined = True
            log.info("device group of %d ranks joined (%s)", self.size, self.spec["backend"])

    def join(self, engines: dict) -> dict:
        """Join the process group (if not yet) and wrap each engine."""
        from treadle.gpu_worker.parallel.distributed import GroupEngine

        self.join_group()
        return {name: GroupEngine(engine, name, self) for name, engine in engines.items()}

    def call(self, messages: list[dict]) -> list[dict]:
        """Send message r-1 to rank r, then gather one answer from each (any failure is the group's end)."""
        self.send(messages)
        return self.receive()

    def send(self, messages: list[dict]) -> None:
        try:
            for sock, message in zip(self.socks, messages):
                send_frame(sock, message)
        except OSError as exc:
            self.fail(f"sending a call failed ({exc})")

    def receive(self) -> list[dict]:
        replies = []
        for rank, sock in enumerate(self.socks, start=1):
            try:
                reply = recv_frame(sock)
            except OSError as exc:
                self.fail(f"rank {rank} did not answer ({exc})")
            if reply is None:
                self.fail(f"rank {rank} closed its connection")
            replies.append(reply)
        return replies

    def end(self) -> None:
        """Rank 0's orderly exit (at interpreter exit): the followers exit 0. One that sees rank 0's connection close
        without this exits 1, so a supervisor that restarts failed processes restarts the other hosts too."""
        for sock in self.socks:
            try:
                send_frame(sock, {"call": "end"})
            except OSError:  # that follower is gone already
                pass

    def fail(self, reason: str):
        """Take the whole group down now: no answer for the op in flight, so another worker redoes it."""
        with self._failing:
            log.critical("device group: %s; the worker exits so that its sessions move to another worker", reason)
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            logging.shutdown()
            os._exit(1)

    def _watchdog(self) -> None:
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    self.fail(f"rank {rank} (pid {proc.pid}) exited with status {proc.returncode}")
            # A follower of another host is watched through its socket: readable with nothing to read is its end.
            readable, _, _ = select.select(self._remote, [], [], 0) if self._remote else ([], [], [])
            for sock in readable:
                try:  # without waiting: the call in flight may have read the answer that made it readable
                    ended = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    ended = False
                except OSError:
                    ended = True
                if ended:
                    self.fail(f"rank {self.socks.index(sock) + 1} closed its connection")
            time.sleep(WATCHDOG_PERIOD_S)


def node_main(config) -> None:
    """`treadle worker --node_rank K` (K > 0): this host's ranks of the group, as followers; exits when one does."""
    spec = group_spec(config)
    procs = [spawn_rank(spec, config.node_rank * config.devices + i) for i in range(config.devices)]
    log.info("node %d of %d: ranks %s", config.node_rank, config.nnodes, [p.pid for p in procs])
    while all(p.poll() is None for p in procs):
        time.sleep(WATCHDOG_PERIOD_S)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    code = next(p.returncode for p in procs if p.returncode is not None)
    log.info("node %d: a rank exited with status %s; the node's ranks end", config.node_rank, code)
    logging.shutdown()
    # Without the interpreter's shutdown, which takes seconds with torch loaded: the supervisor that restarts the
    # group sees this host gone as soon as its ranks are.
    os._exit(1 if code else 0)


def _call_rank_zero(spec: dict, rank: int) -> socket.socket:
    """A follower of another host: its connection to rank 0 (which may still be starting)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection(tuple(spec["call_address"]), timeout=CALL_TIMEOUT_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    send_frame(sock, {"rank": rank})
    sock.settimeout(None)  # idle waits end with rank 0 (its exit closes the connection), or keepalive's probes
    keep_alive(sock)
    return sock


def keep_alive(sock: socket.socket) -> None:
    """A connection between hosts ends within about 25 s of the other host vanishing without closing it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in ((socket.TCP_KEEPIDLE, 10), (socket.TCP_KEEPINTVL, 5), (socket.TCP_KEEPCNT, 3)):
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


# ---------------------------------------------------------------- a follower


def follower_main(spec: dict) -> None:
    from treadle.gpu_worker.engine import Engine
    from treadle.gpu_worker.parallel.lockstep import end_of_op
    from treadle.queue.workers import parse_model_spec

    rank = spec["rank"]
    logging.basicConfig(level=spec["loglevel"], format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    sock = socket.socket(fileno=spec["fd"]) if spec["fd"] is not None else _call_rank_zero(spec, rank)
    if spec["shard"]:  # sharding a model is collective: the group must exist before any model loads
        join_process_group(spec, rank)
    engines = {}
    for model_spec in spec["model"]:
        name, path = parse_model_spec(model_spec)
        engines[name] = Engine(
            path,
            device=rank_device(spec["device"], rank % spec["local_size"]),
            dtype=spec["dtype"],
            max_tokens_per_microbatch=spec["max_tokens_per_microbatch"],
            activation_checkpointing=spec["activation_checkpointing"],
            shard=spec["shard"],
        )
        # Rank 0 admits a full session for the whole group (by its own free memory or --full_session_memory): a
        # follower that refused one after rank 0 made it would take the group down, every time the session came back.
        engines[name].full_memory.decides = False
    if spec["shard"]:
        for engine in engines.values():  # a probe forward at load (every rank's) may have left a unit whole
            end_of_op(engine)
    else:
        join_process_group(spec, rank)
    log.info("rank %d of %d ready", rank, spec["world_size"])
    serve_calls(sock, engines, rank)


def serve_calls(sock: socket.socket, engines: dict, rank: int) -> None:
    """A follower's life after loading: run rank 0's calls in order until rank 0 goes."""
    from treadle.gpu_worker.parallel.distributed import execute

    while True:
        call = recv_frame(sock)  # idle waits end with rank 0: its exit closes the socket
        if call is None:
            log.error("rank 0 is gone without ending the group; rank %d exits with status 1", rank)
            logging.shutdown()
            os._exit(1)
        if call["call"] == "end":
            log.info("rank 0 ended the group; rank %d exits", rank)
            return
        try:
            reply = execute(engines, call)
        except Exception:
            # Rank 0 checked the call before sending it, so this is a fault of this rank: the replicas
            # would diverge if the group went on.
            log.exception("rank %d: %s failed; the group goes down", rank, call.get("call"))
            logging.shutdown()
            os._exit(1)
        if reply is not None:
            send_frame(sock, reply)


if __name__ == "__main__":
    follower_main(json.loads(sys.argv[1]))

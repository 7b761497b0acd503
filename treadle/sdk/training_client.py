"""TrainingClient: one LoRA training session on a worker.

Every op is validated here (pydantic), given the session's next seq, published to the session's
queue, and returned as an `APIFuture` at once. Ops of a session run strictly in the order they were
submitted, so `optim_step` may be submitted before the `forward_backward` result is read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from treadle.errors import ServerError, SessionStoppedError
from treadle.metering import Meter, Usage
from treadle.queue.ops import (
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    OpRequest,
    OptimStepRequest,
    SaveStateRequest,
    SaveWeightsForSamplerRequest,
    StopRequest,
    decode_result,
)
from treadle.sdk.background import submit_in_order, wait_off_loop
from treadle.sdk.capacity import CapacityWait
from treadle.sdk.futures import APIFuture
from treadle.sdk.sampling_client import SamplingClient
from treadle.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    FullConfig,
    GetInfoResponse,
    LoadWeightsResponse,
    LoraConfig,
    ModelData,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

LossFn = Callable[[list[Datum], list[Any]], tuple[Any, dict[str, float]]]


def _sampler_path(saved: SaveWeightsForSamplerResponse) -> str:
    """The snapshot's path: treadle's worker names every snapshot by a path, ephemeral ones included."""
    if saved.path is None:
        raise ServerError("save_weights_for_sampler answered without a path")
    return saved.path


@dataclass(frozen=True)
class TrainingSession:
    """What a training client is bound to: the session on the worker and the run its checkpoints go under."""

    session_id: str
    run_id: str
    base_model: str
    lora: LoraConfig
    full: FullConfig | None = None  # set for a full fine-tuning session


class TrainingClient:
    def __init__(self, ops, session: TrainingSession, capacity_wait: CapacityWait | None = None):
        self._ops = ops
        self.session = session
        self._stopped = False
        self._capacity_wait = capacity_wait or CapacityWait()
        # Held while a submit waits for room in a full queue, so that no later op of the session overtakes it.
        self._in_order = threading.Lock()

    # ------------------------------------------------------------ identity
    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def run_id(self) -> str:
        return self.session.run_id

    @property
    def base_model(self) -> str:
        return self.session.base_model

    def _submit(self, request: OpRequest, decode: Callable[[dict], Any] | None = None) -> APIFuture:
        if self._stopped:
            raise SessionStoppedError(f"session {self.session_id} was stopped; create a new training client")
        with self._in_order:
            fid = self._capacity_wait.submit(lambda: self._ops.submit(self.session_id, request))
        return APIFuture(self._ops, fid, decode or request.response.model_validate, base_model=self.base_model)

    # ------------------------------------------------------------ training ops
    def forward(
        self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Per-token logprobs and the loss, without gradients."""
        return self._submit(ForwardRequest.build(data=_datums(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config))

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Adds this batch's gradients to the session's accumulated gradients (summed over tokens)."""
        return self._submit(
            ForwardBackwardRequest.build(data=_datums(data), loss_fn=loss_fn, loss_fn_config=loss_fn_config)
        )

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: LossFn) -> APIFuture[ForwardBackwardOutput]:
        """A loss computed here, on the client, from the worker's logprobs (needs torch locally).

        Runs `forward`, calls `loss_fn(data, logprobs)` on leaf tensors that require grad, then sends
        a cross_entropy backward with weights = -dLoss/dlogprobs, which yields the exact gradient.
        Blocks until the backward is submitted, so ops submitted afterwards stay in order.
        """
        data = _datums(data)
        weighted, decode = _custom_backward(data, self.forward(data, "cross_entropy").result(), loss_fn)
        return self._submit(ForwardBackwardRequest.build(data=weighted, loss_fn="cross_entropy"), decode)

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """Applies the accumulated gradients with AdamW, then clears them."""
        return self._submit(OptimStepRequest.build(adam_params=adam_params or AdamParams()))

    # ------------------------------------------------------------ weights and state
    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False, user_metadata: dict | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        """Adapter + optimizer state, as treadle://<run_id>/weights/<name>."""
        return self._submit(
            SaveStateRequest.build(name=name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=user_metadata)
        )

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Loads the weights of a save_state checkpoint and resets the optimizer."""
        return self._submit(LoadStateRequest.build(path=path, with_optimizer=False))

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Loads weights and Adam moments exactly (or fails loudly)."""
        return self._submit(LoadStateRequest.build(path=path, with_optimizer=True))

    def save_weights_for_sampler(
        self, name: str | None = None, ttl_seconds: int | None = None, merge_weights: bool = False
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """A frozen snapshot of the adapter now, as treadle://<run_id>/sampler_weights/<name>.

        `merge_weights=True` (SageMaker's spelling) also stores a merged model under `merged/`.
        """
        return self._submit(
            SaveWeightsForSamplerRequest.build(name=name, ttl_seconds=ttl_seconds, merge_weights=merge_weights)
        )

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Snapshot the adapter (ephemeral unless named) and return a SamplingClient bound to it."""
        return self.create_sampling_client(_sampler_path(self.save_weights_for_sampler(name).result()))

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return SamplingClient(
            self._ops, base_model=self.base_model, model_path=model_path, capacity_wait=self._capacity_wait
        )

    # ------------------------------------------------------------ info
    def get_info(self) -> GetInfoResponse:
        return GetInfoResponse(
            model_id=self.session_id,
            model_data=ModelData(arch=None, model_name=self.base_model, tokenizer_id=self.base_model),
            is_lora=self.session.full is None,
            lora_rank=self.session.lora.rank if self.session.full is None else 0,
            model_name=self.base_model,
        )

    def get_tokenizer(self):
        from treadle.sdk.tokenizer import load_tokenizer

        return load_tokenizer(self._ops, self.base_model)

    def get_usage(self) -> Usage:
        """What this session's finished ops consumed, as the workers metered them (each op counted once,
        across failovers): prefill, sampled and trained tokens, compute seconds, ops."""
        return Meter(self._ops.redis).session_usage(self.session_id)

    def future(self, future_id: str) -> APIFuture:
        """Resolve any op of this session by id (e.g. after restarting the client)."""
        return APIFuture(self._ops, future_id, decode_result, base_model=self.base_model)

    # ------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Frees the session's adapter on the worker (after every op already submitted)."""
        if not self._stopped:
            self._submit(StopRequest()).result()
            self._stopped = True

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ async twins
    # Each submits on the session's submitting thread (see `treadle.sdk.background`), so ops reach the
    # session in the order their twins were started, and returns the op's future, as tinker's twins do.
    async def forward_async(
        self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return await submit_in_order(self.session_id, self.forward, data, loss_fn, loss_fn_config)

    async def forward_backward_async(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return await submit_in_order(self.session_id, self.forward_backward, data, loss_fn, loss_fn_config)

    async def forward_backward_custom_async(
        self, data: Sequence[Datum], loss_fn: LossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """As `forward_backward_custom`, awaiting the forward instead of blocking on it. Ops started while it
        awaits run between its forward and its backward: await it before starting the next op."""
        data = _datums(data)
        forward = await (await self.forward_async(data, "cross_entropy"))
        weighted, decode = _custom_backward(data, forward, loss_fn)
        return await submit_in_order(
            self.session_id, self._submit, ForwardBackwardRequest.build(data=weighted, loss_fn="cross_entropy"), decode
        )

    async def optim_step_async(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        return await submit_in_order(self.session_id, self.optim_step, adam_params)

    async def save_state_async(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False, user_metadata: dict | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        return await submit_in_order(self.session_id, self.save_state, name, ttl_seconds, overwrite, user_metadata)

    async def load_state_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return await submit_in_order(self.session_id, self.load_state, path)

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return await submit_in_order(self.session_id, self.load_state_with_optimizer, path)

    async def save_weights_for_sampler_async(
        self, name: str | None = None, ttl_seconds: int | None = None, merge_weights: bool = False
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return await submit_in_order(self.session_id, self.save_weights_for_sampler, name, ttl_seconds, merge_weights)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        saved = await (await self.save_weights_for_sampler_async(name))
        return self.create_sampling_client(_sampler_path(saved))

    async def get_usage_async(self) -> Usage:
        return await wait_off_loop(self.get_usage)

    async def stop_async(self) -> None:
        if not self._stopped:
            await (await submit_in_order(self.session_id, self._submit, StopRequest()))
            self._stopped = True


def _custom_backward(
    data: list[Datum], forward: ForwardBackwardOutput, loss_fn: LossFn
) -> tuple[list[Datum], Callable[[dict], ForwardBackwardOutput]]:
    """The cross_entropy datums whose gradient is `loss_fn`'s at the forward's logprobs, and a decoder that
    adds the loss's own metrics to the backward's."""
    import torch

    logprobs = [o["logprobs"].to_torch().float().requires_grad_(True) for o in forward.loss_fn_outputs]
    loss, metrics = loss_fn(data, logprobs)
    loss.backward()
    weighted = []
    for datum, lp in zip(data, logprobs):
        grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
        weighted.append(
            Datum(
                model_input=datum.model_input,
                loss_fn_inputs={
                    "target_tokens": datum.loss_fn_inputs["target_tokens"],
                    "weights": TensorData.from_numpy((-grad).detach().numpy()),
                },
            )
        )
    user_metrics = {k if ":" in k else f"{k}:mean": float(v) for k, v in (metrics or {}).items()}
    user_metrics["loss:sum"] = float(loss.detach())

    def decode(value: dict) -> ForwardBackwardOutput:
        out = ForwardBackwardOutput.model_validate(value)
        return out.model_copy(update={"metrics": {**out.metrics, **user_metrics}})

    return weighted, decode


def _datums(data: Sequence[Datum]) -> list[Datum]:
    return [d if isinstance(d, Datum) else Datum.model_validate(d) for d in data]

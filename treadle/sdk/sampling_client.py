"""SamplingClient: sample from a frozen sampler snapshot (or the base model) on any worker serving it."""

from __future__ import annotations

from treadle.queue.ops import SampleRequest
from treadle.sdk.background import submit_in_order
from treadle.sdk.capacity import CapacityWait
from treadle.sdk.futures import APIFuture
from treadle.types import ModelInput, SampleResponse, SamplingParams


class SamplingClient:
    def __init__(
        self, ops, *, base_model: str, model_path: str | None = None, capacity_wait: CapacityWait | None = None
    ):
        self._ops = ops
        self._base_model = base_model
        self.model_path = model_path
        self._capacity_wait = capacity_wait or CapacityWait()

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        """Sequences with per-token logprobs of the distribution actually sampled from, and a stop reason."""
        req = SampleRequest.build(
            base_model=self._base_model,
            model_path=self.model_path,
            prompt=prompt.to_ints() if prompt.is_text else prompt,
            num_samples=num_samples,
            sampling_params=sampling_params or SamplingParams(),
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
        )
        return APIFuture(self._ops, self._submit(req), SampleResponse.model_validate, base_model=self._base_model)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """Logprob of each prompt token given the ones before it; entry 0 is None."""
        req = SampleRequest.build(
            base_model=self._base_model,
            model_path=self.model_path,
            prompt=prompt.to_ints() if prompt.is_text else prompt,
            num_samples=1,
            sampling_params=SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
        )
        return APIFuture(
            self._ops,
            self._submit(req),
            lambda v: SampleResponse.model_validate(v).prompt_logprobs or [],
            base_model=self._base_model,
        )

    def _submit(self, request: SampleRequest) -> str:
        """The request's future id, once its owner's queued sample rows leave room for it (see `treadle.sdk.capacity`)."""
        return self._capacity_wait.submit(lambda: self._ops.submit_sample(request))

    def get_tokenizer(self):
        from treadle.sdk.tokenizer import load_tokenizer

        return load_tokenizer(self._ops, self._base_model)

    def get_base_model(self) -> str:
        return self._base_model

    def future(self, future_id: str) -> APIFuture[SampleResponse]:
        return APIFuture(self._ops, future_id, SampleResponse.model_validate, base_model=self._base_model)

    # ------------------------------------------------------------ async twins
    # As tinker's: each resolves to the response (a sample need not be ordered behind anything, but the
    # client's samples share one submitting thread; see `treadle.sdk.background`).
    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
    ) -> SampleResponse:
        future = await submit_in_order(
            self, self.sample, prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs
        )
        return await future

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        return await (await submit_in_order(self, self.compute_logprobs, prompt))

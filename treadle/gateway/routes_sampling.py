"""Sampling endpoints: create_sampling_session, samplers/{id}, asample.

A sampling session names what to sample from: a base model, or a sampler checkpoint (a frozen
snapshot of an adapter). An `inflight` sampler (Tinker 0.38's SamplingClientKind) instead samples its
training model's newest inflight save, so a later `save_weights_and_get_sampling_client(kind="inflight")`
moves every earlier inflight client of that model onto the new weights, as Tinker's contract says;
between two saves it stays on the last one (the gateway cannot snapshot outside the client's seq order).
`asample` publishes to the base model's control queue, which any worker
serving that base model consumes, so sampling never waits behind a session's training ops.
"""

from __future__ import annotations

from fastapi import APIRouter
from tinker import types as tt

from treadle.errors import InvalidRequestError, TreadleError
from treadle.gateway.caller import Call
from treadle.gateway.paths import to_tinker
from treadle.gateway.sample_targets import dense_target_ids
from treadle.gateway.store import Sampler
from treadle.queue import names
from treadle.queue.ops import SampleRequest, parse_request
from treadle.types import EncodedTextChunk, ImageChunk, ModelInput, SamplingParams

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(call: Call) -> dict:
    req = await call.parse(tt.CreateSamplingSessionRequest)
    await call.session(req.session_id)
    base_model, model_path = await call.run(
        call.backend.owners.sampling_target, call.owner, req.base_model, req.model_path
    )
    sampler = Sampler(
        sampler_id=names.tinker_sampler_id(req.session_id, req.sampling_session_seq_id),
        owner=call.owner,
        base_model=base_model,
        model_path=model_path,
    )
    await call.run(call.backend.store.put_sampler, sampler)
    await call.run(call.backend.store.add_member, req.session_id, "samplers", sampler.sampler_id)
    return {"sampling_session_id": sampler.sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, call: Call) -> dict:
    sampler = await call.sampler(sampler_id)
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": sampler.base_model,
        "model_path": to_tinker(sampler.model_path) if sampler.model_path else None,
    }


@router.post("/asample")
async def asample(call: Call) -> dict:
    """Returns the future at once, with one `sample_sequence_id` per sample (the SDK asserts them)."""
    req = await call.parse(tt.SampleRequest)
    backend, owner = call.backend, call.owner
    if req.sampling_session_id is not None:
        sampler = await call.sampler(req.sampling_session_id)
        base_model, model_path = sampler.base_model, sampler.model_path
        if sampler.inflight_of is not None:
            model_path = await call.run(backend.store.inflight_target, sampler.inflight_of) or model_path
    else:
        base_model, model_path = await call.run(backend.owners.sampling_target, owner, req.base_model, req.model_path)
    try:
        sample, target_layout = _sample_request(req, base_model, model_path)
    except TreadleError as exc:
        request_id = await call.run(backend.local.fail, owner, "sample", exc)
    else:
        extra = {"prompt_logprobs_last_n": req.prompt_logprobs_last_n, "target_layout": target_layout}
        request_id = await call.run(backend.submit_sample, owner, sample, extra)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)]}


def _sample_request(
    req: tt.SampleRequest, base_model: str, model_path: str | None
) -> tuple[SampleRequest, dict | None]:
    """treadle's request, and the CSR layout of a sparse target_prompt_logprobs (its answer keeps it)."""
    prompt = _prompt(req.prompt)
    params = parse_request(SamplingParams, req.sampling_params.model_dump(), "sampling_params")
    target, layout = (
        (None, None)
        if req.target_prompt_logprobs is None
        else dense_target_ids(req.target_prompt_logprobs, _length(req.prompt) - 1)
    )
    return SampleRequest.build(
        base_model=base_model,
        model_path=model_path,
        prompt=prompt,
        num_samples=req.num_samples,
        sampling_params=params,
        include_prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs,
        target_prompt_logprobs=target,
        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
    ), layout


def _prompt(prompt: tt.ModelInput) -> list[int] | ModelInput:
    """The prompt's token ids, or its chunks when it holds images (the worker's processor turns them into tokens)."""
    if all(isinstance(c, tt.EncodedTextChunk) for c in prompt.chunks):
        return [t for c in prompt.chunks for t in c.tokens]  # type: ignore[union-attr]  # text chunks, checked above
    chunks: list[EncodedTextChunk | ImageChunk] = []
    for i, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, tt.EncodedTextChunk):
            chunks.append(EncodedTextChunk(tokens=chunk.tokens))
        elif isinstance(chunk, tt.ImageChunk):
            chunks.append(ImageChunk(data=chunk.data, format=chunk.format, expected_tokens=chunk.expected_tokens))
        else:
            raise InvalidRequestError(
                f"prompt.chunks[{i}]: {type(chunk).__name__} is not supported; only encoded_text and image"
            )
    return ModelInput(chunks=chunks)


def _length(prompt: tt.ModelInput) -> int:
    try:
        return prompt.length
    except ValueError:  # an image chunk without expected_tokens has no length
        raise InvalidRequestError(
            "target_prompt_logprobs: every image chunk of the prompt needs expected_tokens"
        ) from None

"""OpenAI-compatible `/v1/chat/completions`, `/v1/completions` and `/v1/models` over treadle's sampler.

Chat messages may carry `image_url` parts for a vision-language model (`openai_images`: data: URLs, and http(s)
ones only where the operator allows fetching them).

`model` names what to sample: a sampler checkpoint (`tinker://...` or `treadle://...`), a sampling
session id from the Tinker API, or a served base model. A checkpoint is sampled with its adapter
applied (the worker loads that snapshot; it never falls back to the base model). The chat template
and the detokenisation use the base model's own tokenizer, loaded here with transformers. `stream=true` answers
with server-sent events (`openai_stream.py`); answers are rendered by `openai_render.py`.
"""

from __future__ import annotations

import secrets
import time
from functools import lru_cache
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from treadle.errors import InvalidRequestError
from treadle.gateway.backend import Backend
from treadle.gateway import openai_render as render
from treadle.gateway.caller import Call
from treadle.gateway.openai_images import image_part, placeholder, split_at_images
from treadle.gateway.openai_stream import EventStream, StreamedCompletion, events
from treadle.queue.ops import SampleRequest, parse_request
from treadle.queue.sample_options import MAX_TOPK_SAMPLE_LOGPROBS
from treadle.types import MAX_TOKENS_PER_SEQUENCE, SEED_MAX, EncodedTextChunk, ModelInput, SamplingParams

router = APIRouter()


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = Field(default=False, description="Send the usage in a last chunk with no choices.")


class _OpenAIRequest(BaseModel):
    # The OpenAI client sends fields treadle does not use (user, metadata, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="A sampler path (tinker:// or treadle://), a sampler id, or a served base model.")
    n: int = Field(default=1, ge=1, le=128, description="Completions to generate.")
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_PER_SEQUENCE, description="Most new tokens per completion."
    )
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: str | list[str] | None = Field(default=None, description="Stop strings (not included in the output).")
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX, description="Random seed; the same seed gives the same completion."
    )
    stream: bool = Field(default=False, description="Answer with server-sent events as tokens are drawn.")
    stream_options: StreamOptions | None = Field(default=None, description="With stream: what else to send.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS_PER_SEQUENCE, description="Newer spelling of max_tokens."
    )
    logprobs: bool = Field(default=False, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOPK_SAMPLE_LOGPROBS,
        description="With logprobs: the most likely tokens at each position, of the distribution sampled from.",
    )

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def top(self) -> int:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(f"top_logprobs: {self.top_logprobs} needs logprobs: true")
        return self.top_logprobs or 0


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] = Field(description="A prompt string, or its token ids.")
    max_tokens: int | None = Field(
        default=16,
        ge=1,
        le=MAX_TOKENS_PER_SEQUENCE,
        description="Most new tokens per completion (OpenAI's default is 16).",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOPK_SAMPLE_LOGPROBS,
        description="Each token's logprob, and this many most likely tokens at each position (of the distribution "
        "sampled from).",
    )
    echo: Literal[False] = Field(default=False, description="Echoing the prompt is not supported.")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top(self) -> int:
        return self.logprobs or 0


@lru_cache(maxsize=16)
def load_tokenizer(source: str):
    """A served model's tokenizer, from the HF id or directory the worker registry reports."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


@router.get("/models")
async def list_models(call: Call) -> dict:
    served = await call.run(call.backend.owners.served_models)
    return {
        "object": "list",
        "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "treadle"} for m in served],
    }


@router.post("/chat/completions")
async def chat_completions(call: Call):
    return await _complete(call.backend, call.owner, await call.parse(ChatCompletionRequest), chat=True)


@router.post("/completions")
async def completions(call: Call):
    return await _complete(call.backend, call.owner, await call.parse(CompletionRequest), chat=False)


async def _complete(backend: Backend, owner: str, req: ChatCompletionRequest | CompletionRequest, *, chat: bool):
    base_model, model_path = await run_in_threadpool(_resolve_model, backend, owner, req.model)
    source = await run_in_threadpool(backend.owners.tokenizer_source, base_model)
    tokenizer = await run_in_threadpool(load_tokenizer, source)
    prompt = await run_in_threadpool(_prompt_tokens, tokenizer, req, chat, backend, source)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = (
        (req.max_completion_tokens or req.max_tokens) if isinstance(req, ChatCompletionRequest) else req.max_tokens
    )
    params = parse_request(
        SamplingParams,
        {
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop": stops or None,
        },
        "sampling_params",
    )
    completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
    sample = SampleRequest.build(
        base_model=base_model,
        model_path=model_path,
        prompt=prompt,
        num_samples=req.n,
        sampling_params=params,
        topk_sample_logprobs=req.top,
        stream_id=completion_id if req.stream else None,  # the worker publishes the tokens under the response's id
    )
    future_id = await run_in_threadpool(backend.submit_sample, owner, sample)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        out = StreamedCompletion(
            completion_id,
            tokenizer,
            req.model,
            chat,
            req.n,
            stops,
            req.wants_logprobs,
            req.top > 0,
            usage,
            _prompt_length(prompt),
        )
        return EventStream(events(backend, future_id, out))
    result = await run_in_threadpool(backend.wait, future_id, backend.settings.sample_timeout_seconds)
    sequences = result["sequences"]
    return {
        "id": completion_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            render.choice(i, tokenizer, seq, stops, chat, req.wants_logprobs) for i, seq in enumerate(sequences)
        ],
        "usage": render.usage(_prompt_length(prompt), sequences),
    }


def _resolve_model(backend: Backend, owner: str, model: str) -> tuple[str, str | None]:
    """(base model, treadle sampler path or None) for the request's `model`."""
    if "://" in model:
        path, manifest = backend.owners.checkpoint(model, owner)
        return manifest.base_model, path.uri()
    sampler = backend.store.get_sampler(model)
    if sampler is not None and sampler.owner == owner:
        return sampler.base_model, sampler.model_path
    backend.owners.served_model(model)
    return model, None


def _prompt_tokens(tokenizer, req: _OpenAIRequest, chat: bool, backend: Backend, source: str) -> list[int] | ModelInput:
    """The prompt's token ids, or its chunks when a chat message has image parts (`openai_images`)."""
    if not chat:
        prompt = req.prompt
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
    messages, images = [], []
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, list):  # content parts: text, and images as placeholders
            texts = []
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    images.append(image_part(f"messages[{i}].content[{j}]", part, backend.settings))
                    texts.append(placeholder(tokenizer))
                elif part.get("type") == "text":
                    texts.append(part.get("text", ""))
                else:
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}]: only text and image_url parts are supported"
                    )
            content = "".join(texts)
        messages.append({"role": message.role, "content": content or ""})
    if tokenizer.chat_template is None:
        raise InvalidRequestError(f"model: {req.model!r} has a tokenizer without a chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        return split_at_images(tokenizer, text, images, source)
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt_length(prompt: list[int] | ModelInput) -> int:
    """The prompt's tokens as usage counts them (an image's: its expected_tokens, when counted)."""
    if isinstance(prompt, list):
        return len(prompt)
    return sum(len(c.tokens) if isinstance(c, EncodedTextChunk) else c.expected_tokens or 0 for c in prompt.chunks)

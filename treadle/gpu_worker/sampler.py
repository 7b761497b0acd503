"""Sampling with HF `generate`, returning logprobs of the distribution that was actually sampled from.

The request's temperature, top-k and top-p are applied by our own `LogitsProcessorList` (the model's
shipped generation defaults are cleared by the model host), and the last processor of the pipeline
records `log_softmax` of the final, processed scores. The logprob returned for a sampled token is
therefore its logprob *after* temperature/top-k/top-p, i.e. under the distribution it was drawn
from, which is what importance-sampling and PPO ratios need (returning raw-model logprobs would
make RL silently off-policy). At temperature 1 with no top-k/top-p this equals the model's logprob.
Temperature 0 means greedy (top-k 1): a point mass, so each logprob is 0.

A row ends at EOS, at a stop token id, or once its decoded text contains a stop string (the token
that completes it is kept): stop_reason `stop`; otherwise at max_tokens: `length`. A seed makes a
request reproducible without moving the process's global RNG; the `num_samples` rows of one request
are different draws.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from treadle.gpu_worker.logprobs import target_logprobs
from treadle.gpu_worker.validation import PreparedSample
from treadle.types import SampledSequence, SamplingParams


class SampledTokenLogprobs(LogitsProcessor):
    """Last in the pipeline: keeps log_softmax of the final scores; at the next step (or at the end)
    reads off the logprob of the token that was sampled. Holds one (batch, vocab) tensor at a time."""

    def __init__(self) -> None:
        self._pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _collect(self, sampled: torch.Tensor) -> None:
        if self._pending is not None:
            self.steps.append(self._pending.gather(1, sampled.unsqueeze(1)).squeeze(1))
            self._pending = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._collect(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(batch, new tokens) logprobs, once generation is over."""
        self._collect(sequences[:, -1])
        return torch.stack(self.steps, dim=1)


class StopStrings(StoppingCriteria):
    """Ends a row once the text it generated contains any stop string."""

    def __init__(self, tokenizer, stop_strings: list[str], prompt_length: int):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = [contains_stop(self.tokenizer.decode(row[self.prompt_length :]), self.stop_strings) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def contains_stop(text: str, stop_strings: list[str]) -> bool:
    return any(s in text for s in stop_strings)


def _processors(params: SamplingParams) -> LogitsProcessorList:
    if params.temperature == 0:
        return LogitsProcessorList([TopKLogitsWarper(1)])
    processors = LogitsProcessorList()
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors


def _cut(tokens: list[int], stop_ids: set[int], stop_strings: list[str], tokenizer) -> int:
    """Number of tokens to keep: through the first stop token or the token completing a stop string."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    if stop_strings and contains_stop(tokenizer.decode(tokens[:end]), stop_strings):
        end = next(k for k in range(1, end + 1) if contains_stop(tokenizer.decode(tokens[:k]), stop_strings))
    return end


def sample(
    model: nn.Module,
    tokenizer,
    request: PreparedSample,
    num_samples: int,
    params: SamplingParams,
    *,
    device: torch.device,
    eos_token_id: int,
    pad_token_id: int,
) -> list[SampledSequence]:
    """`num_samples` continuations of the prompt, each with per-token logprobs and a stop reason."""
    prompt = torch.from_numpy(request.prompt).to(device).unsqueeze(0).repeat(num_samples, 1)
    stop_ids = {eos_token_id, *request.stop_token_ids}
    recorder = SampledTokenLogprobs()
    stopping = StoppingCriteriaList()
    if request.stop_strings:
        stopping.append(StopStrings(tokenizer, request.stop_strings, prompt.shape[1]))
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=request.max_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
    )
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=params.seed is not None), torch.no_grad():
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            generation_config=config,
            logits_processor=LogitsProcessorList([*_processors(params), recorder]),
            stopping_criteria=stopping,
        )
    new_tokens = out.sequences[:, prompt.shape[1] :]
    logprobs = recorder.finish(out.sequences)
    sequences = []
    for row in range(num_samples):
        tokens = new_tokens[row].tolist()
        end = _cut(tokens, stop_ids, request.stop_strings, tokenizer)
        stopped = tokens[end - 1] in stop_ids or contains_stop(tokenizer.decode(tokens[:end]), request.stop_strings)
        sequences.append(
            SampledSequence(
                tokens=tokens[:end],
                logprobs=logprobs[row, :end].tolist(),
                stop_reason="stop" if stopped else "length",
            )
        )
    return sequences


def prompt_logprobs(
    model: nn.Module, prompt: torch.Tensor | list[int], topk: int, *, device: torch.device, pad_token_id: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """Logprob of each prompt token given the ones before (entry 0 is None), and optionally the top-k."""
    tokens = np.asarray(prompt, dtype=np.int64)
    if tokens.size < 2:
        return [None], ([None] if topk else None)
    with torch.no_grad():
        if not topk:
            (lp,) = target_logprobs(model, [tokens[:-1]], [tokens[1:]], device=device, pad_token_id=pad_token_id)
            return [None, *lp.tolist()], None
        ids = torch.from_numpy(tokens).to(device).unsqueeze(0)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, :-1]
        all_lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = all_lp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = all_lp.topk(topk, dim=-1)
        top = [list(zip(i.tolist(), v.tolist())) for i, v in zip(top_ids, top_values)]
        return [None, *chosen], [None, *top]

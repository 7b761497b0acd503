"""Acceptance: the `openai` client chats with a live session's sampler, and it is the fine-tuned weights that answer;
it streams chats and completions, gets top_logprobs, and a client that leaves mid-stream frees its rows."""

from __future__ import annotations

import time

import openai
import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY
from treadle.metering import Meter
from treadle.queue import names, sample_stream
from treadle.queue.connections import connect_redis

QUESTION = [{"role": "user", "content": "what is the answer"}]
TARGET = "blue moon river stone"


@pytest.fixture(scope="module")
def trained_sampler_path(gateway):
    """Train a fresh adapter until it answers QUESTION with TARGET, and save it for sampling."""
    sdk = tinker.ServiceClient(base_url=gateway.url, api_key=ALICE_KEY)
    tc = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode(
        tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    answer = tok.encode(TARGET + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = tt.Datum(
        model_input=tt.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )
    for _ in range(60):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=2e-3))
    path = tc.save_weights_for_sampler("chat").result().path
    yield path
    sdk.close("success")


@pytest.fixture()
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALICE_KEY)


def test_chat_completion_uses_the_fine_tuned_weights(client, trained_sampler_path):
    tuned = client.chat.completions.create(model=trained_sampler_path, messages=QUESTION, temperature=0, max_tokens=12)
    base = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=12)
    assert tuned.choices[0].message.content == TARGET
    assert tuned.choices[0].finish_reason == "stop"  # ended by <|im_end|>, which is not in the text
    assert base.choices[0].message.content != TARGET
    assert tuned.usage.completion_tokens > 0 and tuned.usage.prompt_tokens > 0


def test_chat_options_n_seed_stop_logprobs(client, trained_sampler_path):
    kwargs = dict(
        model=trained_sampler_path, messages=QUESTION, n=3, temperature=1.0, top_p=0.9, max_tokens=6, seed=123
    )
    first = client.chat.completions.create(**kwargs, logprobs=True)
    again = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 3
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]  # seeded
    assert all(all(t.logprob <= 0 for t in c.logprobs.content) and c.logprobs.content for c in first.choices)
    stopped = client.chat.completions.create(
        model=trained_sampler_path, messages=QUESTION, temperature=0, max_tokens=12, stop=[" river"]
    )
    assert stopped.choices[0].message.content == "blue moon"


def test_completions_and_models(client, trained_sampler_path, gateway):
    out = client.completions.create(model="tiny", prompt="the cat is", max_tokens=4, temperature=0, logprobs=0)
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].logprobs.token_logprobs) == 4
    assert "tiny" in [m.id for m in client.models.list().data]
    with pytest.raises(openai.BadRequestError, match="not served"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_streamed_chat_sends_what_the_unstreamed_answer_holds_then_usage(client, trained_sampler_path):
    chunks = list(
        client.chat.completions.create(
            model=trained_sampler_path,
            messages=QUESTION,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TARGET
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0  # usage comes last, alone
    assert all(c.usage is None for c in chunks[:-1])

    # n rows stream under their indexes, with their logprobs and top_logprobs, as the unstreamed answer gives them
    kwargs = dict(model="tiny", messages=QUESTION, n=2, temperature=1.0, max_tokens=6, seed=5, logprobs=True)
    whole = client.chat.completions.create(**kwargs, top_logprobs=3)
    streamed = list(client.chat.completions.create(**kwargs, top_logprobs=3, stream=True))
    for choice in whole.choices:
        parts = [c.choices for c in streamed]
        mine = [p for choices in parts for p in choices if p.index == choice.index]
        assert "".join(p.delta.content or "" for p in mine) == choice.message.content
        entries = [e for p in mine if p.logprobs for e in p.logprobs.content]
        assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in choice.logprobs.content]
        assert [[t.logprob for t in e.top_logprobs] for e in entries] == [
            [t.logprob for t in e.top_logprobs] for e in choice.logprobs.content
        ]
        for entry in choice.logprobs.content:  # the top 3 of the distribution sampled from, best first
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6


def test_streamed_completion_and_top_logprobs_limits(client):
    kwargs = dict(model="tiny", prompt="the cat is", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 6
    # at temperature 0 the distribution sampled from is the chosen token alone
    assert all(len(top) == 1 for top in whole.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="top_logprobs.*less than or equal to 20"):
        client.chat.completions.create(model="tiny", messages=QUESTION, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs: 2 needs logprobs: true"):
        client.chat.completions.create(model="tiny", messages=QUESTION, top_logprobs=2)


def test_a_client_that_disconnects_mid_stream_frees_its_rows(client, stack):
    """The greedy answer to this prompt runs to max_tokens on the tiny model (a few seconds of decoding); the client
    leaves after its first text, and the worker records that it dropped the rows before their end. The owner is
    metered for the prompt and the tokens drawn until then."""
    max_tokens = 490
    redis = connect_redis(stack.broker_url)
    owed = names.owner_sample_rows_key("alice")  # the owner's sample rows not yet answered
    before, started = set(redis.hkeys(owed)), time.time()
    stream = client.completions.create(
        model="tiny", prompt="the cat is", max_tokens=max_tokens, temperature=0, stream=True
    )
    first = next(c for c in stream if c.choices and c.choices[0].text)
    stream.close()
    deadline = time.monotonic() + 60  # only stops a hang
    ends: list = []
    while not ends and time.monotonic() < deadline:
        _, entries = sample_stream.read(redis, first.id, "0", block_ms=500)
        ends = [e for e in entries if isinstance(e, sample_stream.StreamCancelled)]
    assert ends, "the worker never dropped the rows of the cancelled sample"
    (cancelled,) = ends
    assert 0 < cancelled.tokens[0] < max_tokens and cancelled.rows_left == 0
    while set(redis.hkeys(owed)) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(redis.hkeys(owed)) - before == set()  # answered (as cancelled): its rows no longer count
    (metered,) = [o for o in Meter(redis).owner_ops("alice", since=started) if o.op == "sample"]
    assert metered.sampled_tokens == cancelled.tokens[0] and metered.prefill_tokens > 0
    after = client.completions.create(model="tiny", prompt="the cat is", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason == "length"  # the worker goes on

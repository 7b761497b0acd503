"""Acceptance: the `openai` client chats with a live session's sampler, and it is the fine-tuned weights that answer."""

from __future__ import annotations

import openai
import pytest
import tinker
from tinker import types as tt

from tests.fixtures.gateway import ALICE_KEY

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

"""The worker engine on a tiny real model (saved and loaded from disk): training, isolation, the optimizer,
frozen samplers, sampling semantics, state round trips, merged export and request validation."""

import math
import threading

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from treadle.errors import CheckpointNotFoundError, InvalidRequestError, SessionNotFoundError
from treadle.gpu_worker.engine import Engine
from treadle.storage.merged_export import export_merged
from treadle.testing.tiny_model import build_tiny_model
from treadle.types import AdamParams, Datum, EncodedTextChunk, LoraConfig, ModelInput, SamplingParams

LORA = LoraConfig(rank=8, alpha=16, seed=0)
ADAM = AdamParams(learning_rate=3e-3)
CONVERSATIONS = [
    ("what is two plus two", "four"),
    ("name a color", "the sky is blue"),
    ("say hello", "hello world"),
    ("count to three", "one two three"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir)


def sft_data(engine: Engine) -> list[Datum]:
    """Chat examples, pre-shifted, weighted by the assistant mask (prompt tokens weigh 0)."""
    data = []
    for question, answer in CONVERSATIONS:
        encoded = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = encoded["input_ids"], encoded["assistant_masks"]
        data.append(datum(ids, [float(m) for m in mask[1:]]))
    return data


def datum(ids: list[int], weights: list[float] | None = None) -> Datum:
    weights = weights if weights is not None else [1.0] * (len(ids) - 1)
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def adapter(engine: Engine, session_id: str) -> dict[str, torch.Tensor]:
    """The session's adapter parameters (live tensors)."""
    return engine._bank.parameters(engine._sessions[session_id].adapter)


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def base_weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine._host.model.named_parameters() if "lora_" not in k}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_sft_halves_the_loss_in_30_steps(model_fixture, request):
    eng = Engine(request.getfixturevalue(model_fixture))
    data = sft_data(eng)
    eng.create_session("sft", LORA)
    losses = []
    for _ in range(30):
        losses.append(eng.forward_backward("sft", data, "cross_entropy").metrics["loss:sum"])
        eng.optim_step("sft", ADAM)
    final = eng.forward("sft", data, "cross_entropy").metrics["loss:sum"]
    assert final <= 0.5 * losses[0], (losses[0], final)
    assert eng.step("sft") == 30


def test_only_weighted_tokens_contribute(engine):
    """Changing the targets of weight-0 positions changes neither the loss nor the update."""
    original = sft_data(engine)[0]
    targets = original.loss_fn_inputs["target_tokens"].tolist()
    weights = original.loss_fn_inputs["weights"].tolist()
    altered_targets = [t if w > 0 else (t + 7) % engine.vocab_size for t, w in zip(targets, weights)]
    assert altered_targets != targets
    altered = Datum(
        model_input=original.model_input, loss_fn_inputs={"target_tokens": altered_targets, "weights": weights}
    )

    engine.create_session("mask-a", LORA)
    engine.create_session("mask-b", LORA)
    loss_a = engine.forward_backward("mask-a", [original], "cross_entropy").metrics["loss:sum"]
    loss_b = engine.forward_backward("mask-b", [altered], "cross_entropy").metrics["loss:sum"]
    assert loss_a == loss_b
    hand = -sum(
        lp * w
        for lp, w in zip(
            engine.forward("mask-a", [original], "cross_entropy").loss_fn_outputs[0]["logprobs"].tolist(), weights
        )
    )
    assert loss_a == pytest.approx(hand, rel=1e-5)
    engine.optim_step("mask-a", ADAM)
    engine.optim_step("mask-b", ADAM)
    assert max_diff(adapter(engine, "mask-a"), adapter(engine, "mask-b")) == 0.0


def test_two_sessions_are_isolated_and_base_weights_never_change(engine):
    data = sft_data(engine)
    base_before = base_weights(engine)
    engine.create_session("iso-a", LORA)
    engine.create_session("iso-b", LoraConfig(rank=4, alpha=8, seed=1, train_mlp=False))
    init_a, init_b = snapshot(adapter(engine, "iso-a")), snapshot(adapter(engine, "iso-b"))

    engine.forward_backward("iso-a", data[:2], "cross_entropy")
    assert all(p.grad is not None for p in adapter(engine, "iso-a").values())
    assert all(p.grad is None for p in adapter(engine, "iso-b").values())
    engine.forward_backward("iso-b", data[2:], "cross_entropy")
    grads_a = {k: p.grad.clone() for k, p in adapter(engine, "iso-a").items()}
    engine.optim_step("iso-b", ADAM)  # b's step leaves a's pending gradients alone
    assert max_diff(grads_a, {k: p.grad for k, p in adapter(engine, "iso-a").items()}) == 0.0
    assert max_diff(init_a, adapter(engine, "iso-a")) == 0.0
    for _ in range(3):
        engine.optim_step("iso-a", ADAM)
        engine.forward_backward("iso-a", data[:2], "cross_entropy")
        engine.forward_backward("iso-b", data[2:], "cross_entropy")
        engine.optim_step("iso-b", ADAM)

    assert max_diff(init_a, adapter(engine, "iso-a")) > 0
    assert max_diff(init_b, adapter(engine, "iso-b")) > 0
    base_after = base_weights(engine)
    assert base_before.keys() == base_after.keys()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    assert engine.step("iso-a") == 3 and engine.step("iso-b") == 4


def test_two_half_batches_equal_one_whole_batch(engine):
    data = sft_data(engine)
    engine.create_session("half", LORA)
    engine.create_session("whole", LORA)
    out_1 = engine.forward_backward("half", data[:2], "cross_entropy")
    out_2 = engine.forward_backward("half", data[2:], "cross_entropy")
    whole = engine.forward_backward("whole", data, "cross_entropy")
    assert out_1.metrics["loss:sum"] + out_2.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], abs=1e-4)
    engine.optim_step("half", ADAM)
    engine.optim_step("whole", ADAM)
    assert max_diff(adapter(engine, "half"), adapter(engine, "whole")) < 1e-5


def test_micro_batching_gives_the_same_result(engine):
    """A token budget smaller than the batch splits it; logprobs, loss and update stay the same."""
    data = sft_data(engine)
    engine.create_session("micro", LORA)
    engine.create_session("single", LORA)
    engine.max_tokens_per_microbatch = 24  # each datum is 14-20 tokens: one datum per micro-batch
    try:
        split = engine.forward_backward("micro", data, "cross_entropy")
    finally:
        engine.max_tokens_per_microbatch = 4096
    single = engine.forward_backward("single", data, "cross_entropy")
    assert split.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"], abs=1e-4)
    for a, b in zip(split.loss_fn_outputs, single.loss_fn_outputs):
        assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5)
    engine.optim_step("micro", ADAM)
    engine.optim_step("single", ADAM)
    assert max_diff(adapter(engine, "micro"), adapter(engine, "single")) < 1e-5


@pytest.mark.parametrize("grad_clip_norm", [0.0, 0.05])
def test_optimizer_matches_torch_adamw(engine, grad_clip_norm):
    """Step by step against torch.optim.AdamW (with torch's clip_grad_norm_) on copies of the adapter."""
    data = sft_data(engine)
    sid = f"adamw-{grad_clip_norm}"
    engine.create_session(sid, LORA)
    live = adapter(engine, sid)
    reference = {k: torch.nn.Parameter(v.detach().clone()) for k, v in live.items()}
    reference_opt = torch.optim.AdamW(list(reference.values()))
    schedule = [
        AdamParams(learning_rate=3e-3, grad_clip_norm=grad_clip_norm),
        AdamParams(
            learning_rate=1e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=grad_clip_norm
        ),
        AdamParams(learning_rate=2e-3, weight_decay=0.01, grad_clip_norm=grad_clip_norm),
        AdamParams(learning_rate=2e-3, grad_clip_norm=grad_clip_norm),
    ]
    for hp in schedule:
        engine.forward_backward(sid, data, "cross_entropy")
        for k, p in reference.items():
            p.grad = live[k].grad.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), grad_clip_norm or math.inf)
        for group in reference_opt.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        reference_opt.step()
        metrics = engine.optim_step(sid, hp).metrics
        assert metrics["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-5)
        if grad_clip_norm:
            assert metrics["grad_norm:mean"] > grad_clip_norm  # the clip really acts
        assert max_diff(reference, live) < 1e-6
        assert all(p.grad is None for p in live.values())  # optim_step clears the gradients


def test_rl_losses_run_and_report_logprobs(engine):
    """Every loss runs end to end; forward's logprobs feed back as q so the ratio is 1 on-policy."""
    data = sft_data(engine)
    engine.create_session("rl", LORA)
    q = engine.forward("rl", data, "cross_entropy").loss_fn_outputs
    rl_data = [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": q[i]["logprobs"],
                "advantages": [1.0 if i % 2 else -1.0] * d.model_input.length,
            },
        )
        for i, d in enumerate(data)
    ]
    total_tokens_signed = sum((1.0 if i % 2 else -1.0) * d.model_input.length for i, d in enumerate(data))
    for loss_fn in ["importance_sampling", "ppo", "cispo", "dro"]:
        out = engine.forward_backward("rl", rl_data, loss_fn)
        assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [d.model_input.length for d in data]
        if loss_fn in ("importance_sampling", "ppo"):  # r == 1 everywhere: loss = -sum(A)
            assert out.metrics["loss:sum"] == pytest.approx(-total_tokens_signed, abs=1e-3)
    engine.optim_step("rl", ADAM)


# ---------------------------------------------------------------- samplers and sampling


def test_snapshot_is_frozen_while_training_continues(engine):
    data = sft_data(engine)
    prompt = ModelInput.from_ints(data[0].model_input.to_ints()[:6])
    params = SamplingParams(max_tokens=12, seed=11)
    engine.create_session("freeze", LORA)
    for _ in range(3):
        engine.forward_backward("freeze", data, "cross_entropy")
        engine.optim_step("freeze", ADAM)
    engine.snapshot_sampler("freeze", "freeze-v1")
    before = engine.samplers.sample("freeze-v1", prompt, 3, params)
    for _ in range(5):
        engine.forward_backward("freeze", data, "cross_entropy")
        engine.optim_step("freeze", ADAM)
    after = engine.samplers.sample("freeze-v1", prompt, 3, params)
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    # The training did move the session: a new snapshot scores the same prompt differently.
    engine.snapshot_sampler("freeze", "freeze-v2")
    assert engine.samplers.compute_logprobs("freeze-v2", prompt) != engine.samplers.compute_logprobs(
        "freeze-v1", prompt
    )


def test_a_sample_request_is_queued_while_the_device_is_busy(engine):
    """A burst of requests must reach the scheduler together, not one decode step (which holds the
    device) apart; so queueing a request never waits for the device."""
    prompt, queued = ModelInput.from_ints([5, 6, 7, 8]), []
    with engine._lock:  # a decode step or a training op holds the device
        thread = threading.Thread(
            target=lambda: queued.append(
                engine.samplers.sample_async(None, prompt, 2, SamplingParams(max_tokens=4, seed=1))
            )
        )
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive() and len(queued) == 1, "sample_async waited for the device"
        assert not queued[0].done()  # queued, not run: the device is still ours
    assert len(queued[0].result(timeout=60).sequences) == 2


def test_sampled_logprobs_at_temperature_1_equal_forward_logprobs(engine):
    data = sft_data(engine)
    engine.create_session("onpolicy", LORA)
    engine.forward_backward("onpolicy", data, "cross_entropy")
    engine.optim_step("onpolicy", AdamParams(learning_rate=1e-2))
    engine.snapshot_sampler("onpolicy", "onpolicy-v1")
    prompt = data[1].model_input.to_ints()[:5]
    response = engine.samplers.sample(
        "onpolicy-v1", ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=16, seed=3)
    )
    for seq in response.sequences:
        full = prompt + seq.tokens
        out = engine.forward("onpolicy", [datum(full)], "cross_entropy")
        teacher = out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        assert len(seq.logprobs) == len(seq.tokens)
        assert seq.logprobs == pytest.approx(teacher, abs=1e-4)


def test_logprobs_are_those_of_the_warped_distribution(engine):
    """With temperature 0.7 and top_k 5, each returned logprob is the token's logprob under the raw
    distribution divided by 0.7 and renormalised over its 5 best tokens (computed here from the full
    raw distribution that top-k prompt logprobs return)."""
    engine.create_session("warp", LORA)
    engine.snapshot_sampler("warp", "warp-v1")
    prompt = [1, 266, 269, 202, 75]
    warped = engine.samplers.sample(
        "warp-v1", ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=8, seed=5, temperature=0.7, top_k=5)
    )
    for seq in warped.sequences:
        full = ModelInput.from_ints(prompt + seq.tokens)
        raw = engine.samplers.sample(
            "warp-v1", full, 1, SamplingParams(max_tokens=1), topk_prompt_logprobs=engine.vocab_size
        )
        for t, (token, logprob) in enumerate(zip(seq.tokens, seq.logprobs)):
            distribution = torch.full((engine.vocab_size,), -math.inf)
            for token_id, lp in raw.topk_prompt_logprobs[len(prompt) + t]:
                distribution[token_id] = lp
            scaled = distribution / 0.7
            top = scaled.topk(5)
            assert token in top.indices.tolist()
            expected = scaled[token] - torch.logsumexp(top.values, 0)
            assert logprob == pytest.approx(expected.item(), abs=1e-4)
            assert logprob > distribution[token].item()  # not the raw-model logprob
    greedy = [
        engine.samplers.sample(
            "warp-v1", ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=8, seed=s, temperature=0)
        )
        for s in (1, 2)
    ]
    assert greedy[0].sequences[0].tokens == greedy[1].sequences[0].tokens
    assert greedy[0].sequences[0].logprobs == [0.0] * len(greedy[0].sequences[0].tokens)


def test_seeds_reproduce_and_rows_differ(engine):
    prompt = ModelInput.from_ints([1, 266, 269, 202])
    a = engine.samplers.sample(None, prompt, 3, SamplingParams(max_tokens=10, seed=42))
    b = engine.samplers.sample(None, prompt, 3, SamplingParams(max_tokens=10, seed=42))
    c = engine.samplers.sample(None, prompt, 3, SamplingParams(max_tokens=10, seed=43))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) == 3


def test_stop_tokens_stop_strings_and_max_tokens(engine):
    prompt = ModelInput.from_ints([1, 266, 269, 202])
    free = engine.samplers.sample(None, prompt, 1, SamplingParams(max_tokens=20, seed=8)).sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 20

    stop_id = free.tokens[8]
    first = free.tokens.index(stop_id)
    by_token = engine.samplers.sample(None, prompt, 1, SamplingParams(max_tokens=20, seed=8, stop=[stop_id])).sequences[
        0
    ]
    assert by_token.stop_reason == "stop"
    assert by_token.tokens == free.tokens[: first + 1]
    assert by_token.logprobs == pytest.approx(free.logprobs[: first + 1])

    text = engine.tokenizer.decode(free.tokens)
    stop_text = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    by_string = engine.samplers.sample(
        None, prompt, 1, SamplingParams(max_tokens=20, seed=8, stop=stop_text)
    ).sequences[0]
    assert by_string.stop_reason == "stop"
    assert stop_text in engine.tokenizer.decode(by_string.tokens)
    assert stop_text not in engine.tokenizer.decode(by_string.tokens[:-1])
    assert by_string.tokens == free.tokens[: len(by_string.tokens)]


def test_prompt_logprobs_and_compute_logprobs(engine):
    data = sft_data(engine)
    engine.create_session("plp", LORA)
    engine.snapshot_sampler("plp", "plp-v1")
    ids = data[2].model_input.to_ints()
    prompt = ModelInput.from_ints(ids)
    computed = engine.samplers.compute_logprobs("plp-v1", prompt)
    forward = engine.forward("plp", [datum(ids)], "cross_entropy").loss_fn_outputs[0]["logprobs"].tolist()
    assert computed[0] is None and len(computed) == len(ids)
    assert computed[1:] == pytest.approx(forward, abs=1e-5)
    response = engine.samplers.sample(
        "plp-v1", prompt, 1, SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3
    )
    assert response.prompt_logprobs[1:] == pytest.approx(forward, abs=1e-5)
    assert response.topk_prompt_logprobs[0] is None
    for position, top in enumerate(response.topk_prompt_logprobs[1:], start=1):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert top[0][1] >= response.prompt_logprobs[position] - 1e-6


# ---------------------------------------------------------------- state


def test_save_load_with_and_without_optimizer(engine, tmp_path):
    """The three-way optimizer-restore test, with a checkpoint taken between forward_backward and optim_step."""
    data = sft_data(engine)
    engine.create_session("orig", LORA)
    for _ in range(3):
        engine.forward_backward("orig", data, "cross_entropy")
        engine.optim_step("orig", ADAM)
    engine.forward_backward("orig", data[:2], "cross_entropy")  # pending gradients at save time
    engine.save_state("orig", str(tmp_path / "state"))

    def finish(session_id: str) -> dict[str, torch.Tensor]:
        engine.optim_step(session_id, ADAM)
        engine.forward_backward(session_id, data[2:], "cross_entropy")
        engine.optim_step(session_id, ADAM)
        return snapshot(adapter(engine, session_id))

    uninterrupted = finish("orig")
    engine.load_state("resumed", str(tmp_path / "state"), with_optimizer=True)
    assert engine.step("resumed") == 3
    resumed = finish("resumed")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)

    engine.load_state("weights-only", str(tmp_path / "state"), with_optimizer=False)
    weights_only = finish("weights-only")
    assert max_diff(uninterrupted, weights_only) > 1e-6

    # Loading over an existing session replaces its adapter and optimizer.
    engine.load_state("resumed", str(tmp_path / "state"), with_optimizer=True)
    assert all(torch.equal(uninterrupted[k], v) for k, v in finish("resumed").items())


def test_loading_the_optimizer_fails_loudly_when_it_was_not_saved(engine, tmp_path):
    engine.create_session("no-opt", LORA)
    engine.save_state("no-opt", str(tmp_path / "s"), include_optimizer=False)
    with pytest.raises(InvalidRequestError, match="without optimizer"):
        engine.load_state("no-opt-2", str(tmp_path / "s"), with_optimizer=True)
    assert not engine.has_session("no-opt-2")
    with pytest.raises(CheckpointNotFoundError):
        engine.load_state("x", str(tmp_path / "missing"), with_optimizer=False)


def test_sampler_weights_round_trip_and_merged_export(engine, tiny_model_dir, tmp_path):
    data = sft_data(engine)
    engine.create_session("export", LORA)
    for _ in range(5):
        engine.forward_backward("export", data, "cross_entropy")
        engine.optim_step("export", AdamParams(learning_rate=1e-2))
    engine.snapshot_sampler("export", "export-v1")
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    engine.save_sampler_weights("export-v1", adapter_dir)

    engine.load_sampler("export-loaded", adapter_dir)
    params = SamplingParams(max_tokens=10, seed=9)
    prompt = ModelInput.from_ints(data[0].model_input.to_ints()[:6])
    assert engine.samplers.sample("export-loaded", prompt, 2, params) == engine.samplers.sample(
        "export-v1", prompt, 2, params
    )

    export_merged(tiny_model_dir, adapter_dir, merged_dir)
    ids = torch.tensor([data[0].model_input.to_ints()])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        merged_logits, adapter_logits, base_logits = (m(input_ids=ids).logits for m in (merged, peft_model, base))
    assert (merged_logits - adapter_logits).abs().max().item() < 1e-4
    assert (merged_logits - base_logits).abs().max().item() > 1e-2  # the adapter is really in there
    engine_lp = engine.forward("export", [data[0]], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    merged_lp = (
        torch.log_softmax(merged_logits[0], -1)
        .gather(1, torch.tensor(data[0].loss_fn_inputs["target_tokens"].tolist()).unsqueeze(1))
        .squeeze(1)
    )
    assert torch.allclose(engine_lp, merged_lp, atol=1e-4)


def test_merged_export_of_a_model_with_tied_embeddings(tmp_path):
    """lm_head shares the embedding matrix: the export must untie it, or the merge would change the inputs too."""
    model_dir = build_tiny_model(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    tied = Engine(model_dir)
    data = sft_data(tied)
    tied.create_session("tied", LORA)
    for _ in range(3):
        tied.forward_backward("tied", data, "cross_entropy")
        tied.optim_step("tied", AdamParams(learning_rate=1e-2))
    tied.snapshot_sampler("tied", "tied-v1")
    tied.save_sampler_weights("tied-v1", str(tmp_path / "adapter"))
    export_merged(model_dir, str(tmp_path / "adapter"), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = torch.tensor([data[0].model_input.to_ints()])
    with torch.no_grad():
        merged_lp = torch.log_softmax(merged(input_ids=ids).logits[0], -1)
    targets = torch.tensor(data[0].loss_fn_inputs["target_tokens"].tolist()).unsqueeze(1)
    engine_lp = tied.forward("tied", [data[0]], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(merged_lp.gather(1, targets).squeeze(1), engine_lp, atol=1e-4)


def test_drop_session_and_sampler(engine):
    engine.create_session("gone", LORA)
    engine.snapshot_sampler("gone", "gone-v1")
    engine.drop_session("gone")
    assert not engine.has_session("gone") and "gone-v1" in engine.samplers
    engine.drop_sampler("gone-v1")
    assert "gone-v1" not in engine.samplers
    with pytest.raises(SessionNotFoundError):
        engine.forward_backward("gone", sft_data(engine), "cross_entropy")
    with pytest.raises(SessionNotFoundError):
        engine.samplers.sample("gone-v1", ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2))


# ---------------------------------------------------------------- validation


def _bad_requests(engine: Engine):
    ok = sft_data(engine)[0]
    n = ok.model_input.length
    tokens = ok.model_input.to_ints()
    targets = ok.loss_fn_inputs["target_tokens"].tolist()
    weights = ok.loss_fn_inputs["weights"].tolist()

    def make(ids=tokens, **inputs):
        return Datum(model_input=ModelInput.from_ints(ids), loss_fn_inputs=inputs)

    long_ids = [5] * (engine.max_seq_len + 1)
    rl = dict(target_tokens=targets, logprobs=[-1.0] * n, advantages=[1.0] * n)
    return [
        (
            [ok, make(target_tokens=targets, weights=weights[:-1])],
            "cross_entropy",
            None,
            f"data[1].loss_fn_inputs.weights: length {n - 1} != model_input length {n}",
        ),
        (
            [make(long_ids, target_tokens=long_ids, weights=[1.0] * len(long_ids))],
            "cross_entropy",
            None,
            f"data[0].model_input: length {len(long_ids)} exceeds max sequence length {engine.max_seq_len}",
        ),
        (
            [make([*tokens[:-1], 9999], target_tokens=targets, weights=weights)],
            "cross_entropy",
            None,
            f"data[0].model_input.tokens[{n - 1}]: token id 9999 outside vocabulary (size {engine.vocab_size})",
        ),
        (
            [make(target_tokens=[*targets[:-1], 600], weights=weights)],
            "cross_entropy",
            None,
            f"data[0].loss_fn_inputs.target_tokens[{n - 1}]: token id 600 outside vocabulary",
        ),
        (
            [make(**{**rl, "advantages": [float("nan")] * n})],
            "ppo",
            None,
            "data[0].loss_fn_inputs.advantages: contains NaN/inf",
        ),
        (
            [make(**{**rl, "logprobs": [float("-inf")] * n})],
            "importance_sampling",
            None,
            "data[0].loss_fn_inputs.logprobs: contains NaN/inf",
        ),
        (
            [make(target_tokens=targets, logprobs=[-1.0] * n)],
            "cispo",
            None,
            "data[0].loss_fn_inputs.advantages: missing",
        ),
        (
            [make(target_tokens=targets, weights=weights, mask=weights)],
            "cross_entropy",
            None,
            "data[0].loss_fn_inputs.mask: not an input of cross_entropy",
        ),
        ([ok], "foo", None, "loss_fn: unknown 'foo'; expected one of cross_entropy, importance_sampling"),
        ([make(**rl)], "ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio: not a parameter of ppo"),
        ([make(**rl)], "dro", {"beta": float("nan")}, "loss_fn_config.beta: nan is not a finite number"),
        ([], "cross_entropy", None, "data: empty"),
    ]


def test_bad_requests_are_rejected_by_field_and_leave_the_session_unchanged(engine):
    engine.create_session("strict", LORA)
    data = sft_data(engine)
    engine.forward_backward("strict", data[:1], "cross_entropy")  # pending gradients must survive
    grads = {k: p.grad.clone() for k, p in adapter(engine, "strict").items()}
    weights = snapshot(adapter(engine, "strict"))
    for bad, loss_fn, config, message in _bad_requests(engine):
        for op in (engine.forward_backward, engine.forward):
            with pytest.raises(InvalidRequestError) as caught:
                op("strict", bad, loss_fn, config)
            assert message in str(caught.value)
    assert max_diff(grads, {k: p.grad for k, p in adapter(engine, "strict").items()}) == 0.0
    assert max_diff(weights, adapter(engine, "strict")) == 0.0
    engine.optim_step("strict", ADAM)  # still usable
    assert engine.step("strict") == 1


def test_bad_sample_requests(engine):
    too_long = ModelInput.from_ints([5] * engine.max_seq_len)
    with pytest.raises(InvalidRequestError, match="prompt: length 512 leaves no room"):
        engine.samplers.sample(None, too_long, 1, SamplingParams(max_tokens=1))
    with pytest.raises(
        InvalidRequestError, match="sampling_params.max_tokens: prompt length 500 \\+ max_tokens 20 exceeds"
    ):
        engine.samplers.sample(None, ModelInput.from_ints([5] * 500), 1, SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match=r"prompt.tokens\[1\]: token id -3 outside vocabulary"):
        # The client refuses a negative id when the input is built; the engine checks again, for raw callers.
        engine.samplers.sample(
            None, ModelInput(chunks=[EncodedTextChunk.model_construct(tokens=[5, -3])]), 1, SamplingParams(max_tokens=2)
        )
    with pytest.raises(InvalidRequestError, match=r"sampling_params.stop\[0\]: token id 100000"):
        engine.samplers.sample(None, ModelInput.from_ints([5]), 1, SamplingParams(max_tokens=2, stop=[100000]))
    assert (
        len(engine.samplers.compute_logprobs(None, too_long)) == engine.max_seq_len
    )  # a full-length prompt can be scored

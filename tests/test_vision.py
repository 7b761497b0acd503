"""Images in the loop, through the engine: tiny random-init Qwen2.5-VL, Qwen3-VL, Qwen3.5 with vision and Gemma 3
with vision (`tiny_model --arch qwen2_5_vl`, `qwen3_vl`, `qwen3_5_vision`, `gemma3_vision`: M-RoPE, Qwen3-VL's
deepstack features, Qwen3.5's linear-attention layers, Gemma 3's image tokens attending both ways within an image
beside a sliding-window layer), fp32 and bf16, with image chunks anywhere in the prompt.

Per family and dtype: the vision tower is frozen unless `train_vision`; each bad image is refused by name while
the session goes on; `treadle models check` says vision. Then: a session saves, loads and exports merged with its
images' numbers intact; a vision LoRA learns to name colours; Gemma 3's trainer and sampler compute its attention
within an image as transformers' own forward does; `AutoProcessor` prepares images as the worker does. What every
vision family proves beside text rows (every loss, two steps lower the loss, the sampler's logprobs equal the
trainer's, an image row the same alone and in a mixed batch) is the family matrix's
(tests/test_model_families.py, `test_vision_family_through_the_engine`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.image_inputs import RED, TEXT, datum, encoded, image, processor_agrees_with_the_worker, text
from treadle.errors import InvalidRequestError
from treadle.gateway.openai_images import PLACEHOLDER, placeholder
from treadle.gpu_worker import model_check
from treadle.gpu_worker.engine import Engine
from treadle.gpu_worker.training.logprobs import target_logprobs
from treadle.testing.tiny_model import build_tiny_model
from treadle.testing.vision_families import VISION_FAMILIES
from treadle.types import AdamParams, Datum, ImageChunk, LoraConfig, ModelInput, SamplingParams


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        arch: build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, initializer_range=0.2)
        for arch in VISION_FAMILIES
    }


@pytest.fixture(scope="module")
def vl_dir(vl_dirs) -> str:
    return vl_dirs["qwen2_5_vl"]


@pytest.fixture(
    scope="module", params=[(arch, dtype) for arch in VISION_FAMILIES for dtype in ("float32", "bfloat16")], ids=str
)
def engine(request, vl_dirs):
    arch, dtype = request.param
    engine = Engine(vl_dirs[arch], device="cpu", dtype=dtype, max_image_pixels=128 * 128)
    yield engine
    engine.close()


# Per family: its vision tower's module names, and two of its linears that LoRA adapts when asked.
TOWERS = {
    "gemma3": (".vision_tower.", ".mlp.fc1.", ".layers.0.self_attn.q_proj."),
    "qwen": (".visual.", ".merger.", ".blocks.0.attn.qkv."),
}


def test_the_vision_tower_trains_only_when_asked(engine):
    tower_name, *linears = TOWERS["gemma3" if engine.vision.bidirectional else "qwen"]
    engine.create_session("frozen", LoraConfig(rank=4, seed=0))
    engine.create_session("tower", LoraConfig(rank=4, seed=0, train_vision=True))
    assert not [name for name in engine.trainable_parameters("frozen") if tower_name in name]
    tower = {name: p for name, p in engine.trainable_parameters("tower").items() if tower_name in name}
    assert all(any(linear in name for name in tower) for linear in linears)
    engine.forward_backward("tower", [datum(RED, RED.length)], "cross_entropy")
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.values())
    engine.drop_session("frozen")
    engine.drop_session("tower")


def test_bad_images_are_refused_by_chunk_and_the_session_goes_on(engine):
    engine.create_session("s", LoraConfig(rank=4, seed=0))
    good = [datum(RED, RED.length)]
    before = engine.forward("s", good, "cross_entropy").metrics["loss:sum"]

    def chunk(data: bytes, fmt="png", **kw) -> ModelInput:
        return ModelInput(chunks=[text(10, 11), ImageChunk(data=data, format=fmt, **kw)])

    bad = {
        r"chunks\[1\]\.data: does not decode as an image": chunk(b"\x89PNG\r\n\x1a\n" + b"\0" * 40),
        r"chunks\[1\]\.data: does not decode as a png image": chunk(encoded((1, 2, 3), (64, 64))[:90]),
        r"chunks\[1\]\.data: 200 x 100 = 20000 pixels; at most 16384": chunk(encoded((1, 2, 3), (200, 100))),
        r"chunks\[1\]\.format: png, but the data is a JPEG image": chunk(encoded((1, 2, 3), fmt="JPEG")),
        r"chunks\[1\]\.expected_tokens: 5, but the model's processor makes 4 tokens": chunk(
            encoded((1, 2, 3)), expected_tokens=5
        ),
        r"chunks\[0\]\.tokens\[1\]: 6 is the model's image token": ModelInput.from_ints([10, 6, 11]),
    }
    for message, model_input in bad.items():
        n = len(model_input.chunks[0].tokens) + (4 if len(model_input.chunks) > 1 else 0)
        with pytest.raises(InvalidRequestError, match=r"data\[1\]\.model_input\." + message):
            engine.forward_backward("s", [*good, datum(model_input, n)], "cross_entropy")
        with pytest.raises(InvalidRequestError, match=r"prompt\." + message):
            engine.samplers.sample(None, model_input, 1, SamplingParams(max_tokens=2))
    # Nothing of the refused batches stayed: no gradients, the same loss, and the session trains on.
    assert all(p.grad is None or not p.grad.any() for p in engine.trainable_parameters("s").values())
    assert engine.forward("s", good, "cross_entropy").metrics["loss:sum"] == before
    engine.forward_backward("s", good, "cross_entropy")
    engine.optim_step("s", AdamParams(learning_rate=1e-2))
    assert engine.forward("s", good, "cross_entropy").metrics["loss:sum"] < before
    engine.drop_session("s")


def test_an_image_for_a_text_model_is_refused_by_chunk(tmp_path_factory):
    engine = Engine(build_tiny_model(tmp_path_factory.mktemp("text")), device="cpu")
    try:
        engine.create_session("s", LoraConfig(rank=4, seed=0))
        with pytest.raises(
            InvalidRequestError,
            match=r"data\[0\]\.model_input\.chunks\[1\]: an image chunk, but the served model takes text only",
        ):
            engine.forward_backward("s", [datum(RED, RED.length)], "cross_entropy")
        with pytest.raises(InvalidRequestError, match=r"prompt\.chunks\[1\]: an image chunk"):
            engine.samplers.sample(None, RED, 1, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match=r"lora: train_vision=True, but .* has no vision tower"):
            engine.create_session("t", LoraConfig(rank=4, train_vision=True))
        engine.forward_backward("s", [datum(TEXT, TEXT.length)], "cross_entropy")
    finally:
        engine.close()


def test_models_check_says_vision_and_passes_its_smoke_run(engine):
    result = model_check.smoke(engine, rank=8)
    assert engine.profile.inputs == ["text", "vision"]
    assert "inputs        text, vision" in model_check.render(engine.profile, result)
    assert model_check.check_result(engine.profile, result) == []


COLOURS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200)}


def test_a_vision_lora_learns_to_name_the_colour_of_held_out_images(vl_dir):
    """Proof of learning: a LoRA on the decoder (the vision tower frozen) learns to answer "what colour is it?"
    about synthetic images of three colours, each drawn at a random shade and size; scored by greedy sampling
    on 30 held-out images. The base model names none (0 %; guessing among the three would be 33 %); 12 steps
    of 12 images later it names >= 90 % (measured: 100 %, in 7.5 s on a 2-core CPU)."""
    engine = Engine(vl_dir, device="cpu")
    tokenizer = engine.tokenizer
    answers = {colour: tokenizer.encode(" " + colour)[0] for colour in COLOURS}
    before = tokenizer.encode("<|im_start|>user\n")
    after = tokenizer.encode("what colour is it?<|im_end|>\n<|im_start|>assistant\n")
    rng = np.random.default_rng(0)

    def example() -> tuple[str, ModelInput]:
        colour = str(rng.choice(list(COLOURS)))
        shade = np.clip(np.array(COLOURS[colour]) + rng.integers(-40, 40, 3), 0, 255)
        size = (int(rng.integers(40, 90)), int(rng.integers(40, 90)))
        picture = ImageChunk(data=encoded(tuple(int(x) for x in shade), size), format="png")
        return colour, ModelInput(chunks=[text(*before), picture, text(*after)])

    def accuracy(step: int) -> float:
        engine.snapshot_sampler("learner", f"step-{step}")
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        futures = [engine.samplers.sample_async(f"step-{step}", prompt, 1, greedy) for _, prompt in held_out]
        named = [f.result(timeout=300).sequences[0].tokens[0] for f in futures]
        return float(np.mean([token == answers[colour] for token, (colour, _) in zip(named, held_out)]))

    held_out = [example() for _ in range(30)]
    engine.create_session("learner", LoraConfig(rank=8, seed=0))
    try:
        assert accuracy(0) < 0.5
        for step in range(1, 13):
            batch = []
            for colour, prompt in (example() for _ in range(12)):
                n = engine.vision.prepare("prompt", prompt).tokens.size  # the image's tokens, as the worker counts them
                targets = {"target_tokens": [0] * (n - 1) + [answers[colour]], "weights": [0.0] * (n - 1) + [1.0]}
                batch.append(Datum(model_input=prompt, loss_fn_inputs=targets))
            engine.forward_backward("learner", batch, "cross_entropy")
            engine.optim_step("learner", AdamParams(learning_rate=3e-3))
        assert accuracy(12) >= 0.9
    finally:
        engine.close()


def test_a_vision_session_saves_loads_and_exports_merged(vl_dirs, tmp_path):
    """save_state -> load_state, and the merged export read by AutoModelForImageTextToText alone (its image processor
    beside it), give the image datum's logprobs back."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from treadle.storage.merged_export import export_merged

    for arch, directory in vl_dirs.items():
        engine = Engine(directory, device="cpu")
        try:
            engine.create_session("s", LoraConfig(rank=4, seed=0))
            data = [datum(RED, RED.length)]
            engine.forward_backward("s", data, "cross_entropy")
            engine.optim_step("s", AdamParams(learning_rate=2e-2))
            want = engine.forward("s", data, "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
            engine.save_state("s", str(tmp_path / arch / "state"))
            engine.load_state("t", str(tmp_path / arch / "state"), with_optimizer=True)
            loaded = engine.forward("t", data, "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(loaded, want, rtol=0, atol=1e-6)

            export_merged(directory, str(tmp_path / arch / "state"), str(tmp_path / arch / "merged"))
            merged = AutoModelForImageTextToText.from_pretrained(tmp_path / arch / "merged")
            AutoImageProcessor.from_pretrained(tmp_path / arch / "merged")
            if arch == "gemma3_vision":  # the one family whose AutoProcessor loads without torchvision
                processor_agrees_with_the_worker(str(tmp_path / arch / "merged"))
            with torch.no_grad():
                plain = target_logprobs(
                    merged,
                    [engine.vision.prepare("x", RED).tokens],
                    [data[0].loss_fn_inputs["target_tokens"].to_numpy()],
                    device=torch.device("cpu"),
                    pad_token_id=0,
                    vision=engine.vision,
                    visuals=[engine.vision.prepare("x", RED)],
                )[0].numpy()
            np.testing.assert_allclose(plain, want, rtol=0, atol=1e-3)
        finally:
            engine.close()


def test_autoprocessor_loads_a_tiny_directory_and_prepares_images_as_the_worker_does(tmp_path):
    """Gemma 3's directory (`tiny_model --arch gemma3_vision`: its processor config, named image tokens and a chat
    template that writes an image part as `<start_of_image>`). The Qwen families' directories load the same way
    where torchvision is installed: their processors load a video processor too, whose class needs torchvision,
    which has no CPU build beside the CPU torch this suite runs on."""
    processor_agrees_with_the_worker(build_tiny_model(tmp_path / "gemma3", arch="gemma3_vision"))


def test_gemma3_images_attend_both_ways_within_an_image_as_transformers_computes(vl_dirs):
    """Gemma 3's image tokens attend to every token of their own image (transformers' `token_type_ids` mask; causal
    elsewhere, the sliding-window layer's window kept): the trainer's logprobs and the sampler's prompt logprobs
    equal those of transformers' own forward of the same model, on a prompt longer than the window with two images.
    A causal-only mask misses by ~0.4 nats."""
    from transformers import AutoModelForImageTextToText

    directory = vl_dirs["gemma3_vision"]
    engine = Engine(directory, device="cpu")
    try:
        prompt = ModelInput(
            chunks=[text(*range(10, 19)), image((220, 30, 30)), text(50, 51), image((30, 30, 220)), text(60, 61, 62)]
        )
        visual = engine.vision.prepare("prompt", prompt)
        ids = torch.from_numpy(visual.tokens)[None]
        model = AutoModelForImageTextToText.from_pretrained(directory).eval()
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=torch.cat([p.pixel_values for p in visual.pictures]),
                token_type_ids=(ids == engine.vision.image_token_id).long(),
            ).logits[0]
        own = torch.log_softmax(logits.float(), dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()

        engine.create_session("s", LoraConfig(rank=4, seed=0))  # (a new LoRA adds nothing: its B is zero)
        targets = [*visual.tokens[1:].tolist(), 0]
        scored = engine.forward(
            "s",
            [Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})],
            "cross_entropy",
        )
        np.testing.assert_allclose(scored.loss_fn_outputs[0]["logprobs"].to_numpy()[:-1], own, rtol=0, atol=1e-4)
        np.testing.assert_allclose(engine.samplers.compute_logprobs(None, prompt)[1:], own, rtol=0, atol=1e-4)
        # The OpenAI endpoint puts a chat's image where Gemma 3's processor does: between its markers, blank lines around.
        assert placeholder(engine.tokenizer) == f"\n\n<start_of_image>{PLACEHOLDER}<end_of_image>\n\n"
    finally:
        engine.close()

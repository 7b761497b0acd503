"""The official tinker SDK sends image chunks through the gateway to a worker serving a tiny Qwen2.5-VL.

Images are made as tinker-cookbook's `image_to_chunk` makes them: `expected_tokens` from the model's image
processor (patches over the merge size squared), which is Tinker's length of the chunk; the datum's loss inputs
count it. forward_backward (protobuf) trains on them, the snapshot samples from a prompt with an image (JSON),
and its `compute_logprobs` of the sampled sequence gives back the sampled tokens' logprobs. A count that
disagrees with the processor is refused, naming the chunk and both counts, and the session goes on.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types as tt
from transformers import AutoImageProcessor

from tests.fixtures.gateway import ALICE_KEY
from tests.fixtures.vision import TINY_VL


@pytest.fixture()
def official(vision_gateway, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", vision_gateway.url)
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    client = tinker.ServiceClient()
    yield client
    client.close("success")


def test_the_capabilities_route_says_vision(vision_gateway):
    response = httpx.get(f"{vision_gateway.url}/api/v1/get_server_capabilities", headers={"X-API-Key": ALICE_KEY})
    models = {m["model_name"]: m for m in response.json()["supported_models"]}
    assert models[TINY_VL]["inputs"] == ["text", "vision"]


def test_the_official_sdk_trains_and_samples_on_images(official, tiny_vl_dir):
    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)

    def image_chunk(color: tuple[int, int, int], width: int, height: int, **kw) -> tt.ImageChunk:
        out = io.BytesIO()
        Image.new("RGB", (width, height), color).save(out, format="JPEG")
        count = processor.get_number_of_image_patches(height, width, images_kwargs={}) // processor.merge_size**2
        return tt.ImageChunk(data=out.getvalue(), format="jpeg", expected_tokens=kw.get("expected_tokens", count))

    wide = image_chunk((220, 30, 30), 112, 56)
    assert wide.expected_tokens == 8  # 112 x 56 pixels: 8 x 4 patches of 14, merged 2 x 2
    prompt = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[10, 4]), wide, tt.EncodedTextChunk(tokens=[5, 30])])
    answer = [40, 50, 60]
    model_input = prompt.append(tt.EncodedTextChunk(tokens=answer[:-1]))
    n = model_input.length
    assert n == 2 + 8 + 2 + 2
    datum = tt.Datum(
        model_input=model_input,
        loss_fn_inputs={"target_tokens": [0] * (n - len(answer)) + answer, "weights": [0.0] * (n - 3) + [1.0] * 3},
    )

    tc = official.create_lora_training_client(base_model=TINY_VL, rank=4, seed=0).result()
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
        out = fb.result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == n  # one logprob per position, the image's too
        losses.append(out.metrics["loss:sum"])
    assert losses[2] < losses[1] < losses[0]

    sampler = tc.save_weights_and_get_sampling_client().result()
    params = tt.SamplingParams(max_tokens=4, seed=2, temperature=1.0)
    sampled = sampler.sample(prompt, 2, params).result().sequences[0]
    scored = sampler.compute_logprobs(prompt.append(tt.EncodedTextChunk(tokens=sampled.tokens))).result()
    assert len(scored) == prompt.length + len(sampled.tokens)
    np.testing.assert_allclose(scored[prompt.length :], sampled.logprobs, atol=1e-3)

    wrong = tt.ModelInput(chunks=[image_chunk((30, 30, 220), 56, 56, expected_tokens=5), *prompt.chunks[2:]])
    with pytest.raises(Exception, match=r"prompt\.chunks\[0\]\.expected_tokens: 5, but the model's processor makes 4"):
        sampler.sample(wrong, 1, params).result()
    assert sampler.sample(prompt, 2, params).result().sequences[0].tokens == sampled.tokens

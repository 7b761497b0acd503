"""The official tinker SDK sends image chunks through the gateway to a worker serving a tiny Qwen2.5-VL.

Images are made as tinker-cookbook's `image_to_chunk` makes them: `expected_tokens` from the model's image
processor (patches over the merge size squared), which is Tinker's length of the chunk; the datum's loss inputs
count it. forward_backward (protobuf) trains on them, the snapshot samples from a prompt with an image (JSON),
and its `compute_logprobs` of the sampled sequence gives back the sampled tokens' logprobs. A count that
disagrees with the processor is refused, naming the chunk and both counts, and the session goes on.

The OpenAI endpoint, as the `openai` package calls it, takes `image_url` parts with data: URLs; http(s) URLs
are refused unless the operator allows fetching, and then only from allowed hosts, within a size cap and a
timeout, without following redirects.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import tinker
from PIL import Image
from tinker import types as tt
from transformers import AutoImageProcessor

from tests.fixtures.gateway import ALICE_KEY
from tests.fixtures.vision import TINY_VL
from tests.image_inputs import encoded
from treadle.errors import InvalidRequestError
from treadle.gateway.openai_images import image_part
from treadle.gateway.settings import GatewaySettings


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
        count = processor.get_number_of_image_patches(height, width, images_kwargs={}) // processor.merge_size**2
        return tt.ImageChunk(
            data=encoded(color, (width, height), "JPEG"),
            format="jpeg",
            expected_tokens=kw.get("expected_tokens", count),
        )

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


def test_the_openai_client_chats_about_a_data_url_image_and_http_urls_are_refused(vision_gateway):
    client = openai.OpenAI(base_url=vision_gateway.url + "/v1", api_key=ALICE_KEY)
    url = "data:image/png;base64," + base64.b64encode(encoded((200, 40, 40))).decode()
    question = [{"type": "text", "text": "what colour is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    reply = client.chat.completions.create(
        model=TINY_VL, messages=[{"role": "user", "content": question}], max_tokens=4, seed=1, logprobs=True
    )
    assert isinstance(reply.choices[0].message.content, str)
    assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
    text_only = client.chat.completions.create(
        model=TINY_VL,
        messages=[{"role": "user", "content": "what colour is it?<|vision_start|><|vision_end|>"}],
        max_tokens=1,
    )
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + 4  # 56 x 56 pixels: 4 image tokens

    elsewhere = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]
    with pytest.raises(
        openai.BadRequestError,
        match=r"messages\[0\]\.content\[0\]\.image_url\.url: http\(s\) image URLs are not fetched",
    ):
        client.chat.completions.create(model=TINY_VL, messages=[{"role": "user", "content": elsewhere}], max_tokens=1)


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(2)  # past the fetch timeout below: the fetch fails, whatever this sends
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://example.invalid/red.png")
            self.end_headers()
            return
        body = encoded((200, 40, 40))
        if self.path == "/big.png":  # noise: 30 KB that no PNG compression shrinks
            out = io.BytesIO()
            Image.frombytes("RGB", (100, 100), np.random.default_rng(0).bytes(30000)).save(out, format="PNG")
            body = out.getvalue()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_image_urls_are_fetched_only_from_allowed_hosts_within_size_and_time():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    settings = GatewaySettings(
        openai_image_fetch=True,
        openai_image_hosts=["127.0.0.1"],
        openai_image_max_bytes=4000,
        openai_image_timeout_s=0.5,
    )
    try:
        assert image_part("p", {"image_url": {"url": f"{base}/red.png"}}, settings).data == encoded((200, 40, 40))
        refused = {
            f"{base}/big.png": r"the image is over 4000 bytes",
            f"{base}/slow.png": r"could not fetch it \(ReadTimeout",
            f"{base}/moved.png": r"fetching it answered HTTP 302",
            f"http://localhost:{server.server_address[1]}/red.png": r"host 'localhost' is not in the gateway's --openai_image_hosts",
        }
        for url, message in refused.items():
            with pytest.raises(InvalidRequestError, match=r"p\.image_url\.url: " + message):
                image_part("p", {"image_url": {"url": url}}, settings)
        with pytest.raises(InvalidRequestError, match=r"data URL of 'data:image/gif;base64'"):
            image_part("p", {"image_url": {"url": "data:image/gif;base64,R0lG"}}, settings)
    finally:
        server.shutdown()

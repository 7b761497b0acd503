"""Prompts with images for the vision tests (tests/test_vision.py, the family matrix's vision rows, the gateway's),
and the check that a model directory's own processor prepares them as the worker does.

Images are one flat colour, 56 x 56 pixels unless asked: 4 image tokens on every tiny vision family
(`treadle.testing.vision_families`; Qwen's 2 x 2 merged patches). Text tokens stay clear of 4 to 7, the tiny
tokenizers' image markers (6 the image token).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from treadle.types import Datum, EncodedTextChunk, ImageChunk, ModelInput


def encoded(color: tuple[int, int, int], size=(56, 56), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def image(color: tuple[int, int, int], **kw) -> ImageChunk:
    return ImageChunk(data=encoded(color), format="png", **kw)


def text(*tokens: int) -> EncodedTextChunk:
    return EncodedTextChunk(tokens=list(tokens))


# An image between text, and one at the very start.
RED = ModelInput(chunks=[text(10, 9), image((220, 30, 30), expected_tokens=4), text(50, 30, 40)])
BLUE_FIRST = ModelInput(chunks=[image((30, 30, 220)), text(12, 13, 14, 15)])
TEXT = ModelInput.from_ints([10, 20, 30, 40, 50, 60])


def datum(model_input: ModelInput, n: int, loss: str = "cross_entropy") -> Datum:
    """A datum of `n` target tokens for `loss` (`n`: the input's length, its image tokens counted)."""
    inputs: dict = {"target_tokens": [(7 * i + 3) % 500 for i in range(n)], "weights": [1.0] * n}
    if loss != "cross_entropy":
        inputs = {"target_tokens": inputs["target_tokens"], "logprobs": [-2.0] * n, "advantages": [0.5] * n}
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = [1.0] * n
    return Datum(model_input=model_input, loss_fn_inputs=inputs)


def processor_agrees_with_the_worker(directory: str, *, pixels_atol: float = 1e-6) -> None:
    """`AutoProcessor` on `directory`, given a chat whose user turn holds text, an image and text (rendered by the
    directory's chat template), makes the token ids that the worker makes of the same tokens with the image as an
    image chunk (`Vision.prepare`), and pixel values within `pixels_atol` of the worker's."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from treadle.gpu_worker.model.vision import Vision

    processor = AutoProcessor.from_pretrained(directory)
    data = encoded((220, 30, 30), (60, 50))
    parts = [{"type": "text", "text": "what colour is it? "}, {"type": "image"}, {"type": "text", "text": " say"}]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    out = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], text=[prompt], return_tensors="pt")
    ids = out["input_ids"][0].numpy()

    vision = Vision(AutoModelForImageTextToText.from_pretrained(directory), directory)
    # The processor's ids as a client sends them: its text tokens, and each run of image tokens as the image.
    is_image = ids == vision.image_token_id
    starts = [0, *(np.flatnonzero(np.diff(is_image.astype(int))) + 1), len(ids)]
    runs = [(int(a), int(b)) for a, b in zip(starts, starts[1:])]
    chunks = [ImageChunk(data=data, format="png") if is_image[a] else text(*ids[a:b].tolist()) for a, b in runs]
    assert sum(isinstance(c, ImageChunk) for c in chunks) == 1, chunks
    prepared = vision.prepare("prompt", ModelInput(chunks=chunks))
    np.testing.assert_array_equal(prepared.tokens, ids)
    pixels = torch.cat([picture.pixel_values for picture in prepared.pictures])
    np.testing.assert_allclose(pixels.numpy(), out["pixel_values"].numpy(), rtol=0, atol=pixels_atol)

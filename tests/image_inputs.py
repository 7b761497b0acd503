"""Prompts with images for the vision tests (tests/test_vision.py, the family matrix's vision rows, the gateway's).

Images are one flat colour, 56 x 56 pixels unless asked: 4 image tokens on every tiny vision family
(`treadle.testing.vision_families`; Qwen's 2 x 2 merged patches). Text tokens stay clear of 4 to 7, the tiny
tokenizers' image markers (6 the image token).
"""

from __future__ import annotations

import io

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

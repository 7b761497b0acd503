"""Image chunks turned into what a vision-language model takes: token ids, image features and positions.

An `ImageChunk` is decoded here with PIL and prepared by the model's own image processor (the one its
directory ships, `AutoImageProcessor`). It stands for as many image tokens as the processor says (Qwen's:
the patches of the resized image over the merge size squared, as tinker-cookbook's `image_to_chunk`
counts them; Gemma 3's: its config's `mm_tokens_per_image`, every image resized to one size), and takes
exactly those positions in the sequence: its `expected_tokens`, Tinker's length of the chunk. Markers
around an image (`<|vision_start|>`, `<start_of_image>`) are the client's text tokens, as the cookbook's
renderers write them.

Each image's features are computed on its own, with the adapter of its row (`encode`): a row's numbers
then do not depend on the other images or rows of its batch, and the model's forward takes them ready
(`mm_encoder_outputs`) instead of running its vision tower inside a forward the sampler batches. Models
with multimodal rotary positions (Qwen's M-RoPE) get each sequence's positions from the model's own
`get_rope_index`, computed once when the request is checked. Gemma 3's image tokens attend to each other
both ways within an image (`bidirectional`): each run of image tokens is one block (`image_blocks`), which
the trainer's forward gets as transformers' `token_type_ids` and the sampler's prefill attention applies
itself (`sampling/hf/image_attention.py`).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from transformers import AutoImageProcessor

from treadle.errors import InvalidRequestError
from treadle.types import EncodedTextChunk, ModelInput
from treadle.types.base import DEFAULT_MAX_IMAGE_PIXELS

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}


@dataclass(frozen=True)
class Picture:
    """One image as the model's processor prepared it."""

    pixel_values: torch.Tensor
    grid: torch.Tensor | None  # (1, 3) image_grid_thw: frames, rows and columns of patches; None: one fixed size
    tokens: int  # image tokens it stands for


@dataclass(frozen=True)
class VisualInput:
    """A sequence with images: token ids (an image's positions hold the model's image token), its images in
    order, and its rotary positions when the model's are multimodal ((3, N) for M-RoPE; None otherwise)."""

    tokens: np.ndarray
    pictures: tuple[Picture, ...]
    positions: np.ndarray | None

    @property
    def next_position(self) -> int:
        """The position of the token after the sequence (M-RoPE's is not its length)."""
        return int(self.positions.max()) + 1 if self.positions is not None else len(self.tokens)


# Families whose image tokens attend to each other both ways within an image, causal elsewhere: transformers'
# Gemma 3 forward does so for the tokens its `token_type_ids` mark as image tokens.
BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})


def is_vision_model(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def image_blocks(is_image: torch.Tensor) -> torch.Tensor:
    """(B, L) block of each position: a run of image tokens is one block (its index in the row), text is -1; the
    rule of transformers' Gemma 3 mask (`get_block_sequence_ids_for_mask` of its `token_type_ids`)."""
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(dim=1) - 1, -1)


class Vision:
    """The served model's image path: its image processor, image token and position rule."""

    def __init__(self, model: nn.Module, model_dir: str, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        config = model.config
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.max_image_pixels = max_image_pixels
        self._family = config.model_type
        self.bidirectional = config.model_type in BIDIRECTIONAL_IMAGES
        # Images laid out as patch grids (Qwen's `image_grid_thw`), or each resized to one size and pooled to
        # `mm_tokens_per_image` tokens (Gemma 3's; pan and scan would make several crops of an image, each with
        # markers of its own, which treadle does not lay out).
        grids = hasattr(self.processor, "merge_size") and hasattr(self.processor, "temporal_patch_size")
        self._fixed_tokens = getattr(config, "mm_tokens_per_image", None)
        fixed = self._fixed_tokens is not None and not getattr(self.processor, "do_pan_and_scan", False)
        # Why this model's images are refused, if they are: an image processor of neither kind.
        self.refused = (
            None
            if grids or fixed
            else f"its image processor ({type(self.processor).__name__}) is not one treadle prepares images for"
        )
        inner = getattr(model, "model", model)
        self._rope_index = getattr(inner, "get_rope_index", None)  # M-RoPE models only

    def check_text(self, field: str, model_input: ModelInput) -> None:
        """Refuse the image token in a text chunk: the model would look for an image's features there."""
        for c, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, EncodedTextChunk) and self.image_token_id in chunk.tokens:
                j = chunk.tokens.index(self.image_token_id)
                raise InvalidRequestError(
                    f"{field}.chunks[{c}].tokens[{j}]: {self.image_token_id} is the model's image token; "
                    "send an image as an image chunk"
                )

    def prepare(self, field: str, model_input: ModelInput) -> VisualInput:
        """Decode and count every image chunk of `model_input` (named `field` in errors)."""
        ids: list[np.ndarray] = []
        pictures = []
        for c, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, EncodedTextChunk):
                ids.append(np.asarray(chunk.tokens, dtype=np.int64))
                continue
            where = f"{field}.chunks[{c}]"
            if self.refused:
                raise InvalidRequestError(
                    f"{where}: images are not served on this {self._family} model: {self.refused}"
                )
            picture = self._picture(where, chunk.data, chunk.format)
            if chunk.expected_tokens is not None and chunk.expected_tokens != picture.tokens:
                raise InvalidRequestError(
                    f"{where}.expected_tokens: {chunk.expected_tokens}, but the model's processor makes "
                    f"{picture.tokens} tokens of this image ({_size(picture)})"
                )
            pictures.append(picture)
            ids.append(np.full(picture.tokens, self.image_token_id, dtype=np.int64))
        tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return VisualInput(tokens, tuple(pictures), self._positions(tokens, pictures))

    def _picture(self, where: str, data: bytes, fmt: str) -> Picture:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
        except Exception as exc:  # PIL raises several kinds for bytes that are no image it knows
            raise InvalidRequestError(f"{where}.data: does not decode as an image ({exc})") from None
        if image.format != _PIL_FORMATS[fmt]:
            raise InvalidRequestError(f"{where}.format: {fmt}, but the data is a {image.format} image")
        width, height = image.size
        if width * height > self.max_image_pixels:
            raise InvalidRequestError(
                f"{where}.data: {width} x {height} = {width * height} pixels; at most {self.max_image_pixels} "
                "(the worker's --max_image_pixels)"
            )
        try:
            rgb = image.convert("RGB")  # decodes the pixels: a truncated file fails here
        except Exception as exc:
            raise InvalidRequestError(f"{where}.data: does not decode as a {fmt} image ({exc})") from None
        out = self.processor(images=[rgb], return_tensors="pt")
        if self._fixed_tokens is not None:
            return Picture(out["pixel_values"], None, self._fixed_tokens)
        grid = out["image_grid_thw"]
        tokens = int(grid.prod()) // self.processor.merge_size**2
        return Picture(out["pixel_values"], grid, tokens)

    def _positions(self, tokens: np.ndarray, pictures: list[Picture]) -> np.ndarray | None:
        if self._rope_index is None or not pictures:
            return None
        ids = torch.from_numpy(tokens)[None]
        grids = torch.cat([p.grid for p in pictures])
        positions, _ = self._rope_index(ids, image_grid_thw=grids, mm_token_type_ids=(ids == self.image_token_id).int())
        return positions[:, 0].numpy()

    def features(self, model: nn.Module, pictures: list[Picture] | tuple[Picture, ...], device: torch.device) -> list:
        """Each picture's vision-tower output, computed on its own by `model` (the adapter active on it: its row's)."""
        out = []
        for picture in pictures:
            pixels = picture.pixel_values.to(device)
            grid = () if picture.grid is None else (picture.grid.to(device),)
            out.append(model.get_image_features(pixels, *grid, return_dict=True))
        return out

    def encoder_outputs(self, outputs: list) -> dict:
        """`mm_encoder_outputs` of a forward whose image tokens are these outputs' images, in order: Qwen's towers
        answer a tuple of per-image features (Qwen3-VL's also one per deepstack layer), Gemma 3's a tensor
        (images, tokens, hidden)."""
        first = outputs[0]
        if isinstance(first.pooler_output, torch.Tensor):
            return {"image": type(first)(pooler_output=torch.cat([o.pooler_output for o in outputs]))}
        fields = {"pooler_output": tuple(p for o in outputs for p in o.pooler_output)}
        if getattr(first, "deepstack_features", None) is not None:
            fields["deepstack_features"] = [
                tuple(p for o in outputs for p in o.deepstack_features[layer])
                for layer in range(len(first.deepstack_features))
            ]
        return {"image": type(first)(**fields)}

    def encode(self, model: nn.Module, pictures: list[Picture], device: torch.device) -> dict:
        """`mm_encoder_outputs` for these pictures (`features`, then `encoder_outputs`)."""
        return self.encoder_outputs(self.features(model, pictures, device))


def _size(picture: Picture) -> str:
    if picture.grid is None:
        return f"resized to {picture.pixel_values.shape[-1]} x {picture.pixel_values.shape[-2]} pixels"
    _, h, w = (int(x) for x in picture.grid[0])
    return f"a grid of {h} x {w} patches"


def batch_positions(rows: list[VisualInput | None], lengths: list[int], width: int, *, left: bool) -> torch.Tensor:
    """(3, B, width) M-RoPE positions of a padded batch: an image row's own, a text row's its token indices in
    each of the three sections; padding columns 0. `left`: rows are left-padded (the sampler's prefill)."""
    out = torch.zeros((3, len(rows), width), dtype=torch.long)
    for r, (row, length) in enumerate(zip(rows, lengths)):
        positions = torch.from_numpy(row.positions) if row is not None and row.positions is not None else None
        if positions is None:
            positions = torch.arange(length).expand(3, -1)
        start = width - length if left else 0
        out[:, r, start : start + length] = positions[:, :length]
    return out

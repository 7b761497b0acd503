"""Image parts of OpenAI chat messages (`{"type": "image_url", "image_url": {"url": ...}}`) as treadle image chunks.

A `data:image/png;base64,...` or `data:image/jpeg;base64,...` URL carries the image itself: always served.
An `http(s)` URL would make the gateway fetch whatever address a client names, so it is refused unless the
operator turns fetching on (`--openai_image_fetch`), and then only from the hosts of `--openai_image_hosts`,
within `--openai_image_max_bytes` and `--openai_image_timeout_s`, without following redirects (a redirect
could leave the allowed hosts).

A message's images go into the chat template as placeholders (inside the model's vision markers when its
tokenizer has Qwen's, as its own template writes them); the rendered text is split there and each image
becomes an `ImageChunk` between the text chunks. Its `expected_tokens` is counted as tinker-cookbook's
`image_to_chunk` counts it, with the model's image processor when that processor can say (the worker checks
it, and counts it itself when it is absent).
"""

from __future__ import annotations

import base64
import binascii
import io
from functools import lru_cache
from urllib.parse import urlsplit

import httpx

from treadle.errors import InvalidRequestError
from treadle.gateway.settings import GatewaySettings
from treadle.types import MAX_IMAGE_BYTES, EncodedTextChunk, ImageChunk, ModelInput

PLACEHOLDER = "\ue000"  # a private-use character: no chat text holds it
_MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
# What goes before and after an image in the chat template's text, as each family's processor writes it: Qwen's
# markers, and Gemma 3's between blank lines.
_VISION_MARKERS = (("<|vision_start|>", "<|vision_end|>"), ("\n\n<start_of_image>", "<end_of_image>\n\n"))


def image_part(field: str, part: dict, settings: GatewaySettings) -> ImageChunk:
    """The image of one `image_url` content part (named `field` in errors)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise InvalidRequestError(f"{field}.image_url.url: missing; a data: URL (or an allowed http(s) URL)")
    if url.startswith("data:"):
        return _data_url(f"{field}.image_url.url", url)
    if url.startswith(("http://", "https://")):
        return _fetched(f"{field}.image_url.url", url, settings)
    raise InvalidRequestError(f"{field}.image_url.url: {url[:40]!r}...; expected a data: URL or an http(s) URL")


def _data_url(field: str, url: str) -> ImageChunk:
    header, _, payload = url.partition(",")
    media_type, _, encoding = header.removeprefix("data:").partition(";")
    if media_type not in _MEDIA_TYPES or encoding != "base64":
        raise InvalidRequestError(
            f"{field}: data URL of {header[:40]!r}; expected data:image/png;base64,... or data:image/jpeg;base64,..."
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(f"{field}: the data URL's payload is not base64 ({exc})") from None
    return _chunk(field, data, _MEDIA_TYPES[media_type])


def _fetched(field: str, url: str, settings: GatewaySettings) -> ImageChunk:
    host = urlsplit(url).hostname or ""
    if not settings.openai_image_fetch:
        raise InvalidRequestError(
            f"{field}: http(s) image URLs are not fetched by this gateway (--openai_image_fetch is off); "
            "send the image as a data: URL"
        )
    if host not in settings.openai_image_hosts:
        raise InvalidRequestError(f"{field}: host {host!r} is not in the gateway's --openai_image_hosts")
    limit = min(settings.openai_image_max_bytes, MAX_IMAGE_BYTES)
    try:
        with httpx.stream("GET", url, timeout=settings.openai_image_timeout_s, follow_redirects=False) as response:
            if response.status_code != 200:
                raise InvalidRequestError(f"{field}: fetching it answered HTTP {response.status_code}")
            media_type = response.headers.get("content-type", "").split(";")[0].strip()
            if media_type not in _MEDIA_TYPES:
                raise InvalidRequestError(
                    f"{field}: fetched {media_type or 'no content type'}; expected image/png or image/jpeg"
                )
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > limit:
                    raise InvalidRequestError(f"{field}: the image is over {limit} bytes (--openai_image_max_bytes)")
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"{field}: could not fetch it ({type(exc).__name__}: {exc})") from None
    return _chunk(field, bytes(data), _MEDIA_TYPES[media_type])


def _chunk(field: str, data: bytes, fmt: str) -> ImageChunk:
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"{field}: {len(data)} bytes of image; at most {MAX_IMAGE_BYTES}")
    return ImageChunk(data=data, format=fmt)  # type: ignore[arg-type]  # png or jpeg, from _MEDIA_TYPES


def placeholder(tokenizer) -> str:
    """What an image part becomes in the chat template's text: inside the model's vision markers if it has them."""
    vocab = tokenizer.get_vocab()
    for before, after in _VISION_MARKERS:
        if before.strip() in vocab and after.strip() in vocab:
            return f"{before}{PLACEHOLDER}{after}"
    return PLACEHOLDER


def split_at_images(tokenizer, text: str, images: list[ImageChunk], source: str) -> ModelInput:
    """The rendered chat `text` as chunks: its text between placeholders tokenized, each image counted."""
    pieces = text.split(PLACEHOLDER)
    chunks: list[EncodedTextChunk | ImageChunk] = []
    for piece, image in zip(pieces, [*images, None]):
        if piece:
            chunks.append(EncodedTextChunk(tokens=tokenizer.encode(piece, add_special_tokens=False)))
        if image is not None:
            chunks.append(_counted(image, source))
    return ModelInput(chunks=chunks)


def _counted(image: ImageChunk, source: str) -> ImageChunk:
    processor = _image_processor(source)
    if processor is None or not hasattr(processor, "get_number_of_image_patches"):
        return image
    from PIL import Image

    try:
        width, height = Image.open(io.BytesIO(image.data)).size
    except Exception:  # the worker refuses it by name
        return image
    count = processor.get_number_of_image_patches(height, width, images_kwargs={}) // processor.merge_size**2
    return image.model_copy(update={"expected_tokens": int(count)})


@lru_cache(maxsize=16)
def _image_processor(source: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(source)
    except (OSError, ValueError):  # a text model's directory has none
        return None

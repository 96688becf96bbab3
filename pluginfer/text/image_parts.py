"""OpenAI ``image_url`` content parts: base64 data URIs decoded to PIL images, the parts turned into the
``{"type": "image"}`` placeholders chat templates render. Remote and file URLs only as bytes fetched beforehand
(the server reads those of the hosts and the directory it allows)."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any


class ImagePartError(ValueError):
    """A content part that is not a usable image; ``part`` names it (``messages[1].content[0]``)."""

    def __init__(self, part: str, why: str) -> None:
        super().__init__(f"{part}: {why}")
        self.part = part


def is_remote(url: object) -> bool:
    """An http(s) or file URL: its bytes come from the server's fetch, never from the request."""
    return isinstance(url, str) and url.startswith(("http://", "https://", "file:"))


def decode_image_url(url: object, part: str, fetched: dict[str, bytes] | None = None) -> Any:
    """The PIL image of a ``data:image/...;base64,...`` URI, or of a remote URL's ``fetched`` bytes."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url:
        raise ImagePartError(part, "image_url.url must be a non-empty string")
    if is_remote(url) and url in (fetched or {}):
        raw = (fetched or {})[url]
    elif is_remote(url):
        raise ImagePartError(part, "remote image URLs are not fetched (unless server.allowed_media_domains names "
                                   "their host, or server.allowed_local_media_path the directory of a file:// URL); "
                                   "send the image as a base64 data URI (data:image/png;base64,...)")
    else:
        header, comma, payload = url.partition(",")
        if not url.startswith("data:") or not comma or not header.endswith(";base64"):
            raise ImagePartError(part, "image_url.url must be a base64 data URI (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImagePartError(part, "image_url.url: the data URI's payload is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImagePartError(part, f"image_url.url: the data is not an image we can read ({exc})") from None
    return image.convert("RGB")


def image_urls(messages: list[dict]) -> list[tuple[str, object]]:
    """(part location, url) of every ``image_url`` part, in order."""
    found = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                image_url = part.get("image_url")
                found.append((f"messages[{m}].content[{p}]",
                              image_url.get("url") if isinstance(image_url, dict) else image_url))
    return found


def extract_images(messages: list[dict], accepted: bool = True,
                   fetched: dict[str, bytes] | None = None) -> tuple[list[dict], list[Any]]:
    """(messages with each ``image_url`` part as ``{"type": "image"}``, the images in order); ``accepted``
    False (a text-only model): any image part is an ``ImagePartError``."""
    images, out = [], []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{m}].content[{p}]"
                if not accepted:
                    raise ImagePartError(where, "this model takes text only; image_url parts are not served")
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                images.append(decode_image_url(url, where, fetched))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images

"""Images in a request: their size from the body where it carries one, and each provider's token rule.

Images are never text. A size is read from a PNG, GIF, WebP or JPEG header (base64 data is decoded
only as far as the header). Tokens follow the provider's published rule where the body gives the
size, else the rule for a 1024x1024 image, with a warning:

| format | rule |
|---|---|
| OpenAI | tiles: fit in 2048x2048, shortest side to 768, base + tile x 512px tiles (detail low: base); base/tile 85/170 (gpt-4o, gpt-4.1, gpt-4.5), 2833/5667 (gpt-4o-mini), 75/150 (o1, o3), 70/140 (gpt-5), 65/129 (computer-use-preview); patches: 32px patches capped at 1536, times 1.62 (gpt-4.1-mini, gpt-5-mini), 2.46 (gpt-4.1-nano, gpt-5-nano), 1.72 (o4-mini) |
| Anthropic | long edge to 1568 px, then width x height / 750, at most 1600 |
| Gemini | 258 when both sides are 384 px or less, else 258 per 768x768 tile, scaled to fit 3072 px (our bound) |

Every rule scales a large image down the way its provider does, so no header (PNG allows 2^31-1
square) can make one image cost more than its provider's largest charge.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from .json_writer import Notes

IMAGE_HEADER_CHARS = 1 << 20  # base64 characters decoded to find an image's size (JPEG may put EXIF first)

UNKNOWN_IMAGE_SIZE = (1024, 1024)
_OPENAI_PATCHES = (  # (family, multiplier): 32px patches, at most 1536
    (re.compile(r"gpt-4\.1-mini.*|gpt-5-mini.*"), 1.62),
    (re.compile(r"gpt-4\.1-nano.*|gpt-5-nano.*"), 2.46),
    (re.compile(r"o4-mini.*"), 1.72),
)
_OPENAI_TILES = (  # (family, base, per 512px tile)
    (re.compile(r"gpt-4o-mini.*"), 2833, 5667),
    (re.compile(r"(?:o1|o3)(?:-.*)?"), 75, 150),
    (re.compile(r"gpt-5(?:\.\d+)?(?:-.*)?"), 70, 140),
    (re.compile(r"computer-use-preview.*"), 65, 129),
)
_OPENAI_DEFAULT_TILES = (85, 170)  # gpt-4o, gpt-4.1, gpt-4.5 and any other name


@dataclass(frozen=True)
class Image:
    """An image the request carries: its size when the body tells, OpenAI's `detail` when given."""

    width: int | None = None
    height: int | None = None
    detail: str | None = None


# --- sizes ----------------------------------------------------------------------------------------


def image_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG, GIF, WebP or JPEG header; None for anything else.

    >>> image_size(bytes.fromhex("89504e470d0a1a0a0000000d49484452") + struct.pack(">II", 640, 480))
    (640, 480)
    """
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and len(data) >= 30:
        return _webp_size(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 ":
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":
        b0, b1, b2, b3 = data[21:25]
        return 1 + (((b1 & 0x3F) << 8) | b0), 1 + (((b3 & 0x0F) << 10) | (b2 << 2) | ((b1 & 0xC0) >> 6))
    if chunk == b"VP8X":
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    return None


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF:
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        if 0xD0 <= marker <= 0xD9 or marker == 0x01:
            i += 2
            continue
        i += 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
    return None


def base64_image_size(b64: str) -> tuple[int, int] | None:
    """The size of a base64-encoded image, decoding only its first bytes (the data is never text)."""
    head = "".join(b64[:IMAGE_HEADER_CHARS].split())
    head = head[: len(head) - len(head) % 4]
    try:
        return image_size(base64.b64decode(head))
    except (binascii.Error, ValueError, struct.error):
        return None


def url_image(url: Any, detail: Any = None) -> Image:
    """An image by URL: a `data:` URL tells its size, any other URL does not."""
    size = None
    if isinstance(url, str) and url.startswith("data:") and ";base64," in url[:200]:
        size = base64_image_size(url.partition(";base64,")[2])
    width, height = size or (None, None)
    return Image(width, height, detail=detail if isinstance(detail, str) else None)


# --- token rules ----------------------------------------------------------------------------------


def openai_image_tokens(width: int, height: int, *, detail: str | None, model: str) -> int:
    """OpenAI's published rule; `model` normalised. detail auto counts as high.

    >>> openai_image_tokens(1024, 1024, detail="high", model="gpt-4o"), openai_image_tokens(1024, 1024, detail="low", model="gpt-4o")
    (765, 85)
    """
    for family, multiplier in _OPENAI_PATCHES:
        if family.fullmatch(model):
            return math.ceil(_patches(width, height) * multiplier)
    base, tile = next(((b, t) for f, b, t in _OPENAI_TILES if f.fullmatch(model)), _OPENAI_DEFAULT_TILES)
    if detail == "low":
        return base
    w, h = _fit(width, height, 2048)
    if min(w, h) > 768:
        w, h = w * 768 / min(w, h), h * 768 / min(w, h)
    return base + tile * math.ceil(w / 512) * math.ceil(h / 512)


def _patches(width: int, height: int) -> int:
    w, h = float(width), float(height)
    if math.ceil(w / 32) * math.ceil(h / 32) > 1536:
        shrink = math.sqrt(32 * 32 * 1536 / (w * h))
        w, h = w * shrink, h * shrink
        fit = min(math.floor(w / 32) / (w / 32), math.floor(h / 32) / (h / 32))
        w, h = w * fit, h * fit
    return max(1, min(1536, math.ceil(w / 32) * math.ceil(h / 32)))


def anthropic_image_tokens(width: int, height: int) -> int:
    """Anthropic's published rule.

    >>> anthropic_image_tokens(1000, 1000), anthropic_image_tokens(4000, 4000)
    (1334, 1600)
    """
    w, h = _fit(width, height, 1568)
    return min(1600, math.ceil(w * h / 750))


GEMINI_MAX_SIDE = 3072  # our bound (Google publishes none): a larger image is scaled to fit 4 x 4 tiles


def gemini_image_tokens(width: int, height: int) -> int:
    """Google's published rule for Gemini 2.x: 258 per 768x768 tile, after scaling to fit GEMINI_MAX_SIDE.

    Google scales large images into tiles; without a published cap the scale keeps a hostile header
    (2^32-1 square) from counting 8e15 tokens.

    >>> gemini_image_tokens(300, 300), gemini_image_tokens(1024, 1024), gemini_image_tokens(2**32 - 1, 2**32 - 1)
    (258, 1032, 4128)
    """
    if width <= 384 and height <= 384:
        return 258
    w, h = _fit(width, height, GEMINI_MAX_SIDE)
    return 258 * math.ceil(w / 768) * math.ceil(h / 768)


def _fit(width: int, height: int, side: int) -> tuple[float, float]:
    """The size scaled down (never up) so that neither side exceeds `side`."""
    w, h = float(width), float(height)
    longest = max(w, h)
    if longest > side:
        w, h = w * side / longest, h * side / longest
    return w, h


def image_tokens(images: list[Image], fmt: str, model: str, notes: Notes) -> int:
    """The tokens of a request's images by its provider's rule (`model` normalised); unknown sizes as UNKNOWN_IMAGE_SIZE."""
    def rule(w: int, h: int, detail: str | None) -> int:
        if fmt.startswith("openai."):
            return openai_image_tokens(w, h, detail=detail, model=model)
        if fmt == "anthropic.messages":
            return anthropic_image_tokens(w, h)
        return gemini_image_tokens(w, h)

    total = 0
    for img in images:
        if img.width and img.height:
            total += rule(img.width, img.height, img.detail)
        elif img.detail == "low" and fmt.startswith("openai.") and not any(f.fullmatch(model) for f, _ in _OPENAI_PATCHES):
            total += rule(*UNKNOWN_IMAGE_SIZE, "low")  # a low-detail image costs the base whatever its size
        else:
            estimate = rule(*UNKNOWN_IMAGE_SIZE, img.detail)
            total += estimate
            level = f" at detail {img.detail!r}" if fmt.startswith("openai.") and img.detail else ""
            notes.add(f"An image whose size could not be read (a URL, a file, or data that is not PNG, GIF, WebP or JPEG) "
                      f"was counted as a 1024x1024 image{level} ({estimate} tokens), an estimate.")
    return total

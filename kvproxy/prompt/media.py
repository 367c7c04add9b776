"""What media parts cost in prompt tokens, computed from the media and the model's image
processor. Pure, no I/O (URLs are never fetched), no image decode.

An image part becomes as many tokens as the engine's processor makes of it, and that number
is the request's to choose: a 64x64 PNG with `mm_processor_kwargs` `min_pixels` of 47M is
60,047 tokens on Qwen2.5-VL. So a flat per-image number is not a bound. Here:

  * dimensions come from the encoded header of an inline image (`data:` URL or base64):
    PNG IHDR, GIF's logical screen, JPEG's SOFn frame header, WebP's VP8/VP8L/VP8X chunk;
  * the processor's arithmetic is Qwen2-VL's (transformers `Qwen2VLImageProcessor`,
    `smart_resize`: sides rounded to patch_size x merge_size, the area held within
    [min_pixels, max_pixels], then one token per merge_size^2 patches), with the numbers
    from the model's preprocessor_config.json (`media_processor`);
  * the request's `mm_processor_kwargs` may set `min_pixels`, `max_pixels` or `size`
    (`shortest_edge`/`longest_edge`), as the processor takes them; any other key is refused;
  * an image kvproxy cannot see into (an http(s) URL, a file id, an undecodable header) is
    charged the processor's ceiling (the most any image can become under those settings), or
    refused (`unseen_media: refuse`);
  * video and audio parts, `media_io_kwargs`, and image embeddings are refused: no ceiling
    per frame or second is modelled;
  * with no processor configured, every media part is refused, naming its kind.

`image_tokens` (the operator's) may only raise an image's cost, never lower it.
Errors name fields and part kinds, never the media's bytes or URLs (I8).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvproxy.policy import KvproxyError, errors

UnseenMedia = Literal["ceiling", "refuse"]

# Part types the engines load as media (vLLM chat_utils, SGLang's conversions, smg).
IMAGE_KINDS = frozenset({"image_url", "input_image", "image", "image_pil"})
OTHER_MEDIA_KINDS = frozenset(
    {"video_url", "video", "input_audio", "audio_url", "audio", "image_embeds", "audio_embeds"}
)
MEDIA_KINDS = IMAGE_KINDS | OTHER_MEDIA_KINDS
# transformers' smart_resize refuses an aspect ratio above this (the engine answers 400).
MAX_ASPECT = 200
# Base64 characters decoded to find a header: a JPEG's frame header may sit after its EXIF
# and ICC segments (each at most 64 KiB); four segments' worth is read at most.
HEADER_B64_CHARS = 4 * 65_536 * 4 // 3 + 4
# Processor kwargs a request may set, as the Qwen2-VL image processor reads them.
REQUEST_KWARGS = frozenset({"min_pixels", "max_pixels", "size"})
# The most one image's pixels can be told to be (a request's min_pixels): past it the
# engine's own resize would allocate gigabytes; refused as malformed rather than priced.
MAX_REQUEST_PIXELS = 2**40
_SIZE_KEYS = frozenset({"shortest_edge", "longest_edge"})


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen2-VL's image arithmetic with one model's numbers."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def load(cls, path: str | Path) -> ImageProcessor:
        """From a preprocessor_config.json (or the directory holding one). Raises
        ValueError naming what is not a Qwen2-VL-style processor."""
        p = Path(path)
        if p.is_dir():
            p = p / "preprocessor_config.json"
        cfg = json.loads(p.read_text())
        kind = str(cfg.get("image_processor_type", ""))
        if not kind.startswith(("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor")):
            raise ValueError(
                f"{p}: image_processor_type {kind or '(none)'} is not modelled "
                "(Qwen2-VL style only)"
            )
        size = cfg.get("size") or {}
        out = cls(
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )
        if min(out.patch_size, out.merge_size, out.min_pixels, out.max_pixels) < 1:
            raise ValueError(f"{p}: patch_size, merge_size and the pixel limits must be positive")
        return out

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_request(self, kwargs: Any) -> ImageProcessor:
        """This processor under a request's `mm_processor_kwargs` (what the processor would
        use), or a 400 naming a key it does not accept or a value it would refuse."""
        if kwargs is None:
            return self
        if not isinstance(kwargs, dict):
            p = "mm_processor_kwargs"
            raise errors.invalid_request(f"{p} must be an object", p)
        lo, hi = self.min_pixels, self.max_pixels
        for key, value in kwargs.items():
            name = f"mm_processor_kwargs.{key}"
            if key not in REQUEST_KWARGS:
                raise errors.unsupported_field(
                    name, "this model", "its image processor",
                    "the image processor's cost under it is not modelled (only min_pixels, "
                    "max_pixels and size are)", neutral_hint=False,
                )  # fmt: skip
            if key == "size":
                if not isinstance(value, dict) or not set(value) <= _SIZE_KEYS:
                    raise errors.unsupported_field(
                        name, "this model", "its image processor",
                        "only size.shortest_edge and size.longest_edge are modelled",
                        neutral_hint=False,
                    )  # fmt: skip
                lo = _pixels(value.get("shortest_edge", lo), name + ".shortest_edge")
                hi = _pixels(value.get("longest_edge", hi), name + ".longest_edge")
            elif value is not None:
                if key == "min_pixels":
                    lo = _pixels(value, name)
                else:
                    hi = _pixels(value, name)
        return ImageProcessor(self.patch_size, self.merge_size, lo, hi)

    def resized(self, height: int, width: int) -> tuple[int, int] | None:
        """transformers' smart_resize; None where it raises (the engine refuses it)."""
        if height < 1 or width < 1 or max(height, width) / min(height, width) > MAX_ASPECT:
            return None
        f = self.factor
        h_bar = _round_half_even(height / f) * f
        w_bar = _round_half_even(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def tokens(self, height: int, width: int) -> int | None:
        """Tokens one image of these dimensions becomes (grid_h x grid_w / merge^2)."""
        got = self.resized(height, width)
        if got is None:
            return None
        h, w = got
        return (h // self.patch_size) * (w // self.patch_size) // (self.merge_size**2)

    def ceiling(self) -> int:
        """The most tokens any image can become under these numbers (an image kvproxy
        cannot see into): the resized area is at most max_pixels, or one side clamped to
        `factor` with the other at most sqrt(MAX_ASPECT x max_pixels), or min_pixels grown
        by the rounding up of both sides at the widest aspect ratio."""
        f = self.factor
        r = math.sqrt(MAX_ASPECT)
        pixels = max(
            self.max_pixels,
            f * (math.sqrt(MAX_ASPECT * self.max_pixels) + f),
            self.min_pixels + f * math.sqrt(self.min_pixels) * (r + 1 / r) + f * f,
        )
        return math.ceil(pixels / (self.patch_size**2 * self.merge_size**2)) + 1


def _round_half_even(x: float) -> int:
    return round(x)  # Python's round, as transformers calls it: ties to even


def _pixels(value: Any, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 1 <= value <= MAX_REQUEST_PIXELS:
        why = f"{name} must be an integer from 1 to {MAX_REQUEST_PIXELS}"
        raise errors.invalid_request(why, name)
    return value


# --- headers -------------------------------------------------------------------------------


def dimensions(data: bytes) -> tuple[int, int] | None:
    """(height, width) from an encoded image's header; None if it is none of PNG, GIF,
    JPEG, WebP or the header is cut short."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return h, w
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return h, w
    if data.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data)
    return None


# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes) -> tuple[int, int] | None:
    i = 2
    n = len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > n:
                return None
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return h, w
        if marker == 0xDA or length < 2:  # scan data before any frame header
            return None
        i += 2 + length
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        w = 1 + int.from_bytes(data[24:27], "little")
        h = 1 + int.from_bytes(data[27:30], "little")
        return h, w
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + ((bits >> 14) & 0x3FFF), 1 + (bits & 0x3FFF)
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return h & 0x3FFF, w & 0x3FFF
    return None


def inline_bytes(ref: str) -> bytes | None:
    """The leading bytes of an inline image (a `data:...;base64,` URL or bare base64), or
    None for anything kvproxy cannot see into (http(s), file and other URLs)."""
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or not head.endswith(";base64"):
            return None
    elif "://" in ref[:16] or not ref:
        return None
    else:
        payload = ref
    chunk = payload[:HEADER_B64_CHARS]
    chunk = chunk[: len(chunk) - len(chunk) % 4]
    try:
        return base64.b64decode(chunk, validate=False)
    except (binascii.Error, ValueError):
        return None


# --- a request's media ---------------------------------------------------------------------


@dataclass(frozen=True)
class MediaPolicy:
    """One model's media settings: its processor (None: media refused), what an image
    kvproxy cannot see into costs, and the operator's per-image floor (`image_tokens`)."""

    processor: ImageProcessor | None = None
    unseen: UnseenMedia = "ceiling"
    image_tokens: int | None = None

    def cost(self, body: Mapping[str, Any], route: str) -> int:
        """The tokens every media item of the request becomes, summed; a 400 naming the
        part kind or field for media that cannot be priced. Walks every object in the body
        with a media `type` (the walk of tokens.bound.measure counts the same ones), and SGLang's
        `image_data` on its native routes."""
        items: list[tuple[str, Any]] = []
        pending: list[Any] = [body]
        while pending:
            value = pending.pop()
            if isinstance(value, dict):
                kind = value.get("type")
                if isinstance(kind, str) and kind in MEDIA_KINDS:
                    items.append((kind, value))
                pending.extend(value.values())
            elif isinstance(value, list):
                pending.extend(value)
        native: list[Any] = []
        if route in ("generate", "encode", "native_classify"):
            for key in ("video_data", "audio_data"):
                if body.get(key) is not None:
                    raise _refused_kind(key)
            native = _flat(body.get("image_data"))
        media_kwargs = body.get("mm_processor_kwargs")
        extra = {k: body.get(k) for k in ("media_io_kwargs", "images_config", "video_config",
                                          "max_dynamic_patch", "min_dynamic_patch",
                                          "image_max_dynamic_patch", "video_max_dynamic_patch",
                                          "use_audio_in_video")}  # fmt: skip
        for key, value in extra.items():
            if value is not None:
                raise errors.unsupported_field(
                    key,
                    route,
                    "this model",
                    "its effect on media cost is not modelled",
                    neutral_hint=False,
                )
        if not items and not native and media_kwargs is None:
            return 0
        processor = self.processor
        if processor is None:
            if items:
                raise _refused_kind(items[0][0])
            if native:
                raise _refused_kind("image_data")
            raise errors.unsupported_field(
                "mm_processor_kwargs", route, "this model",
                "no image processor is configured for this model (media_processor)",
                neutral_hint=False,
            )  # fmt: skip
        processor = processor.with_request(media_kwargs)
        total = 0
        for kind, part in items:
            if kind not in IMAGE_KINDS:
                raise _refused_kind(kind)
            total += self._image(processor, _image_ref(kind, part), kind)
        for ref in native:
            total += self._image(processor, ref if isinstance(ref, str) else None, "image_data")
        return total

    def _image(self, processor: ImageProcessor, ref: str | None, kind: str) -> int:
        data = inline_bytes(ref) if ref is not None else None
        dims = dimensions(data) if data is not None else None
        if dims is None:
            if self.unseen == "refuse":
                raise errors.unsupported_field(
                    kind, "this route", "this model",
                    "kvproxy cannot read this image's size (only inline PNG, JPEG, WebP and "
                    "GIF are read; URLs are never fetched) and unseen_media is refuse",
                    neutral_hint=False,
                )  # fmt: skip
            tokens = processor.ceiling()
        else:
            got = processor.tokens(*dims)
            if got is None:
                raise errors.invalid_request(
                    f"an image part's aspect ratio is over {MAX_ASPECT}:1, which the "
                    "engine's image processor refuses",
                    kind,
                )
            tokens = got
        return max(tokens, self.image_tokens or 0)


def _image_ref(kind: str, part: Mapping[str, Any]) -> str | None:
    """Where an image part's bytes are: a URL or base64 string, or None (not inline)."""
    value = part.get(kind)
    if kind == "input_image" and value is None:
        value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url", value.get("data"))
    if kind == "image" and value is None:
        source = part.get("source")  # Anthropic's image block
        if isinstance(source, dict) and source.get("type") == "base64":
            value = source.get("data")
    return value if isinstance(value, str) else None


def _flat(value: Any) -> list[Any]:
    if value is None:
        return []
    out: list[Any] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
        else:
            out.append(item)
    return out


def _refused_kind(kind: str) -> KvproxyError:
    return errors.unsupported_field(
        kind,
        "this route",
        "this model",
        f"{kind} media cannot be priced here: images need an image processor configured for "
        "the model (media_processor); video, audio and embeddings are refused",
        neutral_hint=False,
    )


__all__ = [
    "IMAGE_KINDS",
    "MEDIA_KINDS",
    "ImageProcessor",
    "MediaPolicy",
    "dimensions",
    "inline_bytes",
]

"""Media costs (kvproxy/prompt/media.py): sizes from encoded headers, Qwen2-VL's arithmetic
under the request's processor kwargs, refusals. The arithmetic is held to transformers'
processor in tests/engine_models (`make test-real`)."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import pytest

from kvproxy.policy.errors import KvproxyError
from kvproxy.prompt.media import ImageProcessor, MediaPolicy, dimensions

QWEN = ImageProcessor()  # transformers' Qwen2-VL defaults


def png(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    )


def jpeg(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    sof = b"\xff\xc2" + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xda"


def gif(w: int, h: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", w, h) + b"\x00" * 3


def webp_vp8x(w: int, h: int) -> bytes:
    body = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
    body += (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def webp_vp8l(w: int, h: int) -> bytes:
    bits = (w - 1) | ((h - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + bits.to_bytes(4, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


@pytest.mark.parametrize("make", [png, jpeg, gif, webp_vp8x, webp_vp8l])
def test_dimensions_from_headers(make: Any) -> None:
    assert dimensions(make(640, 480)) == (480, 640)
    assert dimensions(make(640, 480)[:9]) is None  # cut short: unknown, never a guess


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **extra}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_64px_image_forced_to_47m_pixels_costs_what_the_processor_makes() -> None:
    policy = MediaPolicy(QWEN)
    small = policy.cost(chat(image(data_url(png(64, 64)))), "chat")
    assert small == QWEN.tokens(64, 64) == 4  # 64x64 -> 56x56 -> 2x2 merged patches
    forced = chat(
        image(data_url(png(64, 64))),
        mm_processor_kwargs={"min_pixels": 47_040_000, "max_pixels": 47_040_000},
    )
    # transformers: image_grid_thw [1, 490, 490] -> 490 * 490 / 4 tokens.
    assert policy.cost(forced, "chat") == 60_025


def test_unseen_images_cost_the_ceiling_or_are_refused() -> None:
    body = chat(image("https://example.com/a.png"))
    ceiling = QWEN.ceiling()
    assert MediaPolicy(QWEN).cost(body, "chat") == ceiling
    assert ceiling >= QWEN.max_pixels // (28 * 28)
    with pytest.raises(KvproxyError) as info:
        MediaPolicy(QWEN, unseen="refuse").cost(body, "chat")
    assert info.value.code == "unsupported_field"


def test_image_tokens_raises_and_never_lowers() -> None:
    body = chat(image(data_url(png(2000, 2000))))
    computed = MediaPolicy(QWEN).cost(body, "chat")
    assert MediaPolicy(QWEN, image_tokens=10).cost(body, "chat") == computed
    assert MediaPolicy(QWEN, image_tokens=10**6).cost(body, "chat") == 10**6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(image(data_url(png(8, 8)))), "image_url"),  # no processor configured
        (chat({"type": "input_audio", "input_audio": {"data": "x"}}), "input_audio"),
        (chat({"type": "video_url", "video_url": {"url": "x"}}), "video_url"),
        (chat(mm_processor_kwargs={"min_pixels": 10}), "mm_processor_kwargs"),
    ],
)
def test_without_a_processor_media_are_refused_naming_the_kind(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(KvproxyError) as info:
        MediaPolicy().cost(body, "chat")
    assert (info.value.status, info.value.code, info.value.param) == (
        400,
        "unsupported_field",
        param,
    )


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"do_resize": False}, "mm_processor_kwargs.do_resize"),
        ({"patch_size": 1}, "mm_processor_kwargs.patch_size"),
        ({"size": {"height": 5}}, "mm_processor_kwargs.size"),
        ({"min_pixels": "big"}, "mm_processor_kwargs.min_pixels"),
    ],
)
def test_processor_kwargs_outside_the_model_are_refused(kwargs: Any, param: str) -> None:
    body = chat(image(data_url(png(8, 8))), mm_processor_kwargs=kwargs)
    with pytest.raises(KvproxyError) as info:
        MediaPolicy(QWEN).cost(body, "chat")
    assert info.value.param == param


def test_video_and_media_io_kwargs_are_refused_with_a_processor() -> None:
    for body in (
        chat({"type": "video_url", "video_url": {"url": "x"}}),
        chat(image(data_url(png(8, 8))), media_io_kwargs={"video": {"num_frames": 9}}),
    ):
        with pytest.raises(KvproxyError):
            MediaPolicy(QWEN).cost(body, "chat")


def test_the_ceiling_covers_every_size() -> None:
    for kwargs in ({}, {"min_pixels": 200_000}, {"max_pixels": 3136}, {"min_pixels": 1}):
        p = QWEN.with_request(kwargs)
        worst = max(
            p.tokens(h, w) or 0
            for h in (1, 2, 7, 13, 28, 29, 100, 999, 4000)
            for w in (1, 2, 14, 27, 56, 333, 2800, 4000)
        )
        assert worst <= p.ceiling()

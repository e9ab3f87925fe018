"""Decoding one object: formats and modes to 8-bit RGB, resize + crop, rejections, patch order."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import vit.patches
from pipelines.image.patches import RejectedImage, decode_image, patchify, patchify_batch, unpatchify

S = 16
LIMIT = 10**8


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def decode(data: bytes, size: int = S, max_pixels: int = LIMIT) -> np.ndarray:
    return decode_image(data, size, max_pixels=max_pixels)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width`×`height` pixels but carries almost no data (a decompression bomb)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "mode, fmt",
    [("RGB", "JPEG"), ("L", "JPEG"), ("CMYK", "JPEG"), ("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"),
     ("I;16", "PNG"), ("1", "PNG"), ("RGB", "WEBP"), ("RGBA", "WEBP"), ("P", "GIF"), ("RGB", "BMP"), ("RGB", "TIFF")],
)
def test_every_supported_mode_decodes_to_8bit_rgb(mode, fmt):
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8))
    img = base.convert(mode) if mode != "I;16" else Image.fromarray(rng.integers(0, 65535, (20, 30), dtype=np.uint16))
    out = decode(encode(img, fmt))
    assert out.shape == (S, S, 3) and out.dtype == np.uint8


def test_grayscale_becomes_equal_rgb_channels():
    out = decode(encode(Image.new("L", (20, 20), 77), "PNG"))
    assert np.all(out == 77)


def test_sixteen_bit_samples_keep_their_top_eight_bits():
    img = Image.fromarray(np.full((20, 20), 0x8040, dtype=np.uint16))
    assert np.all(decode(encode(img, "PNG")) == 0x80)


def test_transparent_pixels_are_composited_over_white():
    out = decode(encode(Image.new("RGBA", (20, 20), (10, 20, 30, 0)), "PNG"))
    assert np.all(out == 255)


def test_palette_transparency_is_honoured():
    img = Image.new("P", (20, 20), 0)
    img.putpalette([0, 0, 0] * 256)
    out = decode(encode(img, "PNG", transparency=0))
    assert np.all(out == 255)


def test_cmyk_is_converted_to_rgb():
    out = decode(encode(Image.new("CMYK", (24, 24), (0, 255, 255, 0)), "JPEG", quality=100))
    assert np.allclose(out.reshape(-1, 3).mean(0), [255, 0, 0], atol=6)  # C=0, M=Y=255, K=0 is red


def test_animated_gif_uses_the_first_frame():
    frames = [Image.new("RGB", (20, 20), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    out = decode(buf.getvalue())
    assert np.allclose(out.reshape(-1, 3).mean(0), [255, 0, 0], atol=2)


def test_shorter_side_is_resized_and_the_centre_is_cropped():
    img = np.zeros((20, 60, 3), dtype=np.uint8)
    img[:, :20] = (255, 0, 0)
    img[:, 20:40] = (0, 255, 0)
    img[:, 40:] = (0, 0, 255)
    out = decode(encode(Image.fromarray(img), "PNG"), size=10)
    assert np.all(out[:, 1:-1] == (0, 255, 0))


def test_large_jpegs_decode_at_reduced_scale_to_the_same_size():
    rng = np.random.default_rng(1)
    big = Image.fromarray(rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8)).resize((800, 600))
    out = decode(encode(big, "JPEG"), size=64)
    assert out.shape == (64, 64, 3)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty file"),
        (b"this is a text file with a .jpg name", "not an image"),
        (bytes(range(256)) * 8, "not an image"),
        (png_header_only(30000, 30000), "too many pixels"),
        (png_header_only(200, 200), "too many pixels"),  # over the configured limit below
    ],
)
def test_bad_objects_are_rejected_with_a_reason(data, reason):
    with pytest.raises(RejectedImage, match=reason):
        decode(data, max_pixels=30000)


def test_truncated_jpeg_is_rejected_as_corrupt():
    rng = np.random.default_rng(2)
    data = encode(Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)), "JPEG")
    with pytest.raises(RejectedImage, match="corrupt or truncated"):
        decode(data[: len(data) // 2])


def test_rejection_reasons_are_deterministic():
    reasons = set()
    for _ in range(2):
        with pytest.raises(RejectedImage) as info:
            decode(b"not an image at all")
        reasons.add(str(info.value))
    assert len(reasons) == 1 and "0x" not in reasons.pop()


@pytest.mark.parametrize("h, w, p", [(16, 16, 4), (8, 12, 4), (32, 32, 16)])
def test_numpy_patchify_matches_vit_patches(h, w, p):
    image = np.random.default_rng(3).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    expected = vit.patches.patchify(torch.from_numpy(image[None].copy()), p, channels_last=True)[0].numpy()
    assert np.array_equal(patchify(image, p), expected)
    out = np.empty_like(expected)
    patchify(image, p, out=out)
    assert np.array_equal(out, expected)
    assert np.array_equal(patchify_batch(image[None], p)[0], expected)


def test_unpatchify_inverts_patchify():
    images = np.random.default_rng(4).integers(0, 256, size=(2, 8, 12, 3), dtype=np.uint8)
    assert np.array_equal(unpatchify(patchify_batch(images, 4), 4, (2, 3)), images)

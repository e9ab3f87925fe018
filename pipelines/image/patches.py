"""Image decoding and patch layout for the ingest and data stages (numpy + Pillow, no torch).

`decode_image` turns the bytes of one object into a square `(S, S, 3)` uint8
RGB array, or raises `RejectedImage` with a short reason. `patchify` /
`unpatchify` are numpy twins of `vit.patches` with the same patch order
(row-major grid, each patch flattened as (row, col, channel)); `resize_patches`
resizes stored patch sequences to another resolution in that order.
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np
from PIL import Image, ImageFile

# Formats worth decoding; anything else (PDF, ICO, PSD, ...) is rejected as "not an image".
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # multi-picture JPEGs open as JPEG
BACKGROUND = (255, 255, 255)  # transparent pixels are composited over white

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, not a half-grey image

# EXIF orientation (tag 0x0112) -> the transpose that shows the picture upright.
_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


class RejectedImage(Exception):
    """An object that cannot be used as an image; the message is the reason recorded in the manifest."""


def decode_image(data: bytes, size: int, *, max_pixels: int) -> np.ndarray:
    """Decode, convert to 8-bit RGB, resize the shorter side to `size` and centre-crop.

    Accepts JPEG, PNG, WebP, GIF (first frame), BMP and TIFF; grayscale, palette,
    CMYK, alpha and 16-bit images are converted to 8-bit RGB; an EXIF orientation is
    applied, so a photo taken rotated comes out upright. Raises
    `RejectedImage` for empty, corrupt, truncated or non-image data and for images
    with more than `max_pixels` pixels (checked from the header, before decoding).
    """
    if not data:
        raise RejectedImage("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:  # Pillow's own ceiling (2 x MAX_IMAGE_PIXELS) comes first
        raise RejectedImage(f"too many pixels (over Pillow's limit of {2 * Image.MAX_IMAGE_PIXELS})") from None
    except Exception as exc:  # untrusted bytes: any parser failure is a rejection, never a crash
        raise RejectedImage(f"not an image ({_short(exc)})") from None
    w, h = im.size
    if w * h > max_pixels:
        raise RejectedImage(f"too many pixels ({w}x{h} > {max_pixels})")
    if w < 1 or h < 1:
        raise RejectedImage(f"degenerate size {w}x{h}")
    try:
        if im.format in ("JPEG", "MPO"):
            # Let libjpeg decode at 1/2, 1/4 or 1/8 scale while the result still covers the target.
            scale = size / min(w, h)
            im.draft("RGB", (max(1, int(w * scale + 0.999)), max(1, int(h * scale + 0.999))))
        transpose = _ORIENTATION.get(_orientation(im))
        im = _to_rgb(im)
        w, h = im.size
        side = min(w, h)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        out = im.resize((size, size), Image.Resampling.BILINEAR, box=box)
        # A centred square crop commutes with every flip and quarter turn: turn the small result.
        arr = np.asarray(out.transpose(transpose) if transpose is not None else out)
    except Exception as exc:  # truncated data, broken chunks, decoder errors
        raise RejectedImage(f"corrupt or truncated ({_short(exc)})") from None
    if arr.shape != (size, size, 3) or arr.dtype != np.uint8:
        raise RejectedImage(f"unexpected decoded shape {arr.shape} {arr.dtype}")
    return arr


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation (1 = upright); a broken EXIF block counts as upright, not as a bad image."""
    try:
        return int(im.getexif().get(0x0112, 1))
    except Exception:  # untrusted metadata
        return 1


def _to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB from any Pillow mode (loads the pixels)."""
    mode = im.mode
    if mode == "RGB":
        im.load()
        return im
    if mode.startswith("I;16") or mode == "I":
        # 16-bit (or 32-bit int) samples: keep the top 8 bits of the 16-bit range.
        a = np.asarray(im).astype(np.int64)
        a = (np.clip(a, 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "F":
        a = np.clip(np.asarray(im), 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV, RGBX


def _short(exc: BaseException) -> str:
    if isinstance(exc, Image.UnidentifiedImageError):
        return "unrecognised format"
    # Drop object addresses so the same file always gets the same reason.
    text = re.sub(r" ?(<[^>]*>|at 0x[0-9a-fA-F]+)", "", " ".join(str(exc).split()))
    return (text or type(exc).__name__)[:120]


def patchify(image: np.ndarray, patch_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """`(H, W, C)` uint8 → `(N, P*P*C)` in `vit.patches` order, written into `out` when given."""
    h, w, c = image.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}")
    gh, gw = h // p, w // p
    if out is None:
        out = np.empty((gh * gw, p * p * c), dtype=image.dtype)
    # Move whole patch rows (P*C contiguous bytes) as single items: ~4x faster than an element-wise transpose.
    unit = np.dtype((np.void, p * c * image.dtype.itemsize))
    src = np.ascontiguousarray(image).reshape(gh, p, gw, p * c).view(unit)[..., 0]  # (gh, p, gw)
    dst = out.reshape(gh, gw, p, p * c).view(unit)[..., 0]  # (gh, gw, p)
    np.copyto(dst, src.transpose(0, 2, 1))
    return out


def unpatchify(patches: np.ndarray, patch_size: int, grid: tuple[int, int], channels: int = 3) -> np.ndarray:
    """Inverse of `patchify` for a batch: `(B, N, P*P*C)` → `(B, H, W, C)`."""
    b, n, d = patches.shape
    gh, gw = grid
    p = patch_size
    if n != gh * gw or d != p * p * channels:
        raise ValueError(f"patches of shape {patches.shape} do not match grid {gh}x{gw}, patch {p}, {channels} channels")
    x = patches.reshape(b, gh, gw, p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, gh * p, gw * p, channels)


def patchify_batch(images: np.ndarray, patch_size: int) -> np.ndarray:
    """`(B, H, W, C)` → `(B, N, P*P*C)`, same order as `patchify`."""
    b, h, w, c = images.shape
    p = patch_size
    gh, gw = h // p, w // p
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch size {p}")
    x = images.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(x).reshape(b, gh * gw, p * p * c)


def resize_patches(patches: np.ndarray, patch_size: int, grid: tuple[int, int], size: int) -> np.ndarray:
    """uint8 patch sequences of images on `grid` → the same images resized to `size`×`size`, re-patchified."""
    images = unpatchify(patches, patch_size, grid)
    out = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BICUBIC)) for im in images])
    return patchify_batch(out, patch_size)

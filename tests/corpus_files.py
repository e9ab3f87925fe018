"""Small files the ingest tests put on the S3 server: seeded JPEGs and WebDataset tar shards."""

from __future__ import annotations

import io
import tarfile

import numpy as np
from PIL import Image


def jpeg(seed: int | np.random.Generator, size: int | tuple[int, int] = 20) -> bytes:
    """A JPEG of random pixels from `seed` (or a generator, drawn from in turn), `size` square or (height, width)."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    height, width = (size, size) if isinstance(size, int) else size
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def webdataset_tar(samples: list[dict[str, bytes]]) -> bytes:
    """A WebDataset shard: each sample's members `<key>.<suffix>`, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for sample in samples:
            for name, data in sample.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()

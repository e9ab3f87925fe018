"""Corpora to run the pipeline on, written as image objects in class folders.

* `synth_corpus`: formula-driven images, one iterated-function-system (IFS)
  fractal per class as in FractalDB (Kataoka et al. 2020; Nakashima et al.
  2022), so pretraining needs no natural images and no download. Rendering is
  vectorised over thousands of chaos-game chains; images are written as JPEG by
  parallel Ray tasks; everything is a function of the seed.
* `export_digits`: scikit-learn's 1,797 handwritten digits (8×8, 10 classes),
  upscaled to PNG, with a fixed stratified train/test split recorded in
  `manifest.csv` (columns key,label,split). Ingest honours that split when given
  the manifest: `vitpipe ingest DEST OUT --manifest DEST/manifest.csv`.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pipelines.core.cluster import connect
from pipelines.core.storage import S3Store, Store, open_store

MIN_MAPS, MAX_MAPS = 2, 4
FILL_RANGE = (0.06, 0.6)  # accepted fraction of covered pixels in a 64×64 test render
CHUNK = 32  # images per Ray task


@dataclass(frozen=True)
class IFSystem:
    """Affine maps x → A x + b with selection probabilities, and a colour per map."""

    linear: np.ndarray  # (m, 2, 2)
    shift: np.ndarray  # (m, 2)
    probs: np.ndarray  # (m,)
    colours: np.ndarray  # (m, 3) in [0, 1]


def _rotation(theta: float) -> np.ndarray:
    c, s = np.cos(theta), np.sin(theta)
    return np.array([[c, -s], [s, c]])


def sample_system(rng: np.random.Generator) -> IFSystem:
    """A random contractive IFS of 2–4 maps: A = R(θ) diag(σ1, ±σ2) R(φ), σ in [0.25, 0.85]."""
    m = int(rng.integers(MIN_MAPS, MAX_MAPS + 1))
    linear = np.empty((m, 2, 2))
    for i in range(m):
        sigma = np.diag([rng.uniform(0.25, 0.85), rng.uniform(0.25, 0.85) * rng.choice([-1.0, 1.0])])
        linear[i] = _rotation(rng.uniform(0, 2 * np.pi)) @ sigma @ _rotation(rng.uniform(0, 2 * np.pi))
    shift = rng.uniform(-1, 1, size=(m, 2))
    det = np.abs(np.linalg.det(linear)) + 1e-3
    colours = rng.uniform(0.25, 1.0, size=(m, 3))
    return IFSystem(linear, shift, det / det.sum(), colours)


def chaos_game(system: IFSystem, rng: np.random.Generator, chains: int, steps: int, burn_in: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Points on the attractor and the map that produced each, from `chains` walks run in parallel."""
    x = rng.uniform(-1, 1, size=(chains, 2))
    points, which = [], []
    for step in range(burn_in + steps):
        idx = rng.choice(len(system.probs), size=chains, p=system.probs)
        x = np.einsum("nij,nj->ni", system.linear[idx], x) + system.shift[idx]
        if step >= burn_in:
            points.append(x)
            which.append(idx)
    return np.concatenate(points), np.concatenate(which)


def _raster(points: np.ndarray, size: int, margin: float = 0.06) -> np.ndarray:
    """Flat pixel indices of points fitted into a `size`×`size` canvas (robust bounding box)."""
    lo, hi = np.percentile(points, [0.5, 99.5], axis=0)
    span = float(np.max(hi - lo)) or 1.0
    centre = (lo + hi) / 2
    uv = (points - centre) / span * (1 - 2 * margin) + 0.5
    ij = np.clip((uv * size).astype(np.int64), 0, size - 1)
    return (size - 1 - ij[:, 1]) * size + ij[:, 0]


def fill_fraction(system: IFSystem, rng: np.random.Generator, size: int = 64) -> float:
    """Fraction of a test render's pixels the attractor covers (degenerate systems are near 0 or 1)."""
    points, _ = chaos_game(system, rng, chains=512, steps=16)
    if not np.all(np.isfinite(points)):
        return 0.0
    return float(np.unique(_raster(points, size)).size) / size**2


def class_system(seed: int, label: int) -> IFSystem:
    """The IFS of class `label`: the first sampled system with a non-degenerate fill."""
    rng = np.random.default_rng([seed, label, 0xF4AC])
    while True:
        system = sample_system(rng)
        if FILL_RANGE[0] <= fill_fraction(system, rng) <= FILL_RANGE[1]:
            return system


def render(system: IFSystem, size: int, rng: np.random.Generator) -> np.ndarray:
    """One `(size, size, 3)` uint8 image of the class fractal with per-image variation.

    Variation: map parameters jittered by ~4%, re-weighted map probabilities,
    per-image hue shift, random flip and background level.
    """
    jitter = IFSystem(
        system.linear * (1 + rng.normal(0, 0.04, size=system.linear.shape)),
        system.shift + rng.normal(0, 0.04, size=system.shift.shape),
        (p := system.probs * rng.uniform(0.7, 1.3, size=system.probs.shape)) / p.sum(),
        np.clip(system.colours[:, rng.permutation(3)] * rng.uniform(0.7, 1.1), 0, 1),
    )
    n_points = max(4096, size * size * 6)
    chains = 2048
    points, which = chaos_game(jitter, rng, chains=chains, steps=max(8, n_points // chains))
    flat = _raster(points, size)
    count = np.bincount(flat, minlength=size * size).astype(np.float64)
    colour = np.stack([np.bincount(flat, weights=jitter.colours[which, c], minlength=size * size) for c in range(3)], -1)
    mean_colour = colour / np.maximum(count, 1)[:, None]
    intensity = np.log1p(count) / np.log1p(count.max())
    background = rng.uniform(0, 0.12)
    img = background + (1 - background) * mean_colour * intensity[:, None] ** 0.6
    img = (np.clip(img, 0, 1) * 255).astype(np.uint8).reshape(size, size, 3)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return np.ascontiguousarray(img)


def open_dest(dest: str, endpoint_url: str | None) -> Store:
    """The destination store; an S3 bucket must exist and accept our credentials."""
    store = open_store(dest, endpoint_url=endpoint_url)
    if isinstance(store, S3Store):
        store.check()
    return store


@dataclass
class CorpusResult:
    """What was written: destination URI, image count, class names (index order), seconds."""

    dest: str
    images: int
    classes: list[str]
    seconds: float


def fractal_class_names(classes: int, prefix: str = "fractal") -> list[str]:
    """Zero-padded names, so listing order equals numeric order."""
    width = max(4, len(str(classes - 1)))
    return [f"{prefix}-{c:0{width}d}" for c in range(classes)]


def assignments(images: int, classes: int) -> Iterator[tuple[int, int]]:
    """(class, index within class) for every image: classes as even as possible."""
    for c in range(classes):
        for i in range(images // classes + (1 if c < images % classes else 0)):
            yield c, i


def _render_chunk(
    store: Store, seed: int, size: int, quality: int, names: list[str], systems: dict[int, IFSystem], items: list[tuple[int, int]]
) -> int:
    for c, i in items:
        rng = np.random.default_rng([seed, c, i])
        buf = io.BytesIO()
        Image.fromarray(render(systems[c], size, rng)).save(buf, "JPEG", quality=quality)
        store.write(f"{names[c]}/{i:06d}.jpg", buf.getvalue())
    return len(items)


def synth_corpus(
    dest: str,
    *,
    images: int,
    classes: int,
    size: int = 64,
    seed: int = 0,
    quality: int = 90,
    endpoint_url: str | None = None,
    max_in_flight: int = 16,
) -> CorpusResult:
    """Write `images` IFS-fractal JPEGs in `classes` class folders to `dest` (local or s3://), in Ray tasks."""
    import ray

    if images < 1 or classes < 1 or images < classes:
        raise ValueError(f"need images >= classes >= 1, got images={images}, classes={classes}")
    if not 8 <= size <= 4096:
        raise ValueError(f"size must be within 8..4096, got {size}")
    start = time.perf_counter()
    store = open_dest(dest, endpoint_url)
    names = fractal_class_names(classes)
    connect()  # joined here, not by Ray's auto-init: see pipelines.core.cluster
    task = ray.remote(num_cpus=1)(_render_chunk)
    pending: list[ray.ObjectRef] = []
    done = 0
    chunk: list[tuple[int, int]] = []

    cache: dict[int, IFSystem] = {}

    def submit(items: list[tuple[int, int]]) -> None:
        for c in {c for c, _ in items} - cache.keys():
            cache[c] = class_system(seed, c)
        systems = {c: cache[c] for c in {c for c, _ in items}}
        pending.append(task.remote(store, seed, size, quality, names, systems, items))

    for item in assignments(images, classes):
        chunk.append(item)
        if len(chunk) == CHUNK:
            submit(chunk)
            chunk = []
        while len(pending) >= max_in_flight:
            ready, pending[:] = ray.wait(pending, num_returns=1)
            done += sum(ray.get(ready))
    if chunk:
        submit(chunk)
    done += sum(ray.get(pending))
    return CorpusResult(dest, done, names, time.perf_counter() - start)


def export_digits(
    dest: str, *, size: int = 32, test_fraction: float = 0.2, seed: int = 0, endpoint_url: str | None = None
) -> CorpusResult:
    """Write scikit-learn's digits as `<dest>/<split>/<digit>/<i>.png` plus `<dest>/manifest.csv`.

    The split is stratified and fixed by `seed` (1,437 train / 360 test at the
    defaults). Keys in the manifest are relative to `dest`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 8 <= size <= 1024:
        raise ValueError(f"size must be within 8..1024, got {size}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be within (0, 1), got {test_fraction}")
    start = time.perf_counter()
    store = open_dest(dest, endpoint_url)
    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(int)
    _, test_idx = train_test_split(
        np.arange(len(labels)), test_size=test_fraction, stratify=labels, random_state=seed
    )
    test = set(test_idx.tolist())
    rows = []
    for i, (img, label) in enumerate(zip(pixels, labels)):
        split = "test" if i in test else "train"
        key = f"{split}/{label}/{i:04d}.png"
        buf = io.BytesIO()
        Image.fromarray(img, "L").resize((size, size), Image.Resampling.BICUBIC).save(buf, "PNG")
        store.write(key, buf.getvalue())
        rows.append((key, int(label), split))
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["key", "label", "split"])
    writer.writerows(rows)
    store.write("manifest.csv", text.getvalue().encode())
    return CorpusResult(dest, len(rows), [str(d) for d in range(10)], time.perf_counter() - start)

"""Corpora: IFS fractals (deterministic, class folders, parallel in Ray) and the scikit-learn digits."""

from __future__ import annotations

import csv
import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.corpora.images import FILL_RANGE, class_system, export_digits, fill_fraction, fractal_class_names, render, synth_corpus
from pipelines.image.ingest import run_ingest
from pipelines.image.configs import IngestConfig


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_class_systems_are_contractive_and_not_degenerate():
    for label in range(6):
        system = class_system(0, label)
        assert 2 <= len(system.probs) <= 4 and np.isclose(system.probs.sum(), 1)
        assert np.linalg.norm(system.linear, ord=2, axis=(1, 2)).max() < 1
        assert FILL_RANGE[0] <= fill_fraction(system, np.random.default_rng(9)) <= FILL_RANGE[1]


def test_class_systems_depend_on_seed_and_class_only():
    assert np.array_equal(class_system(1, 2).linear, class_system(1, 2).linear)
    assert not np.array_equal(class_system(1, 2).linear, class_system(1, 3).linear)
    assert not np.array_equal(class_system(1, 2).linear, class_system(2, 2).linear)


def test_images_of_a_class_vary_but_are_reproducible():
    system = class_system(0, 0)
    a = render(system, 32, np.random.default_rng([0, 0, 1]))
    again = render(system, 32, np.random.default_rng([0, 0, 1]))
    b = render(system, 32, np.random.default_rng([0, 0, 2]))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, again) and not np.array_equal(a, b)
    assert a.std() > 5  # not a blank canvas


@pytest.fixture(scope="module")
def synth_runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        runs[name] = synth_corpus(str(root / name), images=22, classes=4, size=24, seed=seed)
    return root, runs


def test_synth_writes_jpegs_in_class_folders(synth_runs):
    root, runs = synth_runs
    files = tree(root / "a")
    assert runs["a"].images == 22 and runs["a"].classes == fractal_class_names(4)
    per_class = Counter(key.split("/")[0] for key in files)
    assert per_class == {"fractal-0000": 6, "fractal-0001": 6, "fractal-0002": 5, "fractal-0003": 5}
    image = Image.open(io.BytesIO(files["fractal-0001/000003.jpg"]))
    assert (image.format, image.size) == ("JPEG", (24, 24))


def test_synth_is_deterministic_by_seed(synth_runs):
    root, _ = synth_runs
    assert tree(root / "a") == tree(root / "b")
    assert tree(root / "a") != tree(root / "c")


def test_synth_writes_to_s3(ray_cluster, s3_env, s3_bucket, synth_runs):
    root, _ = synth_runs
    synth_corpus(f"s3://{s3_bucket}/fractals", images=22, classes=4, size=24, seed=0)
    client = s3_env.client()
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="fractals/")["Contents"]
    local = tree(root / "a")
    assert sorted(o["Key"].removeprefix("fractals/") for o in listed) == sorted(local)
    key = "fractal-0002/000001.jpg"
    assert client.get_object(Bucket=s3_bucket, Key=f"fractals/{key}")["Body"].read() == local[key]


def test_synth_refuses_fewer_images_than_classes(tmp_path):
    with pytest.raises(ValueError, match="images >= classes"):
        synth_corpus(str(tmp_path), images=3, classes=5)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    dest = tmp_path_factory.mktemp("digits")
    result = export_digits(str(dest), size=16)
    with open(dest / "manifest.csv") as f:
        rows = list(csv.DictReader(f))
    return dest, result, rows


def test_digits_export_writes_all_1797_images(digits):
    dest, result, rows = digits
    assert result.images == len(rows) == 1797
    assert len(list(dest.rglob("*.png"))) == 1797
    assert all((dest / row["key"]).is_file() for row in rows[:50])
    assert Image.open(dest / rows[0]["key"]).size == (16, 16)


def test_digits_split_is_fixed_and_stratified(digits, tmp_path):
    _, _, rows = digits
    splits = Counter(row["split"] for row in rows)
    assert splits == {"train": 1437, "test": 360}
    per_class_test = Counter(row["label"] for row in rows if row["split"] == "test")
    assert set(per_class_test) == {str(d) for d in range(10)} and min(per_class_test.values()) >= 34
    export_digits(str(tmp_path), size=16)
    assert (tmp_path / "manifest.csv").read_bytes() == (digits[0] / "manifest.csv").read_bytes()


def test_ingest_honours_the_digits_split(ray_cluster, digits, tmp_path):
    dest, _, _ = digits
    config = IngestConfig(source=str(dest), output=str(tmp_path / "out"), manifest=str(dest / "manifest.csv"),
                          image_size=16, patch_size=4, shard_size=256)
    result = run_ingest(config)
    counts = result.counts
    assert (counts["train"], counts["val"], counts["test"], counts["rejected"]) == (1437, 0, 360, 0)
    assert result.manifest["classes"] == {str(d): d for d in range(10)}
    assert result.manifest["split_source"] == "manifest"


def test_cli_corpus_digits_prints_how_to_ingest(tmp_path):
    result = CliRunner().invoke(app, ["corpus", "digits", str(tmp_path / "d"), "--size", "8"])
    assert result.exit_code == 0, result.output
    assert "wrote 1797 digits" in result.output
    assert f"--manifest {tmp_path / 'd'}/manifest.csv" in result.output


def test_cli_corpus_synth_writes_the_corpus(ray_cluster, tmp_path):
    result = CliRunner().invoke(app, ["corpus", "synth", str(tmp_path / "s"), "--images", "6", "--classes", "2", "--size", "16"])
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "s").rglob("*.jpg"))) == 6


def test_cli_reports_bad_arguments_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["corpus", "synth", str(tmp_path / "s"), "--images", "2", "--classes", "5"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: need images >= classes >= 1, got images=2, classes=5 (log: ")

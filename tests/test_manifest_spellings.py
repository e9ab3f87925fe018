"""A label manifest that names one local file twice, under two spellings, is refused in one line.

In a local folder `./c0/000.jpg` and `c0//000.jpg` read the file `c0/000.jpg` (`LocalStore.listed_key`). Kept as
two rows, one image would be two samples, with two labels, and split by each spelling's hash: one copy in
train and one in test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.core.errors import IngestError
from pipelines.image.configs import IngestConfig
from pipelines.image.ingest import run_ingest
from tests.corpus_files import jpeg


def _corpus(root: Path, n: int = 6) -> list[str]:
    keys = [f"c{i % 2}/{i:03d}.jpg" for i in range(n)]
    for i, key in enumerate(keys):
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(jpeg(i, (20, 24)))
    return keys


@pytest.mark.parametrize("spelling", ["./c1/003.jpg", "c1//003.jpg"])
def test_a_manifest_naming_one_local_file_under_two_spellings_is_refused_in_one_line(ray_cluster, tmp_path, spelling):
    keys = _corpus(tmp_path / "src")
    rows = ["key,label"] + [f"{k},{k[:2]}" for k in keys] + [f"{spelling},c9"]
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    config = IngestConfig(source=str(tmp_path / "src"), output=str(tmp_path / "out"), image_size=16, patch_size=4,
                          shard_size=4, manifest=str(tmp_path / "labels.csv"))
    with pytest.raises(IngestError) as failed:
        run_ingest(config)
    message = str(failed.value)
    assert "\n" not in message
    assert message == f"{tmp_path / 'src' / 'c1' / '003.jpg'}: the label manifest names it twice " \
                      f"(again as {spelling!r})"

"""`vitpipe demo --video` without the `video` extra: one line naming the extra to install, before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_video_demo_without_pyav_names_the_extra_to_install(tmp_path: Path) -> None:
    # A package named `av` first on the path that fails to import as a missing PyAV does.
    fake = tmp_path / "no-pyav" / "av"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'av'\", name='av')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}
    workdir = tmp_path / "work"
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "demo", "--video", "--workdir", str(workdir)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "pip install 'vitpipe[video]'" in lines[0] and "Traceback" not in done.stderr
    assert not workdir.exists()  # it stopped before writing corpora or starting Ray

"""`vitpipe demo`: the whole pipeline on this machine, with nothing running beforehand.

A local Ray, a `sqlite:///` MLflow store and one working directory, which holds
every file the demo writes (MLflow's artifacts too: `<workdir>/mlartifacts`, beside its
`mlflow.db`). It writes a synthetic fractal corpus and scikit-learn's digits, then runs
`pipelines/specs/demo.yaml`: pretrain a small ViT on the fractals, fine-tune on
the digits from that checkpoint and from scratch, and probe the pretrained
features few-shot. Both fine-tuned models are registered as versions of
`vitpipe-demo-digits` with their lineage; the better one carries the
`champion` alias (the UI's Models page). The closing table is the paper's central claim at toy scale:
pretrained against scratch test accuracy.

With `video=True` (`vitpipe demo --video`) it writes a generated video corpus
instead of the digits and runs `pipelines/specs/video_demo.yaml`: a VTN whose
per-frame backbone is that pretrained ViT, evaluated full-video and multi-view,
registered as `vitpipe-demo-vtn`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from pipelines.core.cluster import connect
from pipelines.core.errors import VitpipeError
from pipelines.corpora.images import export_digits, synth_corpus
from pipelines.corpora.videos import synth_video_corpus
from pipelines.runner import PipelineResult, run_pipeline
from pipelines.spec import PipelineSpec
from pipelines.spec_file import load_spec

SPECS = Path(__file__).resolve().parent / "specs"
DEMO_SPEC = SPECS / "demo.yaml"
VIDEO_DEMO_SPEC = SPECS / "video_demo.yaml"
FRACTALS = dict(images=6000, classes=100, size=32)
DIGITS_SIZE = 16
VIDEOS = dict(videos=240, classes=6, size=32, frames=48)
_DONE = ".vitpipe-corpus-complete"

# The demo's own Ray holds at most this much in its object store (Ray's default is 30% of the machine's
# memory), so the demo's footprint does not grow with the machine; its data are a few MB.
OBJECT_STORE_BYTES = 2**30
# Ray's memory monitor kills workers when the whole machine is 95% full, whoever fills it: off for the
# demo's own capped cluster, so other programs' memory does not fail a demo that fits.
_SYSTEM_CONFIG = {"memory_monitor_refresh_ms": 0}


def _write_once(path: Path, write: Callable[[], object]) -> None:
    """Run `write` unless `path` holds the marker of an earlier complete write."""
    if not (path / _DONE).exists():
        write()
        (path / _DONE).touch()


def _write_corpora(workdir: Path, video: bool = False) -> None:
    """The demo's corpora under `workdir/corpus`, each written once: fractals, and the digits or the videos."""
    corpus = workdir / "corpus"
    _write_once(corpus / "fractals", lambda: synth_corpus(str(corpus / "fractals"), seed=0, **FRACTALS))
    if video:
        _write_once(corpus / "videos", lambda: synth_video_corpus(str(corpus / "videos"), seed=0, **VIDEOS))
    else:
        _write_once(corpus / "digits", lambda: export_digits(str(corpus / "digits"), size=DIGITS_SIZE))


def demo_spec(workdir: Path, overrides: list[str] = (), video: bool = False) -> PipelineSpec:
    """The demo spec (or the video demo's) with every path under `workdir`, plus the caller's `--set` overrides."""
    corpus = workdir / "corpus"
    placed = [f"storage.root={workdir}", f"tracking_uri=sqlite:///{workdir}/mlflow.db",
              f"fractals.source={corpus / 'fractals'}"]
    if video:
        placed.append(f"videos.source={corpus / 'videos'}")
    else:
        placed += [f"digits.source={corpus / 'digits'}", f"digits.manifest={corpus / 'digits'}/manifest.csv"]
    return load_spec(VIDEO_DEMO_SPEC if video else DEMO_SPEC, [*placed, *overrides])


def comparison(result: PipelineResult) -> str:
    """Pretrained against scratch: fine-tuned test accuracy, and the few-shot probe."""
    tuned = {name: result.outputs.get(name) for name in ("finetune_pretrained", "finetune_scratch")}
    lines = ["", "digits test accuracy after fine-tuning (best trial of each sweep):"]
    for name, label in (("finetune_pretrained", "from the fractal-pretrained ViT"), ("finetune_scratch", "from scratch")):
        acc = getattr(tuned[name], "test_accuracy", None)
        lines.append(f"  {label:<34} {'failed' if acc is None else f'{100 * acc:.1f}%'}")
    fewshot = result.outputs.get("fewshot")
    if fewshot is not None:
        shots = ", ".join(f"{k}-shot {100 * v:.1f}%" for k, v in sorted(fewshot.accuracy.items()))
        lines.append(f"few-shot linear probe of the pretrained features: {shots} (chance {100 * fewshot.chance:.0f}%)")
    return "\n".join(lines)


def video_comparison(result: PipelineResult) -> str:
    """The VTN's test accuracy and wall time, full-video against multi-view (and with frames shuffled)."""
    vtn = result.outputs.get("vtn")
    if vtn is None:
        return "\nthe VTN stage did not finish"
    lines = ["", "video test accuracy of the VTN on the pretrained ViT:"]
    for row in vtn.evaluation:
        label = f"{row['mode'].replace('_', '-')}" + (", frames shuffled" if row["frame_order"] == "shuffled" else "")
        lines.append(f"  {label:<30} {100 * row['top1']:.1f}%  ({row['wall_s']:.1f}s)")
    return "\n".join(lines)


def _require_video_extra() -> None:
    """Fail in one line naming the extra to install when PyAV (the `video` extra) does not import."""
    try:
        import av  # noqa: F401  (only whether it imports matters here)
    except ImportError as err:
        raise VitpipeError(f"the video demo needs PyAV, which did not import ({err}): "
                           "pip install 'vitpipe[video]'") from None


def start_ray() -> None:
    """Join `$RAY_ADDRESS` when set; else start the demo's own local Ray, its object store capped.

    Its own, not one that `ray start` left running: a first run should not depend on how another cluster
    was sized or what it is busy with.
    """
    if os.environ.get("RAY_ADDRESS"):
        connect()
        return
    # Train's placement-group cleaner finds the state API through this; unset, with other Ray clusters on
    # the machine it finds several and gives up, and finished trials' placement groups leak.
    port = _free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    connect("local", object_store_memory=OBJECT_STORE_BYTES, dashboard_port=port, _system_config=_SYSTEM_CONFIG)


def _free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(workdir: str | os.PathLike[str] = "vitpipe-work", overrides: list[str] = (),
             video: bool = False) -> tuple[PipelineResult, str]:
    """Write the corpora, run the demo pipeline (or the video demo's); returns its result and the comparison text."""
    if video:
        _require_video_extra()  # before starting Ray or writing anything
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(root, list(overrides), video=video)
    start_ray()
    _write_corpora(root, video=video)
    result = run_pipeline(spec)
    return result, video_comparison(result) if video else comparison(result)


__all__ = ["DEMO_SPEC", "OBJECT_STORE_BYTES", "VIDEO_DEMO_SPEC", "comparison", "demo_spec", "run_demo", "start_ray",
           "video_comparison"]

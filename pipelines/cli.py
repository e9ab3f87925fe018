"""The `vitpipe` command line.

Every command reports a `VitpipeError` (and invalid arguments) as one line on
stderr and exits with status 1 (`pipelines.cli_errors`); set `VITPIPE_DEBUG=1`
to see the traceback.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import typer

from pipelines import __version__, cli_jobs, jobs
from pipelines.cli_errors import ErrorReportingGroup, fail
from pipelines.core.cluster import connect
from pipelines.core.logfile import console_handler, quiet_artifact_bars
from pipelines.core.stage_config import load_stage_config, parse_overrides
from pipelines.core.uris import resolve_tracking_uri, strip_userinfo
from pipelines.stages import STAGES


class _Group(ErrorReportingGroup):
    """Takes `--ray-address`, the stage commands' old name for `--address`, so old scripts run (not in --help)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        renamed = ["--address" + a.removeprefix("--ray-address") if a.split("=")[0] == "--ray-address" else a
                   for a in args[:end]]
        return super().parse_args(ctx, renamed + args[end:])


app = typer.Typer(cls=_Group, no_args_is_help=True, add_completion=False,
                  help="Distributed ViT pretraining and transfer.")
corpus_app = typer.Typer(no_args_is_help=True, help="Write corpora to run the pipeline on.")
app.add_typer(corpus_app, name="corpus")
# One name for the cluster everywhere: here the Ray (GCS) address a stage joins; the job commands' --address
# is the cluster's dashboard, as in Ray's own `ray start --address` and `ray job submit --address`.
_RAY = typer.Option(None, "--address",
                    help="Ray cluster to join, e.g. HEAD:6379 (default: RAY_ADDRESS, else a local one).")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"vitpipe {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print vitpipe's version and exit.")) -> None:
    """Distributed ViT pretraining and transfer."""
    quiet_artifact_bars()


def _init_ray(address: Optional[str]) -> None:
    """Connect to `address` now; without one, Ray starts (or joins RAY_ADDRESS) only when work begins."""
    if address:
        connect(address)


def _log_progress() -> None:
    """Show vitpipe's own INFO lines on stderr (not those of botocore and friends)."""
    console_handler().setLevel(logging.INFO)


@corpus_app.command("synth")
def corpus_synth(
    dest: str = typer.Argument(..., help="Local directory or s3://bucket/prefix."),
    images: int = typer.Option(1000, "--images", help="Number of images."),
    classes: int = typer.Option(10, "--classes", help="Number of classes (one fractal system each)."),
    size: int = typer.Option(64, "--size", help="Image side in pixels."),
    seed: int = typer.Option(0, "--seed"),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint."),
    ray_address: Optional[str] = _RAY,
) -> None:
    """Write a formula-driven (IFS fractal) corpus as JPEGs in class folders."""
    from pipelines.corpora.images import synth_corpus  # deferred: PIL and numpy, kept out of CLI start-up

    _init_ray(ray_address)
    result = synth_corpus(dest, images=images, classes=classes, size=size, seed=seed, endpoint_url=endpoint_url)
    typer.echo(f"wrote {result.images} images in {len(result.classes)} classes to {dest} ({result.seconds:.1f}s)")


@corpus_app.command("digits")
def corpus_digits(
    dest: str = typer.Argument(..., help="Local directory or s3://bucket/prefix."),
    size: int = typer.Option(32, "--size", help="Upscaled image side in pixels."),
    test_fraction: float = typer.Option(0.2, "--test-fraction"),
    seed: int = typer.Option(0, "--seed", help="Seed of the fixed stratified split."),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint."),
) -> None:
    """Export scikit-learn's handwritten digits with a fixed train/test split (manifest.csv)."""
    from pipelines.corpora.images import export_digits  # deferred: PIL and numpy, kept out of CLI start-up

    result = export_digits(dest, size=size, test_fraction=test_fraction, seed=seed, endpoint_url=endpoint_url)
    manifest = f"{dest.rstrip('/')}/manifest.csv"
    typer.echo(f"wrote {result.images} digits to {dest} ({result.seconds:.1f}s)")
    typer.echo(f"ingest with: vitpipe ingest {dest} OUTPUT --manifest {manifest}")


@corpus_app.command("synth-video")
def corpus_synth_video(
    dest: str = typer.Argument(..., help="Local directory or s3://bucket/prefix."),
    videos: int = typer.Option(120, "--videos", help="Number of videos."),
    classes: int = typer.Option(6, "--classes", help="Number of classes (2-15; some differ only in frame order)."),
    size: int = typer.Option(32, "--size", help="Frame side in pixels (even)."),
    frames: int = typer.Option(32, "--frames", help="Typical frames per video (each varies by ±25%)."),
    seed: int = typer.Option(0, "--seed"),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint."),
    ray_address: Optional[str] = _RAY,
) -> None:
    """Write a generated video corpus (digits moving along class paths) as MP4s in class folders."""
    from pipelines.corpora.videos import synth_video_corpus  # deferred: PIL and numpy, kept out of CLI start-up

    _init_ray(ray_address)
    result = synth_video_corpus(dest, videos=videos, classes=classes, size=size, frames=frames, seed=seed,
                                endpoint_url=endpoint_url)
    typer.echo(f"wrote {result.images} videos in {len(result.classes)} classes to {dest} ({result.seconds:.1f}s)")


@app.command("ingest")
def ingest(
    source: str = typer.Argument(..., help="Corpus: local directory or s3://bucket/prefix of <class>/<file> objects, "
                                 "of .tar or .parquet files, or a brace range such as s3://b/p/{000000..000099}.tar."),
    output: str = typer.Argument(..., help="Where shards and manifest.json go (local or s3://)."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="CSV/Parquet of key,label[,split] instead of class folders."),
    input_format: str = typer.Option("objects", "--input-format",
                                     help="objects (one per image), webdataset (tar shards) or parquet (image bytes)."),
    unlabeled: bool = typer.Option(False, "--unlabeled", help="No classes: label null in the shards."),
    label_field: Optional[str] = typer.Option(None, "--label-field", help="webdataset: label from this json field, not cls."),
    image_column: str = typer.Option("image", "--image-column", help="parquet: column of image bytes or {bytes, path}."),
    label_column: str = typer.Option("label", "--label-column", help="parquet: column of class numbers."),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint (default AWS_ENDPOINT_URL)."),
    image_size: int = typer.Option(224, "--image-size"),
    patch_size: int = typer.Option(16, "--patch-size"),
    val_fraction: float = typer.Option(0.1, "--val-fraction"),
    test_fraction: float = typer.Option(0.0, "--test-fraction"),
    max_pixels: Optional[int] = typer.Option(None, "--max-pixels", help="Reject larger images (default: Pillow's limit)."),
    max_object_bytes: Optional[int] = typer.Option(None, "--max-object-bytes", help="Reject larger objects unread (default 64 MiB)."),
    max_reject_fraction: float = typer.Option(0.01, "--max-reject-fraction"),
    shard_size: int = typer.Option(512, "--shard-size"),
    seed: int = typer.Option(0, "--seed"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Shard tasks at once (default: all CPUs)."),
    ray_address: Optional[str] = _RAY,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Decode, resize and patchify a corpus into Parquet shards plus manifest.json (resumable)."""
    fields: dict[str, Any] = dict(
        source=source, output=output, manifest=manifest, endpoint_url=endpoint_url, image_size=image_size,
        patch_size=patch_size, val_fraction=val_fraction, test_fraction=test_fraction,
        max_reject_fraction=max_reject_fraction, shard_size=shard_size, seed=seed, concurrency=concurrency,
        input_format=input_format, labeled=not unlabeled, label_field=label_field, image_column=image_column,
        label_column=label_column,
    )
    if max_pixels is not None:
        fields["max_pixels"] = max_pixels
    if max_object_bytes is not None:
        fields["max_object_bytes"] = max_object_bytes
    _run_ingest("ingest", fields, ray_address, as_json)


@app.command("video-ingest")
def video_ingest(
    source: str = typer.Argument(..., help="Videos: local directory or s3://bucket/prefix of <class>/<file> objects."),
    output: str = typer.Argument(..., help="Where shards and manifest.json go (local or s3://)."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="CSV/Parquet of key,label[,split] instead of class folders."),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint (default AWS_ENDPOINT_URL)."),
    frame_size: int = typer.Option(224, "--frame-size", help="Shorter side resized to this, then centre crop."),
    sampling: str = typer.Option("full", "--sampling", help="full: frames uniformly over the video; clips: clips."),
    max_frames: int = typer.Option(250, "--max-frames", help="full: at most this many frames per video."),
    clip_length: int = typer.Option(16, "--clip-length", help="clips: frames per clip."),
    frame_stride: int = typer.Option(1, "--frame-stride", help="clips: source frames between a clip's frames."),
    clip_stride: int = typer.Option(16, "--clip-stride", help="clips: source frames between clip starts."),
    max_clips: int = typer.Option(10, "--max-clips", help="clips: at most this many per video."),
    max_object_bytes: int = typer.Option(2**30, "--max-object-bytes", help="Reject larger videos unread."),
    val_fraction: float = typer.Option(0.1, "--val-fraction"),
    test_fraction: float = typer.Option(0.0, "--test-fraction"),
    max_reject_fraction: float = typer.Option(0.01, "--max-reject-fraction"),
    shard_size: int = typer.Option(16, "--shard-size", help="Videos per shard."),
    seed: int = typer.Option(0, "--seed"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Shard tasks at once (default: all CPUs)."),
    ray_address: Optional[str] = _RAY,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Decode, sample and resize videos into Parquet shards of frames plus manifest.json (resumable)."""
    fields = dict(
        source=source, output=output, manifest=manifest, endpoint_url=endpoint_url, frame_size=frame_size,
        sampling=sampling, max_frames=max_frames, clip_length=clip_length, frame_stride=frame_stride,
        clip_stride=clip_stride, max_clips=max_clips, max_object_bytes=max_object_bytes,
        val_fraction=val_fraction, test_fraction=test_fraction,
        max_reject_fraction=max_reject_fraction, shard_size=shard_size, seed=seed, concurrency=concurrency,
    )
    _run_ingest("video_ingest", fields, ray_address, as_json)


def _run_ingest(kind: str, fields: dict[str, Any], ray_address: Optional[str], as_json: bool) -> None:
    """Validate and run an ingest kind from its command's options; print what it wrote (or found complete)."""
    stage = STAGES[kind]
    config = load_stage_config(stage.config_model, kind, fields, {})  # one line; pydantic's own error echoes the value
    _log_progress()
    _init_ray(ray_address)
    result = stage.run(config)
    output, counts = fields["output"], result.counts
    noun = "videos" if kind == "video_ingest" else "images"
    if as_json:
        typer.echo(json.dumps({"output": result.output, "counts": counts, "skipped": result.skipped,
                               "shards_written": result.shards_written, "shards_reused": result.shards_reused,
                               "content_hash": result.manifest["content_hash"]}))
    elif result.skipped:
        typer.echo(f"{output}: already complete for this config ({counts[noun]} {noun})")
    else:
        frames = f", {counts['frames']} frames" if noun == "videos" else ""
        typer.echo(
            f"{output}: {counts[noun]} {noun}{frames} (train {counts['train']}, val {counts['val']}, "
            f"test {counts['test']}), {counts['rejected']} rejected, {result.shards_written} shards written, "
            f"{result.shards_reused} reused"
        )


_CONFIG = typer.Argument(..., help="YAML/JSON stage config.")
_SETS = typer.Option([], "--set", help="Override a config field: KEY=VALUE (VALUE parsed as JSON when it can be).")


def _run_stage(kind: str, config: str, sets: list[str], ray_address: Optional[str]) -> None:
    """Load, validate and run one stage from its config file; print its result as JSON."""
    stage = STAGES[kind]
    cfg = load_stage_config(stage.config_model, kind, config, parse_overrides(sets))
    if "tracking_uri" in type(cfg).model_fields:
        from pipelines.core.tracking import check_server  # deferred: tracking imports MLflow

        check_server(resolve_tracking_uri(cfg.tracking_uri))
    _log_progress()
    result = stage.run(cfg, ray_address=ray_address) if stage.takes_ray_address else stage.run(cfg)
    typer.echo(result.model_dump_json())


@app.command("pretrain")
def pretrain(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Pretrain a model on an ingest output with Ray Train, tracked in MLflow (resumes if interrupted)."""
    _run_stage("pretrain", config, sets, ray_address)


@app.command("finetune")
def finetune(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Fine-tuning sweep on Ray Tune; the best trial is tested and registered in MLflow."""
    _run_stage("finetune", config, sets, ray_address)


@app.command("embed")
def embed(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Store the pooled features of every image of an ingest output (Ray Data on an actor pool), tracked in MLflow."""
    _run_stage("embed", config, sets, ray_address)


@app.command("video-train")
def video_train(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Train a VTN on a video ingest output (backbone from a pretrain run), evaluate full-video and multi-view."""
    _run_stage("video_train", config, sets, ray_address)


@app.command("video-features")
def video_features(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Store per-frame backbone features of a video ingest output, so video-train can train on features alone."""
    _run_stage("video_features", config, sets, ray_address)


@app.command("evaluate")
def evaluate(config: str = _CONFIG, sets: list[str] = _SETS) -> None:
    """Few-shot linear evaluation (1/5/10/25-shot) of a pretrained model's frozen features."""
    _run_stage("evaluate", config, sets, None)


def _exit_if_failed(result: Any) -> None:
    """A pipeline with a failed stage: its one-line error on stderr and exit status 1."""
    if not result.ok:
        failed = next((r for r in result.rows if r.status == "failed"), None)
        fail(f"stage {failed.stage} failed: {failed.error}" if failed else "a stage did not finish")


_FORCE = typer.Option([], "--force", help="Run this stage again even if it already finished (repeatable).")


@app.command("run")
def run(
    spec: str = typer.Argument(..., help="Pipeline spec (YAML), e.g. pipelines/specs/demo.yaml."),
    sets: list[str] = typer.Option([], "--set", help="Override a field: STAGE.FIELD=VALUE (or a top-level key)."),
    address: Optional[str] = _RAY,
    force: list[str] = _FORCE,
) -> None:
    """Run a pipeline spec's stages in dependency order, reusing stages that already finished."""
    from pipelines.spec import check_forced  # deferred: pydantic models, not needed by the other commands
    from pipelines.spec_file import load_spec

    pipeline_spec = load_spec(spec, sets)  # before MLflow and Ray are imported: a bad spec is answered at once
    check_forced(pipeline_spec, force)
    from pipelines.core.tracking import browse_hint  # deferred: tracking imports MLflow
    from pipelines.runner import run_pipeline  # deferred: the runner imports MLflow and Ray

    _log_progress()
    result = run_pipeline(pipeline_spec, ray_address=address, force=force)
    typer.echo(result.table())
    typer.echo(f"pipeline run {result.run_id} in {strip_userinfo(result.tracking_uri)}")
    typer.echo(browse_hint(result.tracking_uri, result.run_id))
    _exit_if_failed(result)


@app.command("demo")
def demo(
    workdir: str = typer.Option("vitpipe-work", "--workdir", help="Where corpora, shards, runs and mlflow.db go."),
    sets: list[str] = typer.Option([], "--set", help="Override a demo spec field: STAGE.FIELD=VALUE."),
    video: bool = typer.Option(False, "--video", help="The video demo: a VTN on the pretrained ViT, on generated videos."),
) -> None:
    """Pretrain on synthetic fractals, fine-tune on digits from it and from scratch, and compare (local, ~10 min on 2 cores)."""
    from pipelines.core.tracking import browse_hint  # deferred: tracking imports MLflow
    from pipelines.demo import run_demo  # deferred: the demo imports MLflow

    _log_progress()
    result, comparison = run_demo(workdir, sets, video=video)
    typer.echo(result.table())
    typer.echo(comparison)
    typer.echo("\n" + browse_hint(result.tracking_uri, result.run_id))  # the demo's store, or `--set tracking_uri`
    _exit_if_failed(result)


@app.command("runs")
def runs(
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="Default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."),
) -> None:
    """A table of pipeline runs in the MLflow store (INTERRUPTED: its process is gone; run the spec again to resume)."""
    from pipelines.runner import format_table, pipeline_runs  # deferred: the runner imports MLflow

    rows = pipeline_runs(tracking_uri)
    if not rows:
        typer.echo("no pipeline runs")
        return
    typer.echo(format_table(list(rows[0]), [list(r.values()) for r in rows]))


for _name, _command in cli_jobs.COMMANDS.items():
    app.command(_name)(_command)

_FROM_FILE = [kind for kind, s in STAGES.items() if s.from_file]  # the kinds `vitpipe stage` runs


@app.command("stage")
def stage(
    kind: str = typer.Argument(..., help=f"{', '.join(_FROM_FILE[:-1])} or {_FROM_FILE[-1]}."),
    config: str = _CONFIG,
    sets: list[str] = _SETS,
    # Not from RAY_ADDRESS: Ray sets it inside every job, where a stage must run, not submit itself again.
    address: Optional[str] = typer.Option(None, "--address", help="Submit as a Ray job to this cluster's dashboard."),
    wait: bool = cli_jobs.WAIT,
) -> None:
    """Run one stage alone: here, or with --address as a Ray job of its own (several can queue on one cluster)."""
    if kind not in _FROM_FILE:
        raise ValueError(f"stage kind {kind!r} is not one of {', '.join(_FROM_FILE)}")
    if address is None:
        _run_stage(kind, config, sets, None)
        return
    # A bad config, or one whose runs would be lost with the job's working directory, fails here.
    cfg = load_stage_config(STAGES[kind].config_model, kind, config, parse_overrides(sets))
    job_env = jobs.job_runtime_env()
    fallback = job_env["env_vars"].get("MLFLOW_TRACKING_URI")
    jobs.check_tracking_uri(getattr(cfg, "tracking_uri", None) or fallback, f"config {config}")
    command = kind.replace("_", "-")  # the subcommand that runs this kind
    cli_jobs.submit_job(address, [command, jobs.job_path(config), *cli_jobs.repeat("--set", sets)], wait,
                        runtime_env=job_env)


if __name__ == "__main__":  # pragma: no cover - `python -m pipelines.cli`, as Ray jobs run it
    app()

"""The `vitpipe` command line.

Every command reports a `VitpipeError` (and invalid arguments) as one line on
stderr and exits with status 1; set `VITPIPE_DEBUG=1` to see the traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Optional

import click
import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from pipelines.errors import VitpipeError


def one_line(err: BaseException) -> str:
    """The message a user sees for an error raised by a command."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or err.title
        message = str(first.get("msg", err)).removeprefix("Value error, ")
        return f"{where}: {message}"
    return " ".join(str(err).split())


class _Group(TyperGroup):
    """Turns user-facing errors of any subcommand into `error: <one line>` and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (VitpipeError, ValidationError, ValueError) as err:
            if os.environ.get("VITPIPE_DEBUG"):
                raise
            click.echo(f"error: {one_line(err)}", err=True)
            ctx.exit(1)


app = typer.Typer(cls=_Group, no_args_is_help=True, add_completion=False, help="Distributed ViT pretraining and transfer.")
corpus_app = typer.Typer(no_args_is_help=True, help="Write corpora to run the pipeline on.")
app.add_typer(corpus_app, name="corpus")


def _init_ray(address: Optional[str]) -> None:
    """Connect to `address` now; without one, Ray starts (or joins RAY_ADDRESS) only when work begins."""
    import ray

    if address and not ray.is_initialized():
        ray.init(address=address)


def _log_progress() -> None:
    """Show vitpipe's own INFO lines on stderr (not those of botocore and friends)."""
    logger = logging.getLogger("vitpipe")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@corpus_app.command("synth")
def corpus_synth(
    dest: str = typer.Argument(..., help="Local directory or s3://bucket/prefix."),
    images: int = typer.Option(1000, "--images", help="Number of images."),
    classes: int = typer.Option(10, "--classes", help="Number of classes (one fractal system each)."),
    size: int = typer.Option(64, "--size", help="Image side in pixels."),
    seed: int = typer.Option(0, "--seed"),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster (default: RAY_ADDRESS or local)."),
) -> None:
    """Write a formula-driven (IFS fractal) corpus as JPEGs in class folders."""
    from pipelines.corpus import synth_corpus

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
    from pipelines.corpus import export_digits

    result = export_digits(dest, size=size, test_fraction=test_fraction, seed=seed, endpoint_url=endpoint_url)
    manifest = f"{dest.rstrip('/')}/manifest.csv"
    typer.echo(f"wrote {result.images} digits to {dest} ({result.seconds:.1f}s)")
    typer.echo(f"ingest with: vitpipe ingest {dest} OUTPUT --manifest {manifest}")


@app.command("ingest")
def ingest(
    source: str = typer.Argument(..., help="Corpus: local directory or s3://bucket/prefix of <class>/<file> objects."),
    output: str = typer.Argument(..., help="Where shards and manifest.json go (local or s3://)."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="CSV/Parquet of key,label[,split] instead of class folders."),
    endpoint_url: Optional[str] = typer.Option(None, "--endpoint-url", help="S3-compatible endpoint (default AWS_ENDPOINT_URL)."),
    image_size: int = typer.Option(224, "--image-size"),
    patch_size: int = typer.Option(16, "--patch-size"),
    val_fraction: float = typer.Option(0.1, "--val-fraction"),
    test_fraction: float = typer.Option(0.0, "--test-fraction"),
    max_pixels: Optional[int] = typer.Option(None, "--max-pixels", help="Reject larger images (default: Pillow's limit)."),
    max_reject_fraction: float = typer.Option(0.01, "--max-reject-fraction"),
    shard_size: int = typer.Option(512, "--shard-size"),
    seed: int = typer.Option(0, "--seed"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Shard tasks at once (default: all CPUs)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster (default: RAY_ADDRESS or local)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Decode, resize and patchify a corpus into Parquet shards plus manifest.json (resumable)."""
    from pipelines.ingest import IngestConfig, run_ingest

    fields: dict[str, Any] = dict(
        source=source, output=output, manifest=manifest, endpoint_url=endpoint_url, image_size=image_size,
        patch_size=patch_size, val_fraction=val_fraction, test_fraction=test_fraction,
        max_reject_fraction=max_reject_fraction, shard_size=shard_size, seed=seed, concurrency=concurrency,
    )
    if max_pixels is not None:
        fields["max_pixels"] = max_pixels
    config = IngestConfig(**fields)
    _log_progress()
    _init_ray(ray_address)
    result = run_ingest(config)
    if as_json:
        typer.echo(json.dumps({"output": result.output, "counts": result.counts, "skipped": result.skipped,
                               "shards_written": result.shards_written, "shards_reused": result.shards_reused,
                               "content_hash": result.manifest["content_hash"]}))
    elif result.skipped:
        typer.echo(f"{output}: already complete for this config ({result.counts['images']} images)")
    else:
        c = result.counts
        typer.echo(
            f"{output}: {c['images']} images (train {c['train']}, val {c['val']}, test {c['test']}), "
            f"{c['rejected']} rejected, {result.shards_written} shards written, {result.shards_reused} reused"
        )


_CONFIG = typer.Argument(..., help="YAML/JSON stage config.")
_SETS = typer.Option([], "--set", help="Override a config field: KEY=VALUE (VALUE parsed as JSON when it can be).")
_RAY = typer.Option(None, "--ray-address", help="Ray cluster (default: RAY_ADDRESS or local).")


def _run_stage(module: str, config: str, sets: list[str], ray_address: Optional[str], *, uses_ray: bool = True) -> None:
    """Load, validate and run one stage; print its result as JSON."""
    import importlib

    from pipelines.stage_config import parse_overrides

    stage = importlib.import_module(f"pipelines.{module}")
    cfg = stage.load_config(config, **parse_overrides(sets))
    _log_progress()
    run = getattr(stage, f"run_{module}")
    result = run(cfg, ray_address=ray_address) if uses_ray else run(cfg)
    typer.echo(result.model_dump_json())


@app.command("pretrain")
def pretrain(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Pretrain a model on an ingest output with Ray Train, tracked in MLflow (resumes if interrupted)."""
    _run_stage("pretrain", config, sets, ray_address)


@app.command("finetune")
def finetune(config: str = _CONFIG, sets: list[str] = _SETS, ray_address: Optional[str] = _RAY) -> None:
    """Fine-tuning sweep on Ray Tune; the best trial is tested and registered in MLflow."""
    _run_stage("finetune", config, sets, ray_address)


@app.command("evaluate")
def evaluate(config: str = _CONFIG, sets: list[str] = _SETS) -> None:
    """Few-shot linear evaluation (1/5/10/25-shot) of a pretrained model's frozen features."""
    _run_stage("evaluate", config, sets, None, uses_ray=False)


def main() -> None:  # pragma: no cover - console entry for `python -m pipelines.cli`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

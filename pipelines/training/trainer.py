"""The driver's side of a Ray Train run: stage the start, build and fit the trainer, log what it left.

Every stage that trains (pretrain, the fine-tune trials, video training) builds
its `TorchTrainer` with `build_trainer`, whose workers run the one worker loop
(`pipelines.training.loop`) with the stage's hooks.
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import vit
from pipelines.core import registry, storage, tracking
from pipelines.core.stopping import signal_handlers_restored
from pipelines.core.errors import VitpipeError, error_line, find_vitpipe_error
from pipelines.core.uris import Unprinted
from pipelines.training.hooks import BEST_DIR, BEST_INFO_FILE, DIVERGED_FILE, LoopHooks
from pipelines.training.loop import train_loop_per_worker
from pipelines.training.recipe import Workers


class TrainingDivergedError(VitpipeError):
    """The loss or gradients became NaN/inf; the last good checkpoint is kept."""


def storage_location(config: Any, experiment_id: str) -> tuple[str, Any]:
    """`(storage_path, storage_filesystem)` for Ray Train's RunConfig: the folder of MLflow experiment
    `experiment_id` in `config.storage` (with `endpoint_url`), where its runs keep their files by run name.

    A default run name is the config's hash, the same in every experiment: one folder for all of them made
    the same config in a second experiment resume the first one's checkpoints (and twins write into one).
    """
    path, filesystem = storage.ray_storage(config.storage, endpoint_url=config.endpoint_url)
    return f"{path}/{experiment_id}", filesystem


def stage_init(model: Any, storage_path: str, filesystem: Any, run_name: str) -> str:
    """Copy the starting checkpoint into the storage once; returns its path there (workers read it)."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    target = f"{storage_path}/{run_name}-work/init"
    if fs.get_file_info(f"{target}/model.safetensors").type == pafs.FileType.File:
        return target  # a resumed run keeps the weights its first workers started from
    with tempfile.TemporaryDirectory() as tmp:
        vit.save_checkpoint(model, tmp)
        fs.create_dir(target)
        pafs.copy_files(tmp, target, destination_filesystem=fs)
    return target


def build_trainer(
    loop_config: dict[str, Any],
    *,
    run_name: str,
    location: tuple[str, Any],
    workers: Workers,
    max_failures: int,
    keep: int,
    datasets: dict[str, Any],
    hooks: LoopHooks | None = None,
    callbacks: Sequence[Any] = (),
    preserve_order: bool = True,
) -> Any:
    """A `TorchTrainer` running the worker loop with `hooks` on `loop_config` (settings, maybe `DRIVER_INPUTS`).

    `location` is `(storage_path, filesystem)`; Ray Train keeps the last `keep`
    checkpoints of run `run_name` there and restarts a failed worker group up to
    `max_failures` times. With `preserve_order` Ray Data keeps the rows in the
    datasets' order, so a seeded run streams the same batches.
    """
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    dataset_config = None
    if preserve_order:
        # The context's own options otherwise, as Train's defaults. Copied, since Ray's helper for this
        # passes a deprecated field and warns on every run.
        options = copy.copy(ray.data.DataContext.get_current().execution_options)
        options.preserve_order = True
        dataset_config = ray.train.DataConfig(execution_options=options)
    for dataset in datasets.values():
        # Training shows its own step line. Ray Data's bars, drawn in the split's actor and forwarded, drowned
        # it (1,300 bar lines against 60 step lines in the demo's first five minutes of log). Each dataset's
        # own context: the driver's stays as the user set it.
        dataset.context.enable_progress_bars = False
    storage_path, filesystem = location
    if loop_config.get("tracking_uri"):  # it may hold a password (http://user:pw@host)
        loop_config = {**loop_config, "tracking_uri": Unprinted(loop_config["tracking_uri"])}
    return TorchTrainer(
        functools.partial(train_loop_per_worker, hooks=hooks or LoopHooks()),
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers.num_workers, use_gpu=workers.use_gpu, resources_per_worker=workers.worker_resources()
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
            callbacks=list(callbacks),
        ),
        datasets=datasets,
        dataset_config=dataset_config,
    )


def read_diverged(result: Any) -> dict[str, Any] | None:
    """The divergence note the workers left in the run dir, or None."""
    import pyarrow.fs as pafs

    path = f"{result.path}/{DIVERGED_FILE}"
    if result.filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with result.filesystem.open_input_stream(path) as f:
        return json.loads(f.read())


def clear_diverged(storage_path: str, filesystem: Any, run_name: str) -> None:
    """Remove a divergence note left by an earlier execution of this run (it is judged afresh)."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    path = f"{storage_path}/{run_name}/{DIVERGED_FILE}"
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def fit_trainer(trainer: Any, config: Any, client: Any, run_id: str, run_name: str, *, stage: str,
                location: tuple[str, Any]) -> Any:
    """`trainer.fit()` with the stage's error policy; returns Ray Train's Result.

    Worker errors become one `VitpipeError` line; a run whose loss went NaN/inf
    raises `TrainingDivergedError` naming the last good checkpoint. `config`
    needs `max_failures`; `location` is the trainer's `(storage_path, filesystem)`.
    """
    clear_diverged(*location, run_name)
    try:
        with signal_handlers_restored():
            result = trainer.fit()
    except Exception as err:  # Ray wraps worker errors; give the user one line
        known = find_vitpipe_error(err)
        if known is not None:
            raise known from err
        raise VitpipeError(f"{stage}: training failed (max_failures={config.max_failures}): {error_line(err)}") from err
    tracking.set_tags(client, run_id, {"vitpipe.storage_path": str(result.path)})
    diverged = read_diverged(result)
    if diverged is not None:
        last = result.checkpoint.path if result.checkpoint else "none (it diverged before the first checkpoint)"
        raise TrainingDivergedError(
            f"{stage} stopped: loss/gradients became non-finite at step {diverged['step']}; "
            f"the last good checkpoint is kept: {last}"
        )
    return result


def log_outputs(client: Any, run_id: str, result: Any) -> str:
    """Log the final and best checkpoints, the learning curve and the final model (no pickle); returns its URI."""
    import pyarrow.fs as pafs

    with result.checkpoint.as_directory() as final_dir:
        tracking.log_checkpoint_dir(client, run_id, final_dir, "checkpoints/final")
        model_uri = registry.log_vit_model(client, run_id, final_dir)
    best_path = f"{result.path}/{BEST_DIR}"
    with tempfile.TemporaryDirectory() as tmp:
        if result.filesystem.get_file_info(best_path).type == pafs.FileType.Directory:
            pafs.copy_files(best_path, tmp, source_filesystem=result.filesystem)
            tracking.log_checkpoint_dir(client, run_id, tmp, "checkpoints/best")
            client.log_artifact(run_id, str(Path(tmp, BEST_INFO_FILE)), "checkpoints/best")
        else:  # no validation split: the final model is the best one known
            with result.checkpoint.as_directory() as final_dir:
                tracking.log_checkpoint_dir(client, run_id, final_dir, "checkpoints/best")
    tracking.log_learning_curve(client, run_id)
    return model_uri

"""After a fine-tuning sweep: what became of each trial, and the best one tested, logged and registered.

The trials' nested MLflow runs get their final metrics and a status tag
(completed, early_stopped, failed); the stage run gets the sweep figure, the trials' learning curves, the
best configuration, the best model's test accuracy and confusion matrix, the
model itself (safetensors + config.json, no pickle), and a new version in the
Model Registry tagged with its lineage and score; the best-scoring version of
the name carries the `champion` alias.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import signal
import tempfile
from typing import Any

import numpy as np

import vit
from pipelines.core import plots, tracking
from pipelines.core.errors import VitpipeError, error_line
from pipelines.core.registry import TAG_MODEL_URI, Score, log_vit_model, register_run_model
from pipelines.core.shards import class_names, num_classes
from pipelines.core.stopping import Stopped
from pipelines.image.configs import METRICS
from pipelines.image.labeled_rows import iter_rows
from pipelines.image.finetune_trial import checkpoint_report, latest_checkpoint

logger = logging.getLogger("vitpipe.finetune")  # under "vitpipe": its handlers scrub credentials
TAG_TRIAL_STATUS = "vitpipe.trial_status"
TAG_FINETUNE_RUN = "vitpipe.finetune_run_id"
TRIAL_CURVES_FIGURE = "trial_curves.png"


def trial_outcomes(result_grid: Any, metric: str, storage_path: str, filesystem: Any) -> list[dict[str, Any]]:
    """One record per trial: id, config, status (completed | early_stopped | failed), `last` (Tune's last
    result), error, and its score (`score_trial`; trial Train runs live under `storage_path`)."""
    fs = filesystem or _local_fs()
    runs = trial_runs(storage_path, fs)  # listed once for all trials: one LIST on S3, not one per trial
    out = []
    for trial in result_grid._experiment_analysis.trials:  # ResultGrid keeps no trial ids of its own
        last = dict(trial.last_result or {})
        error = None
        if trial.status == "ERROR":
            status = "failed"
            error = trial.get_pickled_error() or trial.get_error()
        elif int(last.get("step", 0)) < int(trial.config["steps"]):
            status = "early_stopped"
        else:
            status = "completed"
        outcome = {"trial_id": trial.trial_id, "config": dict(trial.config), "status": status, "last": last,
                   "error": error}
        out.append(score_trial(outcome, metric, runs, fs))
    return out


def score_trial(outcome: dict[str, Any], metric: str, runs: list[str], fs: Any) -> dict[str, Any]:
    """`outcome` with its `checkpoint` (furthest Train checkpoint, see `trial_checkpoint`), `checkpoint_step`
    and `metric`: the value stored with that checkpoint, i.e. the score of the weights that would be tested.

    Not Tune's last result: under ASHA a trial's last report need not be at a checkpoint (its checkpoint may
    be older, or newer when its workers trained on a moment after the stop). A failed trial, or one that
    never saved, has no score and cannot be the best.
    """
    path = trial_checkpoint(runs, fs, outcome["trial_id"]) if outcome["status"] != "failed" else None
    report = {}
    if path:
        try:
            report = checkpoint_report(fs, path)
        except (OSError, ValueError) as e:  # a worker killed while saving it (ASHA's stop): skip, don't fail the sweep
            logger.warning("finetune: trial %s: unscored, checkpoint %s unreadable: %s", outcome["trial_id"], path,
                           error_line(e))
            path = None
    return {**outcome, "checkpoint": path, "checkpoint_step": int(report["step"]) if "step" in report else None,
            "metric": report.get(metric)}


def finish_trial_runs(client: Any, parent: str, outcomes: list[dict[str, Any]]) -> None:
    """Final metrics, status tag and run status on each trial's nested run."""
    experiment_id = client.get_run(parent).info.experiment_id
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{tracking.TAG_PARENT}` = '{parent}'", max_results=1000)
    by_trial = {r.data.tags.get("vitpipe.trial_id"): r.info.run_id for r in runs}
    for trial in outcomes:
        run_id = by_trial.get(trial["trial_id"])
        if run_id is None:  # failed before its run was opened
            continue
        trial["run_id"] = run_id
        finals = {f"final_{k}": float(v) for k, v in trial["last"].items() if k in (*METRICS, "step") and v is not None}
        tags = {TAG_TRIAL_STATUS: trial["status"]}
        if trial["error"] is not None:
            tags["vitpipe.error"] = error_line(trial["error"])
        tracking.set_tags(client, run_id, tags)
        if finals:
            buffer = tracking.MetricBuffer(client, run_id)
            buffer.add(finals, int(trial["last"].get("step", 0)))
            buffer.flush()
        client.set_terminated(run_id, status="FAILED" if trial["status"] == "failed" else "FINISHED")


def figure_of_trial_curves(client: Any, outcomes: list[dict[str, Any]],
                           keys: tuple[str, ...] = ("val_top1", "train_loss")) -> Any | None:
    """One figure of every trial's `keys` against step, read from its nested run; None when no trial logged any."""
    curves = []
    for trial in outcomes:
        if "run_id" not in trial:  # failed before its run was opened
            continue
        metrics = {}
        for key in keys:
            # A restored or perturbed trial re-logs steps: keep the latest value of each.
            history = sorted(client.get_metric_history(trial["run_id"], key), key=lambda m: (m.step, m.timestamp))
            metrics[key] = sorted({m.step: m.value for m in history}.items())
        curves.append({"label": trial["trial_id"], "status": trial["status"], "metrics": metrics})
    if not any(points for curve in curves for points in curve["metrics"].values()):
        return None
    return plots.trial_curves_figure(curves, keys)


def log_trial_curves(client: Any, run_id: str, outcomes: list[dict[str, Any]],
                     keys: tuple[str, ...] = ("val_top1", "train_loss")) -> bool:
    """Log `figure_of_trial_curves` in the stage run as TRIAL_CURVES_FIGURE; False when no trial logged any."""
    figure = figure_of_trial_curves(client, outcomes, keys)
    if figure is None:
        return False
    client.log_figure(run_id, figure, TRIAL_CURVES_FIGURE)
    figure.clf()
    return True


def pick_best(outcomes: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The trial whose score (`score_trial`: its checkpoint's metric) is best; None when no trial has one."""
    scored = [t for t in outcomes if t["metric"] is not None and math.isfinite(float(t["metric"]))]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda t: float(t["metric"]))


def evaluate_split(model: Any, data: Any, split: str, size: int) -> tuple[float, Any]:
    """Top-1 and the confusion matrix (rows: true class) of `model` on one split, read shard by shard."""
    import torch

    classes = num_classes(data.manifest)
    matrix = np.zeros((classes, classes), dtype=np.int64)
    model.eval()
    for batch in iter_rows(data, split, size=size):
        with torch.no_grad():
            predicted = model(torch.from_numpy(batch["patches"])).argmax(-1).numpy()
        np.add.at(matrix, (batch["label"], predicted), 1)
    total = matrix.sum()
    if total == 0:
        raise VitpipeError(f"{data.uri}: split {split!r} has no images")
    return float(np.trace(matrix) / total), matrix


def _local_fs() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def trial_runs(storage_path: str, fs: Any) -> list[str]:
    """The Train run folders of a sweep's trials: what `storage_path` holds (none when it does not exist)."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(storage_path, allow_not_found=True))
    return [info.path for info in infos if info.type == pafs.FileType.Directory]


def trial_checkpoint(runs: list[str], fs: Any, trial_id: str) -> str | None:
    """The path of a trial's furthest Train checkpoint among the sweep's `runs` (`trial_runs`), or None when it
    saved none.

    Under PBT a trial trains on in runs named `<trial>-from-<hash>` after each
    clone; the checkpoint with the highest step among all its runs is its last.
    """
    own = [run for run in runs if (name := posixpath.basename(run.rstrip("/"))) == trial_id
           or name.startswith(f"{trial_id}-from-")]
    found = [path for path in (latest_checkpoint(fs, run) for run in own) if path]
    if not found:
        return None
    return max(found, key=lambda p: (int(p.rsplit("_", 1)[1]), fs.get_file_info(p).mtime_ns or 0))


def load_trial_model(checkpoint: str, filesystem: Any) -> Any:
    """The model of a trial checkpoint (a `score_trial` outcome's `checkpoint`: the weights it was scored by)."""
    import pyarrow.fs as pafs

    with tempfile.TemporaryDirectory() as tmp:
        pafs.copy_files(checkpoint, tmp, source_filesystem=filesystem or _local_fs())
        return vit.load_checkpoint(tmp)


def check_sweep_ended(result_grid: Any, trials: int, filesystem: Any = None) -> None:
    """Raise `Stopped` (`pipelines.core.stopping`) unless all `trials` of the sweep ended (finished, stopped or
    failed).

    Tune returns from `fit` on Ctrl-C or SIGUSR1 too, its state saved to resume from, and the trials it
    returns then read TERMINATED; the saved state keeps the truth (trials unfinished, grid points never
    started), so it is what is read here. Such a sweep must end the run KILLED (a rerun resumes it), never be
    reported, registered and reused as if it were whole.
    """
    from ray.tune import ExperimentAnalysis

    saved = ExperimentAnalysis(result_grid.experiment_path, storage_filesystem=filesystem).trials
    ended = [t for t in saved if t.status in ("TERMINATED", "ERROR")]
    if len(ended) < trials:
        # Tune stops alike on SIGINT and SIGUSR1 and does not say which: reported as the Ctrl-C it mostly is.
        stop = Stopped(signal.SIGINT)
        stop.add_note(f"finetune: the sweep ended {len(ended)} of {trials} trials")
        raise stop


def report_sweep(client: Any, run_id: str, ctx: Any, result_grid: Any, *, metric: str, mode: str,
                 searched: list[str], registry_model: str | None, lineage: dict[str, str]) -> None:
    """Everything after `Tuner.fit`: close the trial runs, plot the sweep, test, log and register the best trial.

    The best trial is the one whose last checkpoint scored best (`score_trial`): `best_metric`, the test and
    the registered model all describe those weights. Raises `VitpipeError` when every trial failed, naming the
    first failure, or when no trial has a checkpoint to test.
    """
    outcomes = trial_outcomes(result_grid, metric, ctx.storage_path, ctx.filesystem)
    finish_trial_runs(client, run_id, outcomes)
    statuses = {t["trial_id"]: t["status"] for t in outcomes}
    counts = {s: sum(v == s for v in statuses.values()) for s in ("completed", "early_stopped", "failed")}
    tracking.set_tags(client, run_id, {"vitpipe.trial_statuses": json.dumps(statuses),
                                       "vitpipe.experiment_path": result_grid.experiment_path})
    metrics = {f"trials_{k}": float(v) for k, v in counts.items()}
    figure = plots.sweep_figure(
        [{"params": t["config"], "metric": t["metric"], "status": t["status"]} for t in outcomes], searched, metric, mode
    )
    client.log_figure(run_id, figure, "sweep.png")
    figure.clf()
    log_trial_curves(client, run_id, outcomes)
    best = pick_best(outcomes, mode)
    buffer = tracking.MetricBuffer(client, run_id)
    if best is None:
        buffer.add(metrics, 0)
        buffer.flush()
        raise _no_best_error(outcomes, metric)

    model = load_trial_model(best["checkpoint"], ctx.filesystem)
    test_top1, matrix = None, None
    if int(ctx.data.manifest.get("counts", {}).get("test", 0)) > 0:
        test_top1, matrix = evaluate_split(model, ctx.data, "test", int(best["config"]["resolution"]))
        figure = plots.confusion_figure(matrix, class_names(ctx.data.manifest), "best trial on the test split")
        client.log_figure(run_id, figure, "confusion_matrix.png")
        figure.clf()
        metrics["test_top1"] = test_top1
    best_config = {k: best["config"][k] for k in sorted(best["config"])}
    metrics["best_metric"] = float(best["metric"])
    metrics[f"best_{metric}"] = float(best["metric"])
    buffer.add(metrics, 0)
    buffer.flush()
    tracking.log_params(client, run_id, {"best": best_config})
    tracking.log_dict_artifact(client, run_id, {"trial_id": best["trial_id"], "config": best_config,
                                                metric: best["metric"], "step": best["checkpoint_step"],
                                                "test_top1": test_top1}, "best_config.json")
    tracking.set_tags(client, run_id, {"vitpipe.best_config": json.dumps(best_config), "vitpipe.best_trial": best["trial_id"]})
    _log_best_model(client, run_id, model)
    if registry_model:
        register_best_model(client, run_id, registry_model, lineage, sweep_score(metrics, metric, mode))


def _no_best_error(outcomes: list[dict[str, Any]], metric: str) -> VitpipeError:
    """Why no trial can be tested: every trial failed (the first failure named), or none has a finite
    `metric` stored with a checkpoint."""
    failed = [t for t in outcomes if t["status"] == "failed"]
    if len(failed) < len(outcomes):
        return VitpipeError(f"finetune: none of {len(outcomes)} trials has a finite {metric} stored with a "
                            f"checkpoint to test ({len(failed)} failed)")
    first = failed[0] if failed else None
    cause = error_line(first["error"]) if first else "no trials ran"
    return VitpipeError(f"finetune: all {len(outcomes)} trials failed; first ({first['trial_id'] if first else '-'}): {cause}")


def _log_best_model(client: Any, run_id: str, model: Any) -> None:
    """Log the best trial's checkpoint and MLflow model."""
    with tempfile.TemporaryDirectory() as tmp:
        vit.save_checkpoint(model, tmp)
        tracking.log_checkpoint_dir(client, run_id, tmp, "checkpoints/best")
        model_uri = log_vit_model(client, run_id, tmp)
    tracking.set_tags(client, run_id, {TAG_MODEL_URI: model_uri})


def sweep_score(metrics: dict[str, float], metric: str, mode: str) -> Score:
    """What a sweep's registered version is ranked by: the best trial's test top-1 where the data has a test
    split, its sweep metric otherwise (`metrics`: the stage run's)."""
    if "test_top1" in metrics:
        return Score("test_top1", float(metrics["test_top1"]))
    return Score(metric, float(metrics["best_metric"]), mode)


def register_best_model(client: Any, run_id: str, name: str, lineage: dict[str, str], score: Score) -> str:
    """Register a sweep's logged best model under `name` (the best version becomes `champion`)."""
    return register_run_model(client, run_id, name, lineage, run_tag=TAG_FINETUNE_RUN, score=score)


__all__ = [
    "check_sweep_ended",
    "evaluate_split",
    "figure_of_trial_curves",
    "finish_trial_runs",
    "load_trial_model",
    "log_trial_curves",
    "pick_best",
    "register_best_model",
    "report_sweep",
    "score_trial",
    "sweep_score",
    "trial_checkpoint",
    "trial_runs",
    "trial_outcomes",
]

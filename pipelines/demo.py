"""`vitpipe demo`: the whole pipeline on this machine, with nothing running beforehand.

A local Ray, a `sqlite:///` MLflow store and one working directory. It writes a
synthetic fractal corpus and scikit-learn's digits, then runs
`pipelines/specs/demo.yaml`: pretrain a small ViT on the fractals, fine-tune on
the digits from that checkpoint and from scratch, and probe the pretrained
features few-shot. The closing table is the paper's central claim at toy scale:
pretrained against scratch test accuracy.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipelines.runner import PipelineResult, run_pipeline
from pipelines.spec import PipelineSpec, load_spec

DEMO_SPEC = Path(__file__).resolve().parent / "specs" / "demo.yaml"
FRACTALS = dict(images=6000, classes=100, size=32)
DIGITS_SIZE = 16
_DONE = ".vitpipe-corpus-complete"


def _write_corpora(workdir: Path) -> tuple[Path, Path]:
    """The two corpora under `workdir/corpus`, written once (a marker says they are complete)."""
    from pipelines.corpus import export_digits, synth_corpus

    fractals, digits = workdir / "corpus" / "fractals", workdir / "corpus" / "digits"
    if not (fractals / _DONE).exists():
        synth_corpus(str(fractals), seed=0, **FRACTALS)
        (fractals / _DONE).touch()
    if not (digits / _DONE).exists():
        export_digits(str(digits), size=DIGITS_SIZE)
        (digits / _DONE).touch()
    return fractals, digits


def demo_spec(workdir: Path, overrides: list[str] = ()) -> PipelineSpec:
    """The demo spec with every path under `workdir`, plus the caller's `--set` overrides."""
    fractals, digits = workdir / "corpus" / "fractals", workdir / "corpus" / "digits"
    placed = [
        f"storage.root={workdir}",
        f"tracking_uri=sqlite:///{workdir}/mlflow.db",
        f"fractals.source={fractals}",
        f"digits.source={digits}",
        f"digits.manifest={digits}/manifest.csv",
    ]
    return load_spec(DEMO_SPEC, [*placed, *overrides])


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


def run_demo(workdir: str | os.PathLike[str] = "vitpipe-work", overrides: list[str] = ()) -> tuple[PipelineResult, str]:
    """Write the corpora, run the demo pipeline; returns its result and the comparison text."""
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(root, list(overrides))
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"))
    _write_corpora(root)
    result = run_pipeline(spec)
    return result, comparison(result)


__all__ = ["DEMO_SPEC", "comparison", "demo_spec", "run_demo"]

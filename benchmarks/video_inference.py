"""Full-video against multi-view inference with VTN, and memory of full-video inference against frames.

    python benchmarks/video_inference.py --json

Model: `create_vtn("ViT-Ti-VTN")` with the ViT-Ti/16 backbone at 64 px (16
patches + [CLS] per frame), its default temporal encoder (3 Longformer layers,
192 wide, 12 heads, window 32, [CLS] global), 10 classes, training clips of 16
frames; random weights (speed and memory do not depend on them), fp32, eval.

Speed (`full_vs_multiview_speedup`): the same `--videos` videos of `--video-frames`
frames of 64×72 px, each classified by

* full video: `VTN.predict_full_video(video[..., 64×64 centre], num_frames=250)`: one pass over
  250 frames spread over the whole video (the paper's full-video inference);
* multi-view: `VTN.predict_multiview(video, clips=10, crops=3)`: 30 views of a
  training clip's length, 16 frames (and again for 32, the paper's other setting;
  `--clip-frames`), 10 clips spread over the video × 3 64×64 crops along the
  width, softmax averaged. Both modes cost about the same per frame, so the
  speedup is bounded by the frame counts, 30·L / 250 (1.92 at 16, 3.84 at 32).

After a warm-up of each, the two modes take turns (the first mover alternating)
for `--rounds` rounds in one process; videos/s are medians over rounds and the
speedup is the median of the per-round ratios (multi-view time / full-video time).

Memory (`memory` rows): full-video inference of one 64×64 video at 64, 250 and
1,000 frames, each row in a fresh process, as in `benchmarks/longformer_attention.py`
(glibc's mmap threshold fixed at 64 KiB so RSS follows live tensors; VmHWM reset
through /proc/self/clear_refs; peak minus the resident set just before the pass).
Two peaks per row: `full_video_peak_mib`, the whole `predict_full_video` (backbone
in chunks of 64 frames, so that the backbone's share stays bounded), and
`encoder_peak_mib`, the temporal encoder alone on precomputed frame features
(`forward_features_from_frames`). Three temporal encoders with the same weights:

* `longformer`: the model's own (banded sliding-window attention, O(T·w));
* `dense`: every token attends to every token through
  `torch.nn.functional.scaled_dot_product_attention` (the dense reference of
  `longformer_attention.py`; on CPU a flash kernel that never holds the T×T scores);
* `dense_materialised`: the same attention computed as softmax(QKᵀ/√d)·V with the
  T×T score matrix held, as a plain Transformer encoder does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from longformer_attention import MEASURE_ENV, _rss_kib, run_script  # noqa: E402  (the same memory method)
from vit.vtn import create_vtn  # noqa: E402

IMAGE, WIDE, CLASSES, CLIP_FRAMES, FULL_FRAMES, CHUNK = 64, 72, 10, 16, 250, 64
ENCODERS = ("longformer", "dense", "dense_materialised")


def build_model(encoder: str = "longformer", clip_frames: int = CLIP_FRAMES) -> nn.Module:
    torch.manual_seed(0)
    model = create_vtn("ViT-Ti-VTN", backbone_overrides={"image_size": IMAGE}, num_classes=CLASSES,
                       num_frames=clip_frames).eval()
    if encoder != "longformer":
        for layer in model.encoder.layers:
            layer.attn = DenseSelfAttention(layer.attn, materialise=encoder == "dense_materialised")
    return model


class DenseSelfAttention(nn.Module):
    """Full self-attention with a Longformer layer's local Q/K/V projections (the same weights), a
    drop-in for `LongformerSelfAttention` inside `LongformerLayer`: returns `(out, None)`."""

    def __init__(self, attn: nn.Module, materialise: bool) -> None:
        super().__init__()
        self.query, self.key, self.value = attn.query, attn.key, attn.value
        self.heads, self.head_dim, self.materialise = attn.num_heads, attn.head_dim, materialise

    def forward(self, x, global_mask=None, padding_mask=None, return_global_attention=False):
        bsz, n, width = x.shape
        q, k, v = (p(x).view(bsz, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        if self.materialise:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, heads, T, T)
            out = torch.matmul(scores.softmax(dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2).reshape(bsz, n, width)
        return (out, None) if return_global_attention else out


# ---------------------------------------------------------------- speed


def speed(videos: int, video_frames: int, rounds: int, clip_frames: int = CLIP_FRAMES) -> dict:
    """Videos/s of full-video and 30-view inference on the same videos, taking turns."""
    model = build_model(clip_frames=clip_frames)
    gen = torch.Generator().manual_seed(1)
    clips = [torch.rand(1, video_frames, 3, IMAGE, WIDE, generator=gen) for _ in range(videos)]
    left = (WIDE - IMAGE) // 2

    def full() -> None:
        for video in clips:
            model.predict_full_video(video[..., left:left + IMAGE], num_frames=FULL_FRAMES)

    def multiview() -> None:
        for video in clips:
            model.predict_multiview(video, clips=10, crops=3)

    modes = {"full_video": full, "multiview": multiview}
    for run in modes.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for name in order:
            start = time.perf_counter()
            modes[name]()
            times[name].append(time.perf_counter() - start)
    ratios = [m / f for f, m in zip(times["full_video"], times["multiview"])]
    return {
        "videos": videos,
        "video_frames": video_frames,
        "rounds": rounds,
        "full_video": {"frames_per_video": FULL_FRAMES, "videos_per_s": round(videos / statistics.median(times["full_video"]), 3),
                       "times_s": [round(t, 3) for t in times["full_video"]]},
        "multiview": {"views": 30, "clip_frames": clip_frames, "frames_per_video": 30 * clip_frames,
                      "videos_per_s": round(videos / statistics.median(times["multiview"]), 3),
                      "times_s": [round(t, 3) for t in times["multiview"]]},
        "full_vs_multiview_speedup": round(statistics.median(ratios), 2),
        "speedup_range": [round(min(ratios), 2), round(max(ratios), 2)],
        # Both modes cost about the same per frame, so the frame counts bound the speedup.
        "frame_count_ratio": round(30 * clip_frames / FULL_FRAMES, 2),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------- memory


def _peak_during(step) -> float:
    """MiB the resident set grew to during `step()` above where it stood just before."""
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step()
    return round((_rss_kib("VmHWM") - before) / 1024, 1)


def memory_row(encoder: str, frames: int) -> dict:
    """Peak memory of full-video inference at `frames` frames with one encoder (in a fresh process)."""
    model = build_model(encoder)
    video = torch.rand(1, frames, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = model.frame_features(video[:, :2])  # warm-up of every code path on a short input
        model.forward_features_from_frames(features)
        features = model.frame_features(video, chunk_size=CHUNK)
        indices = torch.arange(frames)
        model.predict_full_video(video[:, :8], num_frames=8, chunk_size=CHUNK)

        def full() -> None:
            model.predict_full_video(video, num_frames=frames, chunk_size=CHUNK)

        def encoder_only() -> None:
            model.forward_features_from_frames(features, frame_indices=indices)

        full_peak = _peak_during(full)
        encoder_peak = _peak_during(encoder_only)
    return {"encoder": encoder, "frames": frames, "full_video_peak_mib": full_peak, "encoder_peak_mib": encoder_peak}


def _growth(rows: list[dict], frames: list[int]) -> dict:
    """Peak-memory ratio from the fewest to the most frames, per encoder (frames ratio for scale)."""
    out: dict = {"frames_ratio": frames[-1] / frames[0]}
    for encoder in ENCODERS:
        by = {r["frames"]: r for r in rows if r["encoder"] == encoder and "encoder_peak_mib" in r}
        if frames[0] in by and frames[-1] in by:
            lo, hi = by[frames[0]], by[frames[-1]]
            out[encoder] = {key: round(hi[key] / lo[key], 2) if lo[key] > 0 else None
                            for key in ("full_video_peak_mib", "encoder_peak_mib")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    parser.add_argument("--videos", type=int, default=4, help="videos in the speed comparison")
    parser.add_argument("--video-frames", type=int, default=300, help="frames per video in the speed comparison")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each mode after the warm-up")
    parser.add_argument("--clip-frames", type=int, nargs="+", default=[CLIP_FRAMES, 2 * CLIP_FRAMES],
                        help="training clip lengths (the paper trains on 16 or 32); multi-view views have this many "
                             "frames; the first gives full_vs_multiview_speedup")
    parser.add_argument("--frames", type=int, nargs="+", default=[64, 250, 1000], help="frame counts of the memory rows")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a memory row is given up")
    parser.add_argument("--memory-row", nargs=2, metavar=("ENCODER", "FRAMES"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.memory_row:
        print(json.dumps(memory_row(args.memory_row[0], int(args.memory_row[1]))))
        return

    result: dict = {
        "config": {"model": "ViT-Ti-VTN", "backbone": f"ViT-Ti/16 at {IMAGE} px", "temporal_encoder":
                   "3 layers, hidden 192, 12 heads, window 32, [CLS] global", "dtype": "float32",
                   "full_video": f"{FULL_FRAMES} frames over the whole video, centre {IMAGE}x{IMAGE}",
                   "multiview": f"10 clips x 3 crops of {CLIP_FRAMES} frames, {IMAGE}x{IMAGE} crops of {IMAGE}x{WIDE}",
                   "speed": "videos/s, medians over rounds after a warm-up, the two modes taking turns in one process",
                   "memory": "peak RSS increase during one pass in a fresh process (VmHWM - VmRSS, "
                             "MALLOC_MMAP_THRESHOLD_=65536), MiB; backbone in chunks of 64 frames"},
    }
    runs = [speed(args.videos, args.video_frames, args.rounds, clip) for clip in args.clip_frames]
    result.update(runs[0])
    result["by_clip_frames"] = {str(clip): {"full_vs_multiview_speedup": r["full_vs_multiview_speedup"],
                                            "speedup_range": r["speedup_range"],
                                            "frame_count_ratio": r["frame_count_ratio"],
                                            "multiview_videos_per_s": r["multiview"]["videos_per_s"],
                                            "full_video_videos_per_s": r["full_video"]["videos_per_s"]}
                                for clip, r in zip(args.clip_frames, runs)}
    rows = []
    for frames in args.frames:
        for encoder in ENCODERS:
            row, why = run_script(__file__, ["--memory-row", encoder, str(frames)], args.timeout, MEASURE_ENV)
            rows.append(row or {"encoder": encoder, "frames": frames, "skipped": why})
            if not args.json:
                print(rows[-1], flush=True)
    result["memory"] = rows
    result["memory_growth"] = _growth(rows, sorted(args.frames))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

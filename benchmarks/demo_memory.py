"""Peak resident memory of `vitpipe demo`, whole process tree: the CLI, Ray's GCS, raylet, dashboard, workers.

    python benchmarks/demo_memory.py [--workdir DIR] [--interval 0.5] [-- DEMO ARGS...]

Runs `vitpipe demo --workdir DIR` (this checkout's code: `python -m pipelines.cli`)
in a fresh working folder (a temporary one unless `--workdir`) and samples,
every `--interval` seconds, every process descended from it: Ray's daemons are
the CLI's children and its workers the raylet's. A process that leaves the tree
(re-parented to init) is still counted while it lives. Prints one JSON object:

* `peak_rss_gib`: the largest sum of the processes' resident sets (VmRSS). Pages
  shared between processes (the libraries every worker maps, the object store's
  shared memory) count once per process, so this overstates the machine's use.
* `peak_pss_gib`: the largest sum of proportional set sizes (shared pages split
  between their users): what the demo takes from the machine.
* `top_at_peak`: the largest processes at the RSS peak; `load_avg_start` / `_end`
  and `cpus` say how busy the machine was (a loaded machine slows the demo, not its peak).

The target (`target_gib`) is 8 GiB; exit status 1 when the demo fails or the PSS peak misses it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TARGET_GIB = 8.0
GIB = 2**30


def pss_bytes(pid: int) -> int:
    """The process's proportional set size from /proc/PID/smaps_rollup (0 when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _label(proc: psutil.Process) -> str:
    """A short name for a process: Ray sets worker titles such as `ray::IDLE` or `ray::TrainController`."""
    try:
        cmdline = proc.cmdline()
        return (cmdline[0] if cmdline and cmdline[0].startswith("ray::") else proc.name())[:60]
    except psutil.Error:
        return "?"


class TreeSampler:
    """Samples the memory of a process and all its descendants, remembering every descendant it has seen."""

    def __init__(self, root: int) -> None:
        self.root = psutil.Process(root)
        self.seen: dict[int, psutil.Process] = {root: self.root}
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self.top_at_peak: list[dict[str, object]] = []
        self.samples = 0

    def _processes(self) -> list[psutil.Process]:
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:
            pass  # the root has exited: what was seen before may still be alive
        return [p for p in self.seen.values() if p.is_running()]

    def sample(self) -> None:
        """One sample: sums of RSS and PSS over the live processes, peaks kept."""
        rows = []
        for proc in self._processes():
            try:
                rows.append((proc, proc.memory_info().rss, pss_bytes(proc.pid)))
            except psutil.Error:
                continue
        self.samples += 1
        rss, pss = sum(r[1] for r in rows), sum(r[2] for r in rows)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_processes = max(self.peak_processes, len(rows))
        if rss > self.peak_rss:
            self.peak_rss = rss
            largest = sorted(rows, key=lambda r: r[1], reverse=True)[:6]
            self.top_at_peak = [{"process": _label(p), "rss_mib": round(r / 2**20)} for p, r, _ in largest]


def run(workdir: Path, interval: float, demo_args: list[str]) -> dict[str, object]:
    """Run the demo under the sampler; returns the figures printed as JSON."""
    command = [sys.executable, "-m", "pipelines.cli", "demo", "--workdir", str(workdir), *demo_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    load_start, start = os.getloadavg()[0], time.monotonic()
    with open(workdir.parent / f"{workdir.name}-demo.log", "w") as log:
        proc = subprocess.Popen(command, cwd=workdir.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = TreeSampler(proc.pid)
        try:
            while proc.poll() is None:
                sampler.sample()
                time.sleep(interval)
        except KeyboardInterrupt:  # stopped early (SIGINT or SIGTERM): end the demo's tree, report the peak so far
            for child in sampler.seen.values():
                try:
                    child.kill()
                except psutil.Error:
                    pass
            proc.wait()
    return {
        "finished": proc.returncode is not None and proc.returncode >= 0,
        "command": " ".join(["vitpipe", "demo", "--workdir", str(workdir), *demo_args]),
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "peak_rss_gib": round(sampler.peak_rss / GIB, 2),
        "peak_pss_gib": round(sampler.peak_pss / GIB, 2),
        "target_gib": TARGET_GIB,
        "peak_processes": sampler.peak_processes,
        "top_at_peak": sampler.top_at_peak,
        "samples": sampler.samples,
        "cpus": os.cpu_count(),
        "load_avg_start": round(load_start, 1),
        "load_avg_end": round(os.getloadavg()[0], 1),
        "log": str(log.name),
    }


def main() -> int:
    """Parse the options, run the demo once, print the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="demo working folder (default: a fresh temporary one)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("demo_args", nargs="*", help="after --: more `vitpipe demo` arguments, e.g. --video")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill PID` reports the peak so far, as Ctrl-C does
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vitpipe-demo-memory-")) / "work"
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    figures = run(workdir, args.interval, args.demo_args)
    print(json.dumps(figures))
    return 0 if figures["exit_code"] == 0 and figures["peak_pss_gib"] < TARGET_GIB else 1


if __name__ == "__main__":
    sys.exit(main())

"""Soak test: a long run of the tiny experiment on 2 devices, watching memory and leftovers.

Runs ``rollplex-train +experiment=tiny_cpu`` with ``cluster.devices_per_node=2
cluster.threads_per_device=1`` for ``--steps`` steps, samples the resident set size (RSS) of the
driver and of every Ray worker process (``ray::TrainWorker``, ``ray::RolloutWorker``) every
``--interval`` seconds, and checks that

- no process's RSS grows by more than ``--max-growth`` (5%) between the first sample after step
  ``--warmup-steps`` (20) and the end of the run;
- nothing new is left in ``/dev/shm`` or in ``/tmp`` (entries named like what a run can create:
  ``rp-ray-*``, ``ray*``, ``pymp-*``, ``torch_*``) once the run has exited.

Prints one row per process and, last, ``soak: steps=<n> max_rss_growth=<p>% (<process>)
shm_left=<k> tmp_left=<k> -> PASS|FAIL``; exits 1 on FAIL. Usage: ``bash scripts/soak.sh``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TMP_PATTERNS = ("rp-ray-*", "ray*", "pymp-*", "torch_*")


def _worker_name(proc: psutil.Process) -> str | None:
    """``driver``, ``TrainWorker``/``RolloutWorker`` (+pid) for the processes the soak watches."""
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    for cls in ("TrainWorker", "RolloutWorker"):
        if f"ray::{cls}" in cmd:
            return f"{cls}[{proc.pid}]"
    return None


def _watched(driver: psutil.Process) -> dict[str, int]:
    """RSS in bytes of the driver and of every worker process on this machine."""
    out = {}
    try:
        out["driver"] = driver.memory_info().rss
    except psutil.NoSuchProcess:
        return out
    for proc in psutil.process_iter():
        name = _worker_name(proc)
        if name is not None:
            try:
                out[name] = proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    return out


def _steps_done(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def _entries(directory: str, patterns: tuple[str, ...] | None) -> set[str]:
    names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    return {n for n in names if patterns is None or any(fnmatch.fnmatch(n, p) for p in patterns)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    args = ap.parse_args(argv)

    shm_before, tmp_before = _entries("/dev/shm", None), _entries("/tmp", TMP_PATTERNS)
    out = args.out.resolve()
    cmd = [str(ROOT / ".venv" / "bin" / "rollplex-train"), "+experiment=tiny_cpu", "cluster.devices_per_node=2",
           "cluster.threads_per_device=1", f"trainer.total_steps={args.steps}", "trainer.val_freq=0",
           "trainer.val_before_train=false", "trainer.save_freq=50", "trainer.resume=disable",
           "trainer.progress_bar=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
           f"hydra.run.dir={out}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out.parent / "soak.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, WANDB_MODE="offline"))
        driver = psutil.Process(proc.pid)
        baseline: dict[str, int] = {}
        last: dict[str, int] = {}
        while proc.poll() is None:
            rss = _watched(driver)
            step = _steps_done(out / "metrics.jsonl")
            if step >= args.warmup_steps:
                for name, value in rss.items():
                    baseline.setdefault(name, value)
                if step < args.steps:  # the last samples of the run, before shutdown starts
                    last.update(rss)
            time.sleep(args.interval)
    wall = time.time() - started
    time.sleep(3)  # let Ray's processes finish exiting
    shm_left = sorted(_entries("/dev/shm", None) - shm_before)
    tmp_left = sorted(_entries("/tmp", TMP_PATTERNS) - tmp_before)
    steps = _steps_done(out / "metrics.jsonl")
    growth = {name: last[name] / baseline[name] - 1.0 for name in baseline if name in last}
    print(f"{'process':28s} {'rss@step' + str(args.warmup_steps):>14s} {'rss@end':>10s} {'growth':>8s}")
    for name in sorted(growth):
        print(f"{name:28s} {baseline[name] / 2**20:11.1f}MiB {last[name] / 2**20:7.1f}MiB {growth[name] * 100:7.2f}%")
    worst = max(growth, key=growth.get) if growth else "none"
    worst_pct = growth.get(worst, float("nan")) * 100
    ok = (proc.returncode == 0 and steps == args.steps and growth and max(growth.values()) < args.max_growth
          and not shm_left and not tmp_left)
    if shm_left or tmp_left:
        print(f"left behind: /dev/shm {shm_left} /tmp {tmp_left}")
    print(f"soak: steps={steps} wall_s={wall:.0f} exit={proc.returncode} max_rss_growth={worst_pct:.2f}% ({worst}) "
          f"shm_left={len(shm_left)} tmp_left={len(tmp_left)} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

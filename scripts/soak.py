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
import shutil
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
TMP_PATTERNS = ("rp-ray-*", "ray*", "pymp-*", "torch_*")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_bytes(pid: int) -> int | None:
    """Resident set size from ``/proc/<pid>/status`` (``VmRSS``, kB), None if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _parent(pid)
    return False


def _watched(driver_pid: int) -> dict[str, int]:
    """RSS in bytes of the driver and of its worker processes (Ray titles them ``ray::<class>``;
    the local cluster's processes descend from the driver, so other runs' workers are left out)."""
    out = {}
    rss = _rss_bytes(driver_pid)
    if rss is not None:
        out["driver"] = rss
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmd = _cmdline(int(entry.name))
        for cls in ("TrainWorker", "RolloutWorker"):
            if cmd.startswith(f"ray::{cls}") and _descends_from(int(entry.name), driver_pid):
                rss = _rss_bytes(int(entry.name))
                if rss is not None:
                    out[f"{cls}[{entry.name}]"] = rss
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
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: no earlier metrics.jsonl to misread as progress
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out.parent / "soak.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, WANDB_MODE="offline"))
        baseline: dict[str, int] = {}
        last: dict[str, int] = {}
        while proc.poll() is None:
            rss = _watched(proc.pid)
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

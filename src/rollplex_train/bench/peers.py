"""TRL's GRPOTrainer beside rollplex's schedules on the benchmark workloads, in interleaved rounds.

Each round runs, per workload, TRL (``bench/trl_peer.py``, a subprocess) and ``rollplex-train`` with
the ``serial`` (full sequences), ``serial_shared`` (shared prefix) and ``rollplex`` schedules, each
on the same checkpoint, data and settings (``conf/experiment/bench_*.yaml``), waiting before every
run until the 1-minute load average is at most ``--max-load`` (at most ``--max-wait`` seconds; the
load at the start is recorded beside the numbers). Per system the timed steps are averaged
(rollplex calibrates its cost model in steps 1-3 and is timed from step 4; the others from step 2,
the first being warm-up), and each system's median round is reported. The last line is
``peers: rollplex/trl_short=<a> rollplex/trl_image=<b> rollplex/trl_video=<c> rollplex/serial_shared_min=<d>``
(step-time ratios; ``d`` is the smallest serial_shared / rollplex over the workloads).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rollplex_train.config import Config

log = logging.getLogger(__name__)

WORKLOADS = ("bench_short", "bench_image", "bench_video")
SCHEDULES = {  # label -> rollplex-train overrides
    "serial": ["schedule=serial", "model.shared_prefix=false"],
    "serial_shared": ["schedule=serial", "model.shared_prefix=true"],
    "rollplex": ["schedule=rollplex", "model.shared_prefix=true"],
}
SYSTEMS = ("trl", *SCHEDULES)
PHASES = ("gen", "old", "ref", "update")
ROLLPLEX_PHASES = {"gen": ("timing_s/gen", "timing_s/prefix_before"), "old": ("timing_s/old_log_prob",),
                   "ref": ("timing_s/ref",), "update": ("timing_s/update_actor",)}
"""Table column -> the metrics summed into it (the actor prefixes encoded before decode, whose KV
caches the rollout decodes from, count as generation: they replace its prefill)."""


def compose_config(experiment: str, overrides: list[str]) -> Config:
    """The validated config of ``+experiment=<experiment>`` with ``overrides`` (Hydra compose API)."""
    from hydra import compose, initialize_config_dir

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import hydra_version_base, register_configs, to_config

    register_configs()
    with initialize_config_dir(str(conf_dir()), **hydra_version_base()):
        return to_config(compose("config", [f"+experiment={experiment}", "trainer.output_dir=.", *overrides]))


def wait_for_idle(max_load: float, max_wait_s: float, poll_s: float = 5.0) -> tuple[float, float]:
    """Sleep until the 1-minute load average is at most ``max_load`` or ``max_wait_s`` passed.

    Returns:
        (load average when the run starts, seconds waited).
    """
    start = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - start < max_wait_s:
        time.sleep(poll_s)
    return os.getloadavg()[0], time.monotonic() - start


class RunKilled(RuntimeError):
    """A benchmark run's process was ended by SIGKILL (on the CPU machine: the kernel's OOM killer,
    when TRL's video run outgrows memory). The rounds go on without it; a run that fails by itself
    (a non-zero exit status, or another signal such as SIGSEGV) stops them."""


def _check_exit(proc: subprocess.CompletedProcess, what: str) -> None:
    """Raise :class:`RunKilled` (ended by SIGKILL) or RuntimeError (failed) for a finished run."""
    if proc.returncode == -signal.SIGKILL:
        raise RunKilled(f"{what} killed by signal {-proc.returncode} (SIGKILL); stderr tail: "
                        + " | ".join(proc.stderr.strip().splitlines()[-3:]))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")


def run_rollplex(experiment: str, label: str, steps: int, timed_from: int, out: Path,
                 overrides: list[str]) -> dict[str, float]:
    """One ``rollplex-train`` run; the mean of the timed steps' ``step`` and phase seconds.

    Raises:
        ValueError: ``timed_from`` is not within 1..``steps``.
        RunKilled: the run was ended by a signal.
        RuntimeError: the run failed (its stderr tail in the message).
    """
    from rollplex_train.tracking.loggers import read_metrics_jsonl

    if not 1 <= timed_from <= steps:
        raise ValueError(f"{experiment} {label}: timed from step {timed_from} of a {steps}-step run: expected 1..{steps}")

    cli = Path(sys.executable).parent / "rollplex-train"
    cmd = [str(cli), f"+experiment={experiment}", *SCHEDULES[label], *overrides, f"trainer.total_steps={steps}",
           "trainer.resume=disable", f"hydra.run.dir={out}", f"trainer.output_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline"))
    _check_exit(proc, f"{experiment} {label}")
    rows = [r for r in read_metrics_jsonl(out / "metrics.jsonl") if r["step"] >= timed_from]
    mean = lambda *keys: sum(r.get(k, 0.0) for r in rows for k in keys) / len(rows)  # noqa: E731
    result = {"step": mean("timing_s/step"), **{p: mean(*k) for p, k in ROLLPLEX_PHASES.items()},
              "step_s": [r["timing_s/step"] for r in rows]}
    for key in ("rollplex/planned_gain_s", "rollplex/realised_gain_s", "planner/decode_share"):
        if key in rows[-1]:
            result[key] = mean(key)
    return result


def run_trl(experiment: str, steps: int, timed_from: int, out: Path, overrides: list[str]) -> dict[str, Any]:
    """TRL in a subprocess (``python -m rollplex_train.bench.trl_peer``); mean of the timed steps
    and the input check.

    Raises:
        RunKilled: the run was ended by a signal.
        RuntimeError: the run failed, or TRL's model did not see rollplex's prompt ids and pixels.
    """
    cmd = [sys.executable, "-m", "rollplex_train.bench.trl_peer", "--experiment", experiment, "--steps", str(steps),
           "--out", str(out), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline"))
    _check_exit(proc, f"{experiment} trl")
    data = json.loads((out / "trl.json").read_text())
    check = data["check"]
    if not (check["ids_equal"] and check["pixels_equal"] and check["steps_checked"] == steps):
        raise RuntimeError(f"{experiment}: TRL's model did not see rollplex's inputs: {check}")
    rows = data["steps"][timed_from - 1:]
    result = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in ("step", *PHASES)}
    return dict(result, check=check, unequal=data["unequal"], settings=data["settings"])


def median_run(runs: list[dict]) -> dict:
    """The run with the median step time (the lower middle of an even count)."""
    return sorted(runs, key=lambda r: r["step"])[(len(runs) - 1) // 2]


def table(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Per workload and system: step seconds per round, then the median round's phases."""
    lines = []
    for workload, systems in results.items():
        lines.append(f"{workload}:")
        lines.append(f"  {'system':<14} {'rounds (step s, load)':<40} {'step':>7} " + " ".join(f"{p:>7}" for p in PHASES))
        for system, runs in systems.items():
            if not runs:
                continue
            m = median_run(runs)
            rounds = ", ".join(f"{r['step']:.2f} ({r['load']:.1f})" for r in runs)
            lines.append(f"  {system:<14} {rounds:<40} {m['step']:7.2f} " + " ".join(f"{m.get(p, 0.0):7.2f}" for p in PHASES))
    return lines


def last_line(results: dict[str, dict[str, list[dict]]]) -> Optional[str]:
    """The ``peers:`` line, or None when a workload lacks TRL, serial_shared or rollplex runs."""
    step = {w: {s: median_run(r)["step"] for s, r in systems.items() if r} for w, systems in results.items()}
    if set(step) != set(WORKLOADS) or any(not {"trl", "serial_shared", "rollplex"} <= set(s) for s in step.values()):
        return None
    ratios = {w.split("_")[1]: s["trl"] / s["rollplex"] for w, s in step.items()}
    shared = min(s["serial_shared"] / s["rollplex"] for s in step.values())
    return (f"peers: rollplex/trl_short={ratios['short']:.2f} rollplex/trl_image={ratios['image']:.2f} "
            f"rollplex/trl_video={ratios['video']:.2f} rollplex/serial_shared_min={shared:.2f}")


def run_rounds(workloads: list[str], systems: list[str], rounds: int, out: Path, overrides: list[str], *,
               trl_steps: int = 2, steps: int = 5, timed_from: int = 4, full_sequence_steps: int = 2,
               max_load: float = 2.5,
               max_wait_s: float = 300.0, full_sequence_rounds: Optional[int] = None,
               report=print) -> dict[str, dict[str, list[dict]]]:
    """``rounds`` x workloads x systems, interleaved (a slow drift of the machine hits every system
    alike); each run waits for an idle machine first. ``full_sequence_rounds``: run the ``serial``
    (full sequences) system only in the first this-many rounds (None: all; it is not in the last
    line and is the slowest). ``serial_shared`` and ``rollplex`` both run ``steps`` steps and are
    timed over the same steps, ``timed_from`` on (after rollplex's calibration steps, so both are
    compared at the same point of a run's life and over more than one step); the full-sequence
    ``serial`` runs ``full_sequence_steps`` timed from step 2, TRL ``trl_steps`` from step 2.
    ``report`` gets a line per finished run. A run ended by a signal (:class:`RunKilled`) is reported,
    listed under ``killed`` in ``results.json`` and left out of the medians; the rounds go on."""
    results: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in systems} for w in workloads}
    killed: list[str] = []
    for rnd in range(rounds):
        for workload in workloads:
            for system in systems:
                if system == "serial" and full_sequence_rounds is not None and rnd >= full_sequence_rounds:
                    continue
                load, waited = wait_for_idle(max_load, max_wait_s)
                where = out / workload / system / f"round{rnd + 1}"
                begin = time.monotonic()
                try:
                    if system == "trl":
                        run = run_trl(workload, trl_steps, 2, where, overrides)
                    else:
                        n, first = (full_sequence_steps, 2) if system == "serial" else (steps, timed_from)
                        run = run_rollplex(workload, system, n, first, where, overrides)
                except RunKilled as err:
                    killed.append(f"round {rnd + 1}: {err}")
                    report(f"round {rnd + 1} {workload:<12} {system:<14} KILLED: {err} (left out of the medians)")
                else:
                    run.update(load=load, waited_s=waited, wall_s=time.monotonic() - begin, round=rnd + 1)
                    results[workload][system].append(run)
                    report(f"round {rnd + 1} {workload:<12} {system:<14} step {run['step']:7.2f} s  "
                           + " ".join(f"{p} {run.get(p, 0.0):6.2f}" for p in PHASES)
                           + f"  (load {load:.1f} at start, waited {waited:.0f} s, run {run['wall_s']:.0f} s)")
                (out / "results.json").write_text(json.dumps(dict(results, killed=killed), indent=1, default=str))
    return results

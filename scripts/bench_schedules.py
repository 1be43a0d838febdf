"""serial vs serial+shared prefix vs disaggregated vs rollplex, side by side in one run.

    python scripts/bench_schedules.py            # bench_cpu workload, 3 rounds x 5 steps per schedule

``serial_shared_old_pass`` runs ``serial_shared`` with ``actor.recompute_old_log_prob=true`` (the separate
old-policy pass every schedule ran before the first mini-batch reused the actor's forward): the
line before the last shows the saving.

Each schedule runs `rollplex-train +experiment=bench_cpu` (same data, same seed) for ``--steps``
steps; steps ``--timed-from``.. are timed (mean; rollplex calibrates its cost model in steps 1-3)
and the last one is traced. The schedules run in ``--repeat`` interleaved rounds (this machine's
step times drift by up to 20% between runs); each schedule's median run is reported. Prints a table, writes
``<out>/gantt.png`` and ``<out>/<schedule>/traces/step_<k>.json`` and, as the last line,
``schedules: rollplex/serial=<x> rollplex/serial_shared=<y> rollplex/disaggregated=<z> prefix_hidden=<p>%``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from rollplex_train.models.tiny import make_tiny_checkpoint
from rollplex_train.runtime.timeline import Timeline, plot_gantt
from rollplex_train.tracking.loggers import read_metrics_jsonl

SCHEDULES = {  # label -> overrides
    "serial": ["schedule=serial", "model.shared_prefix=false"],
    "serial_shared": ["schedule=serial", "model.shared_prefix=true"],
    "disaggregated": ["schedule=disaggregated", "model.shared_prefix=false"],
    "rollplex": ["schedule=rollplex", "model.shared_prefix=true"],
    # today's separate old-policy pass (before the first mini-batch reused the actor's forward)
    "serial_shared_old_pass": ["schedule=serial", "model.shared_prefix=true", "actor.recompute_old_log_prob=true"],
}
MAIN = ("serial", "serial_shared", "disaggregated", "rollplex")  # the schedules of the last line


def bench_manifest(tasks: Path) -> Path:
    """Half images (colour), half 8-frame videos (direction), interleaved: ``bench_train.parquet``."""
    out = tasks / "bench_train.parquet"
    colour = pq.read_table(tasks / "color_train.parquet").slice(0, 32).to_pylist()
    video = pq.read_table(tasks / "direction_train.parquet").slice(0, 32).to_pylist()
    rows = [r for pair in zip(colour, video) for r in pair]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(tasks / "color_train.parquet")), out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="artifacts/checkpoints/small-qwen25vl")
    parser.add_argument("--tasks", default="artifacts/data/visual_tasks")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timed-from", type=int, default=4, help="first timed step (rollplex plans from step 4)")
    parser.add_argument("--out", default="outputs/bench_schedules")
    parser.add_argument("--only", default=",".join(SCHEDULES), help="comma-separated subset of schedules")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the schedules; the median run counts")
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        model = model.with_name(model.name + "-random")
        if not (model / "config.json").is_file():
            make_tiny_checkpoint(model, size="small", tasks_dir=None)
    manifest = bench_manifest(Path(args.tasks))
    cli = Path(sys.executable).parent / "rollplex-train"
    runs: dict[str, list[dict]] = {label: [] for label in args.only.split(",")}
    traces = {}
    for rep in range(args.repeat):  # rounds over all schedules: slow drifts of the machine hit each alike
        for label in runs:
            out = Path(args.out) / label
            cmd = [str(cli), "+experiment=bench_cpu", *SCHEDULES[label], f"model.path={model}",
                   f"data.train_files={manifest}", f"trainer.total_steps={args.steps}", "trainer.resume=disable",
                   f"trainer.trace_steps=[{args.steps}]", f"hydra.run.dir={out}", f"trainer.output_dir={out}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline"))
            if proc.returncode != 0:
                sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
            rows = [r for r in read_metrics_jsonl(out / "metrics.jsonl") if r["step"] >= args.timed_from]
            runs[label].append({k: sum(r[k] for r in rows) / len(rows) for k in rows[-1] if all(k in r for r in rows)})
            print(f"{label:<15} round {rep + 1}: step {runs[label][-1]['timing_s/step']:6.2f} s", flush=True)
            if rep == args.repeat - 1:
                traces[label] = Timeline.from_chrome_trace(out / "traces" / f"step_{args.steps}.json")
    results = {}
    for label, measured in runs.items():  # the run with the median step time stands for the schedule
        last = sorted(measured, key=lambda m: m["timing_s/step"])[len(measured) // 2]
        results[label] = (last, traces[label])
        print(f"{label:<15} step {last['timing_s/step']:7.2f} s  gen {last['timing_s/gen']:6.2f}  "
              f"old {last.get('timing_s/old_log_prob', 0):6.2f}  ref {last.get('timing_s/ref', 0):6.2f}  "
              f"update {last['timing_s/update_actor']:6.2f}  score {last['critic/score/mean']:.4f}", flush=True)
        if "planner/decode_share" in last:
            print(f"{'':<15} planner: decode/train threads {last['planner/decode_share']:.0f}/"
                  f"{last['planner/train_share']:.0f}, predicted {last.get('planner/predicted_s', 0):.2f} s "
                  f"(no overlap {last.get('planner/predicted_no_overlap_s', 0):.2f} s), actual "
                  f"{last['planner/actual_s']:.2f} s, reshare {last.get('timing_s/reshare', 0):.3f} s, "
                  f"prefix {last['rollplex/prefix_s']:.2f} s hidden {100 * last['rollplex/prefix_hidden_frac']:.0f}%",
                  flush=True)
    plot_gantt({k: tl for k, (_, tl) in results.items()}, Path(args.out) / "gantt.png",
               title=f"bench_cpu, step {args.steps}")
    step = {k: m["timing_s/step"] for k, (m, _) in results.items()}
    if "serial_shared_old_pass" in step and "serial_shared" in step:
        print(f"old-policy reuse: serial_shared step {step['serial_shared']:.2f} s, with the separate old-policy "
              f"pass {step['serial_shared_old_pass']:.2f} s (saved {step['serial_shared_old_pass'] - step['serial_shared']:.2f} s)")
    if set(MAIN) <= set(step):
        hidden = results["rollplex"][0]["rollplex/prefix_hidden_frac"] * 100
        print(f"schedules: rollplex/serial={step['serial'] / step['rollplex']:.2f} "
              f"rollplex/serial_shared={step['serial_shared'] / step['rollplex']:.2f} "
              f"rollplex/disaggregated={step['disaggregated'] / step['rollplex']:.2f} prefix_hidden={hidden:.0f}%")


if __name__ == "__main__":
    main()

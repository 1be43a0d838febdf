"""Multi-turn environment steps: serial vs rollplex (each turn's context scored while it decodes).

    python scripts/bench_envs.py                 # tiny_cpu_frozenlake at 4 turns with a KL reference

Both schedules run ``rollplex-train +experiment=tiny_cpu_frozenlake`` (same seeds, same tokens:
``tests/test_runtime_envs.py``) with ``env.max_turns=--turns`` on a 4x4 map without holes (every trajectory runs that many turns), a reference (``use_kl_loss``) and two
mini-batches, so a serial step has the rollout, the old-policy pass over the second mini-batch and
the reference pass over every trajectory after it; under rollplex, where its planner finds it
faster, those passes run turn by turn inside the rollout (``runtime/env_window.py``) and only the
last responses remain after it. The in-process executor, one device of ``--threads`` threads.
Steps ``--timed-from``.. are timed (mean; the planner measures an overlapped and a serial step
twice each first, steps 1-4, and plans from step 5); the schedules run in ``--repeat`` interleaved rounds and each one's median run counts.
The last line: ``envs: turns=<t> rollplex/serial=<x> scoring_hidden=<p>%`` (``t``: mean turns per
trajectory; ``x``: serial step time over rollplex's; ``p``: the turn scoring's seconds inside the
rollout window, ``envs/turn_scoring_hidden_frac``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from rollplex_train.models.tiny import make_tiny_checkpoint
from rollplex_train.tracking.loggers import read_metrics_jsonl

SCHEDULES = ("serial", "rollplex")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="artifacts/checkpoints/tiny-qwen25vl",
                        help="a checkpoint; 'small' builds (once) the random small one bench_schedules uses")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--map", default="SFFF,FFFF,FFFF,FFFG",
                        help="FrozenLake rows (env.kwargs.desc): no hole and the gift 6 moves away, so every "
                             "trajectory runs --turns turns of one action")
    parser.add_argument("--seeds", type=int, default=4, help="environment seeds per step (data.rollout_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="trajectories per seed (rollout.n)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timed-from", type=int, default=5,
                        help="first timed step: rollplex's planner measures steps 1-4 (2 overlapped, 2 serial)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="outputs/bench_envs")
    args = parser.parse_args()
    model = Path(args.model)
    if args.model == "small":
        model = Path("artifacts/checkpoints/small-qwen25vl-random")
        if not (model / "config.json").is_file():
            make_tiny_checkpoint(model, size="small", tasks_dir=None)
    cli = Path(sys.executable).parent / "rollplex-train"
    runs: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
    for rep in range(args.repeat):
        for schedule in SCHEDULES:
            out = Path(args.out) / schedule
            cmd = [str(cli), "+experiment=tiny_cpu_frozenlake", f"schedule={schedule}", f"model.path={model}",
                   f"env.max_turns={args.turns}", f"env.kwargs.desc=[{args.map}]", f"data.rollout_batch_size={args.seeds}", f"rollout.n={args.n}",
                   f"rollout.max_new_tokens={args.max_new_tokens}", f"actor.ppo_mini_batch_size={args.seeds // 2}",
                   "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01", "cluster.executor=inprocess",
                   f"cluster.threads_per_device={args.threads}", f"trainer.total_steps={args.steps}",
                   "trainer.resume=disable", "trainer.loggers=[jsonl]", "trainer.progress_bar=false",
                   f"trainer.trace_steps=[{args.steps}]", f"hydra.run.dir={out}", f"trainer.output_dir={out}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline"))
            if proc.returncode != 0:
                sys.exit(f"{schedule} failed:\n{proc.stderr[-3000:]}")
            rows = [r for r in read_metrics_jsonl(out / "metrics.jsonl") if r["step"] >= args.timed_from]
            runs[schedule].append({k: sum(r[k] for r in rows) / len(rows) for k in rows[-1] if all(k in r for r in rows)})
            print(f"{schedule:<9} round {rep + 1}: step {runs[schedule][-1]['timing_s/step']:6.2f} s", flush=True)
    best = {s: sorted(m, key=lambda r: r["timing_s/step"])[len(m) // 2] for s, m in runs.items()}
    for s, m in best.items():
        print(f"{s:<9} step {m['timing_s/step']:6.2f} s  gen {m['timing_s/gen']:6.2f}  old {m.get('timing_s/old_log_prob', 0):5.2f}"
              f"  ref {m.get('timing_s/ref', 0):5.2f}  after {m.get('timing_s/suffix_after', 0):5.2f}"
              f"  exposed {m.get('timing_s/turns_exposed', 0):5.2f}  update {m['timing_s/update_actor']:5.2f}"
              f"  turns {m['env/turns/mean']:.2f}", flush=True)
    planned = best["rollplex"]
    rates = {k.removeprefix("cost/envs/"): v / 1e6 for k, v in planned.items() if k.startswith("cost/envs/")}
    print(f"rollplex plan: overlap={planned['planner/env_overlap']:.0f} decode/train threads "
          f"{planned['planner/decode_share']:.0f}/{planned['planner/train_share']:.0f}, predicted "
          f"{planned.get('planner/predicted_s', float('nan')):.2f} s against "
          f"{planned.get('planner/predicted_no_overlap_s', float('nan')):.2f} s without overlap; measured s per "
          f"trajectory turn: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(rates.items())))
    if "envs/turn_scoring_s" in planned:  # the timed steps overlapped (all of them: the mean keeps shared keys)
        print(f"rollplex turn scoring: {planned['envs/turn_scoring_s']:.2f} s in {planned['envs/turn_scoring_calls']:.0f} "
              f"calls, {planned['envs/turn_scoring_tokens']:.0f} tokens")
    print(f"envs: turns={best['serial']['env/turns/mean']:.2f} "
          f"rollplex/serial={best['serial']['timing_s/step'] / planned['timing_s/step']:.2f} "
          f"scoring_hidden={100 * planned.get('envs/turn_scoring_hidden_frac', 0.0):.0f}%")


if __name__ == "__main__":
    main()

"""TRL's GRPOTrainer vs rollplex's serial / serial-with-shared-prefix / rollplex schedules, side by side.

    pip install -c constraints-cpu.txt -e '.[bench]'      # TRL 1.16.0 beside CPU torch 2.13.0
    make assets-bench                                      # small checkpoint + bench_image / bench_video data
    python scripts/bench_peers.py                          # 3 interleaved rounds x 3 workloads x 4 systems

Same checkpoint, data, pixels and settings on both sides (``rollplex_train/bench/peers.py``,
``rollplex_train/bench/trl_peer.py``); TRL's model inputs are checked against rollplex's prompts.
Prints a per-round line, the per-phase table, the settings that cannot be made equal and, as the
last line, ``peers: rollplex/trl_short=<a> rollplex/trl_image=<b> rollplex/trl_video=<c>
rollplex/serial_shared_min=<d>``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rollplex_train.bench.peers import SYSTEMS, WORKLOADS, last_line, run_rounds, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="artifacts/checkpoints/small-qwen25vl")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trl-steps", type=int, default=2, help="TRL steps per run (timed from step 2)")
    parser.add_argument("--steps", type=int, default=5, help="steps per serial_shared / rollplex run")
    parser.add_argument("--timed-from", type=int, default=4,
                        help="first timed step of serial_shared and rollplex runs (rollplex calibrates in steps 1-3)")
    parser.add_argument("--full-sequence-steps", type=int, default=2, help="full-sequence serial steps (timed from 2)")
    parser.add_argument("--max-load", type=float, default=2.5, help="wait until the 1-min load average is below")
    parser.add_argument("--max-wait", type=float, default=300.0, help="longest wait for that, seconds")
    parser.add_argument("--full-sequence-rounds", type=int, default=None,
                        help="run the serial (full sequences) system in the first N rounds only")
    parser.add_argument("--out", default="outputs/bench_peers")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both sides (smoke runs)")
    args = parser.parse_args()
    for flag, given, known in (("--workloads", args.workloads, WORKLOADS), ("--systems", args.systems, SYSTEMS)):
        names = given.split(",")
        unknown = [name for name in names if name not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; expected some of {', '.join(known)}")
        if len(set(names)) < len(names):
            parser.error(f"{flag}={given}: a name given twice")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: expected at least 1")
    for flag, value in (("--trl-steps", args.trl_steps), ("--full-sequence-steps", args.full_sequence_steps)):
        if value < 2:
            parser.error(f"{flag}={value}: expected at least 2 (timed from step 2)")
    if not 1 <= args.timed_from <= args.steps:
        parser.error(f"--timed-from={args.timed_from}: expected 1..--steps ({args.steps})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = run_rounds(args.workloads.split(","), args.systems.split(","), args.rounds, out,
                         [f"model.path={args.model}", *args.overrides], trl_steps=args.trl_steps, steps=args.steps,
                         timed_from=args.timed_from, full_sequence_steps=args.full_sequence_steps, max_load=args.max_load, max_wait_s=args.max_wait,
                         full_sequence_rounds=args.full_sequence_rounds,
                         report=lambda line: print(line, flush=True))
    print("\n".join(table(results)))
    trl = [r for systems in results.values() for r in systems.get("trl", [])]
    if trl:
        checks = [r["check"] for r in trl]
        print(f"inputs: TRL's model saw rollplex's prompt ids and pixels in {sum(c['rows_checked'] for c in checks)} "
              f"rows of {len(checks)} runs (ids equal: {all(c['ids_equal'] for c in checks)}, pixels equal: "
              f"{all(c['pixels_equal'] for c in checks)})")
        print("settings that cannot be made equal:")
        print("\n".join(f"  - {u}" for u in trl[0]["unequal"]))
        print("TRL settings: " + json.dumps(trl[0]["settings"], default=str))
    missing = [f"{w} {s}: {len(runs)} of {args.rounds}" for w, systems in results.items() for s, runs in systems.items()
               if len(runs) < args.rounds and not (s == "serial" and args.full_sequence_rounds is not None)]
    if missing:  # runs killed by SIGKILL (listed above and in results.json): medians over fewer rounds
        print("rounds missing (killed runs): " + "; ".join(missing))
    line = last_line(results)
    if line:
        print(line)


if __name__ == "__main__":
    main()

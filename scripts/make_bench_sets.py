#!/usr/bin/env python
"""Write the bench_image / bench_video data, or with --flagship the flagship_cpu set
(rollplex_train.data.bench_sets).

    python scripts/make_bench_sets.py --out artifacts/data/bench
    python scripts/make_bench_sets.py --flagship --out artifacts/data/flagship
"""

from __future__ import annotations

import argparse
import logging

from rollplex_train.data.bench_sets import write_bench_sets, write_flagship_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/data/bench")
    parser.add_argument("--rows", type=int, default=16, help="prompts per workload")
    parser.add_argument("--flagship", action="store_true", help="conf/experiment/flagship_cpu.yaml's set instead")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.flagship:
        write_flagship_set(args.out, args.rows)
    else:
        write_bench_sets(args.out, args.rows)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Write the bench_image / bench_video data (rollplex_train.data.bench_sets).

    python scripts/make_bench_sets.py --out artifacts/data/bench
"""

from __future__ import annotations

import argparse
import logging

from rollplex_train.data.bench_sets import write_bench_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/data/bench")
    parser.add_argument("--rows", type=int, default=16, help="prompts per workload")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    write_bench_sets(args.out, args.rows)


if __name__ == "__main__":
    main()

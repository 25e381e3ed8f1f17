"""
Rewrite the result tables of README.md and docs/*.md from the benchmark records in
docs/img/data (the blocks between ``<!-- rendered: NAME -->`` and ``<!-- end rendered -->``;
the tables: mergecomp_bench.results.TABLES).  With --check nothing is written: the exit status
is 1 when a block differs from what its records give (the test suite runs the same check).

    python scripts/render_results.py            # after adding or replacing a record
    python scripts/render_results.py --check
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs from its records")
    args = p.parse_args(argv)
    from mergecomp_bench.results import render_file

    stale = {path.relative_to(ROOT): render_file(path, check=args.check)
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    stale = {path: names for path, names in stale.items() if names}
    for path, names in stale.items():
        print(f"{path}: {', '.join(names)} {'differ from' if args.check else 'rewritten from'} their records")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

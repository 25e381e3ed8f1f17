"""The GPU check: the CUDA tests, merged against layer-wise codec times, training step times;
``summary.json`` and ``summary.md`` in OUT_DIR (default ``./gpu_check_out``) and one verdict
line, printed last.  About 2 minutes on one H200 (stage budgets: 8 minutes); seconds without a CUDA device.

    bash scripts/gpu_check.sh [OUT_DIR]         (or: python scripts/gpu_check.py [OUT_DIR])

The stages: :mod:`mergecomp_bench.gpu_check`.  Exit status 0 when the check passes or there is
no CUDA device, 1 when it fails, 2 when mergecomp is not installed.
"""
import sys
from pathlib import Path

try:
    from mergecomp_bench.gpu_check.run import main
except ImportError as err:
    print(f"gpu_check: FAIL: mergecomp cannot be imported ({err}); install it as README.md says", flush=True)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], repo=Path(__file__).resolve().parents[1]))

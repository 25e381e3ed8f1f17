"""``python -m mergecomp_bench``: the throughput benchmark, :mod:`mergecomp_bench.runner`."""
import sys

from mergecomp_bench.runner import main

sys.exit(main())

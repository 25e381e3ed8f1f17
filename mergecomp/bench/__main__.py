"""``python -m mergecomp.bench``: the throughput benchmark, :mod:`mergecomp.bench.runner`."""
import sys

from mergecomp.bench.runner import main

sys.exit(main())

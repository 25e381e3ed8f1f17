"""What a gradient's trip through the TF <-> torch bridge costs, by part, against a memcpy.

    python -m mergecomp.tensorflow.bridge_cost [numel]      # default 25M float32 elements

Parts: DLPack views (eager, and inside a ``tf.function`` through ``tf.py_function``), the merge
copy into a group's flat buffer, and the result views handed back (zero-copy on a 64-byte
boundary, else copied into a fresh buffer).  Results are in docs/frontends.md.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Dict

import tensorflow as tf
import torch

from .bridge import to_tf, to_torch

__all__ = ["measure"]


def _best_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def measure(numel: int = 25_000_000) -> Dict[str, float]:
    """Milliseconds (best of 5) to move one ``numel``-element float32 gradient through the bridge,
    by part, with plain copies for reference."""
    grad = tf.random.normal([numel])
    flat = torch.empty(numel)
    source = torch.randn(numel)
    views = tf.function(lambda g: tf.py_function(lambda t: to_tf(to_torch(t)), [g], Tout=tf.float32))
    return {
        "eager: DLPack views tf->torch->tf": _best_ms(lambda: to_tf(to_torch(grad))),
        "graph: py_function with DLPack views both ways": _best_ms(lambda: views(grad)),
        "merge: copy into the group's (reused) buffer": _best_ms(lambda: flat.copy_(to_torch(grad))),
        "unmerge: result view 4 bytes in (copied, fresh)": _best_ms(lambda: to_tf(source[1:])),
        "unmerge: result view 64 bytes in (zero-copy)": _best_ms(lambda: to_tf(source[16:])),
        "reference: torch memcpy into a reused buffer": _best_ms(lambda: flat.copy_(source)),
        "reference: torch memcpy into a fresh buffer": _best_ms(lambda: source.clone()),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 25_000_000
    print(f"{count} float32 elements ({count * 4 / 2**20:.0f} MiB), best of 5:")
    for what, ms in measure(count).items():
        print(f"  {what:50s} {ms:9.3f} ms")

"""What tests/elastic_train.py and tests/elastic_train_tf.py share: their command line, the
mergecomp options, the host added at ``--grow-at`` and each process's JSON lines."""
import argparse
import json
import os
import time


def parser() -> argparse.ArgumentParser:
    """``OUT HOSTS --compression C --steps N --grow-at G --fail-at F`` (G, F: 0 for never)."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("hosts")
    p.add_argument("--compression", default="topk")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--grow-at", type=int, default=4, help="0: never")
    p.add_argument("--fail-at", type=int, default=10, help="0: never")
    return p


def options(compression: str) -> dict:
    """The exchange's options: two groups; top-k with the residual memory and no warm-up."""
    chosen = {"compression": compression, "groups": 2}
    if compression == "topk":
        chosen.update(memory="residual", compression_warmup_steps=0)
    return chosen


def digest(states) -> float:
    """A number that differs when any tensor in ``states`` (group -> field -> torch tensor) does."""
    return float(sum(t.double().abs().sum() + t.double().sum() * 1e-3 for fields in states.values()
                     for t in fields.values()))


def grow(state, hosts: str) -> None:
    """Add a host of one slot to the discovery script's list and wait until the driver's
    notification has reached ``state`` (as Horovod's own elastic test does)."""
    with open(hosts, "a") as f:
        f.write("127.0.0.1:1\n")
    deadline = time.monotonic() + 60
    while state._host_messages.empty() and time.monotonic() < deadline:
        time.sleep(0.05)


def write(out: str, line: dict) -> None:
    """Append ``line`` to ``OUT/<pid>.jsonl``."""
    with open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")

"""All-to-all on real gloo ranks: the torch engine's ``Communicator.alltoall_async`` (the
self-check the MPI and Horovod engines run under their launchers in tests/test_engines.py) and
``mc.alltoall`` on top of it, on 2, 3 and 4 ranks."""
import os

import pytest
import torch
from distributed import run_workers
from engine_train import check_alltoall, error_of


def _raises(kind, fn, *words) -> None:
    try:
        fn()
    except kind as err:
        assert all(word in str(err) for word in words), (words, str(err))
        return
    raise AssertionError(f"{fn} did not raise {kind.__name__}")


def _rows_checks(mc, rank, world):
    """``mc.alltoall`` beyond tests/test_collectives.py: trailing dimensions, a rank that sends
    nothing, nothing sent at all, splits as a tensor, and mismatches named on every rank."""
    # rank 0 sends no rows; rank r > 0 sends d + 1 rows of shape (2, 3) to rank d, valued
    # 1000 * r + 10 * d + i in every cell of row i
    splits = [0 if rank == 0 else d + 1 for d in range(world)]
    rows = [torch.full((2, 3), 1000. * rank + 10 * d + i, dtype=torch.float64)
            for d in range(world) for i in range(splits[d])]
    tensor = torch.stack(rows) if rows else torch.empty(0, 2, 3, dtype=torch.float64)
    out, received = mc.alltoall(tensor.requires_grad_(), splits=torch.tensor(splits), name="cells")
    want = [torch.full((2, 3), 1000. * s + 10 * rank + i, dtype=torch.float64)
            for s in range(1, world) for i in range(rank + 1)]
    assert out.dtype == torch.float64 and out.requires_grad  # differentiable, as Horovod's
    assert torch.equal(out, torch.stack(want)), (out, want)
    assert received.tolist() == [0] + [rank + 1] * (world - 1)
    nothing, counts = mc.alltoall(torch.empty(0, 4, dtype=torch.uint8), splits=[0] * world)
    assert nothing.shape == (0, 4) and nothing.dtype == torch.uint8 and counts.tolist() == [0] * world
    odd = torch.zeros(world, 3 if rank == world - 1 else 2)
    _raises(ValueError, lambda: mc.alltoall(odd, name="odd"), "'odd'", f"rank 0 has shape [{world}, 2]",
            f"rank {world - 1} has [{world}, 3]")
    mixed = torch.zeros(world, dtype=torch.int32 if rank == 1 else torch.float32)
    _raises(ValueError, lambda: mc.alltoall(mixed), "rank 0 sends torch.float32", "rank 1 sends torch.int32")


def _alltoall_worker(rank):
    import mergecomp.torch as mc

    failures = check_alltoall(mc.communicator())
    _rows_checks(mc, rank, mc.size())
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_engine_alltoall(world):
    assert run_workers(_alltoall_worker, world) == [[]] * world


def _late_peer_worker(rank, marker):
    """Rank 0's all-to-all times out while rank 1 waits for ``marker``; then it completes."""
    import time

    import mergecomp.torch as mc

    comm = mc.communicator()
    blocks = torch.tensor([10 * rank, 10 * rank + 1])
    if rank == 1:
        while not os.path.exists(marker):
            time.sleep(0.01)
        return comm.alltoall(blocks).tolist()
    handle = comm.alltoall_async(blocks)
    error = error_of(lambda: handle.wait("the lonely alltoall", timeout=1.0))
    open(marker, "w").close()
    return error, handle.wait("the joined alltoall").tolist()


def test_alltoall_timeout_names_the_operation_and_rank_then_completes(tmp_path):
    (error, rows), late = run_workers(_late_peer_worker, 2, str(tmp_path / "timed-out"))
    assert error is not None and error.startswith("CommunicationError: the lonely alltoall"), error
    assert "torch all_to_all_single of 2 int64 elements on rank 0 of 2" in error, error
    assert rows == [[0], [10]] and late == [[1], [11]]


def test_local_alltoall_is_the_identity():
    from mergecomp.engines.communicator import LocalCommunicator

    comm = LocalCommunicator()
    t = torch.arange(5, dtype=torch.bfloat16)
    assert torch.equal(comm.alltoall(t), t.view(1, 5))
    assert comm.alltoall(torch.empty(0, dtype=torch.uint8)).shape == (1, 0)
    _raises(ValueError, lambda: comm.alltoall(torch.zeros(2, 2)), "1-D", "rank 0 of 1")

"""Horovod-shaped tensor collectives (mc.allreduce, allgather, broadcast, alltoall, join ...) on
real gloo ranks.  Checks are grouped into few worker runs: each spawn costs seconds."""
import pytest
import torch
from distributed import run_workers


def _expect_raises(kind, fn, *words):
    try:
        fn()
    except kind as err:
        for word in words:
            assert word in str(err), (word, str(err))
        return str(err)
    raise AssertionError(f"{fn} did not raise {kind.__name__}")


def _allreduce_checks(mc, rank, world):
    base = torch.arange(4, dtype=torch.float32) + rank          # rank r holds [r, r+1, r+2, r+3]
    total = sum(torch.arange(4, dtype=torch.float32) + r for r in range(world))
    kept = base.clone()
    assert torch.equal(mc.allreduce(base), total / world)        # default op: Average
    assert torch.equal(base, kept), "allreduce must not touch its input"
    assert torch.equal(mc.allreduce(base, op=mc.Sum, name="s"), total)
    assert torch.equal(mc.allreduce(base, average=False), total)
    assert torch.equal(mc.allreduce(base, average=True), total / world)
    assert torch.allclose(mc.allreduce(base, op=mc.Sum, prescale_factor=2.0, postscale_factor=0.5), total)
    assert torch.allclose(mc.allreduce(base, op=mc.Sum, prescale_factor=3.0), 3 * total)
    assert torch.allclose(mc.allreduce(base, postscale_factor=world), total)
    inplace = base.clone()
    assert mc.allreduce_(inplace, op=mc.Sum) is inplace and torch.equal(inplace, total)
    # a non-contiguous tensor in place: the strided view itself gets the result
    matrix = torch.stack([base, base]).t()
    assert not matrix.is_contiguous()
    mc.allreduce_(matrix, op=mc.Sum)
    assert torch.equal(matrix, torch.stack([total, total]).t())
    # async: new tensor and in place
    h1 = mc.allreduce_async(base, op=mc.Sum, name="a1")
    target = base.clone()
    h2 = mc.allreduce_async_(target)
    assert mc.poll(h1) is True
    assert torch.equal(mc.synchronize(h1), total) and torch.equal(base, kept)
    assert mc.synchronize(h2) is target and torch.equal(target, total / world)
    assert torch.equal(mc.synchronize(h1), total), "a second synchronize returns the same result"
    # fp16 and integers
    half = mc.allreduce(base.half(), op=mc.Sum)
    assert half.dtype == torch.float16 and torch.equal(half, total.half())
    fine = torch.full((2,), 1 + 2.0 ** -12)                      # float16 rounds it to 1
    assert torch.equal(mc.allreduce(fine, op=mc.Sum), torch.full((2,), world * (1 + 2.0 ** -12)))
    sent_half = mc.allreduce(fine, None, None, mc.Compression.fp16, mc.Sum)  # Horovod's positional order
    assert sent_half.dtype == torch.float32 and torch.equal(sent_half, torch.full((2,), float(world)))
    _expect_raises(ValueError, lambda: mc.allreduce(fine, compression="topk"), "compression")
    ints = torch.tensor([rank, -rank, 7], dtype=torch.int64)
    summed = mc.allreduce(ints, op=mc.Sum)
    assert summed.dtype == torch.int64 and summed.tolist() == [sum(range(world)), -sum(range(world)), 7 * world]
    averaged = mc.allreduce(ints)                                # floor division of the sum
    assert averaged.tolist() == [sum(range(world)) // world, -sum(range(world)) // world, 7]
    # argument errors (raised before any communication, so the ranks stay in step)
    _expect_raises(NotImplementedError, lambda: mc.allreduce(base, op=mc.Adasum), "Adasum")
    _expect_raises(ValueError, lambda: mc.allreduce(base, average=True, op=mc.Sum), "not both")
    _expect_raises(ValueError, lambda: mc.allreduce(ints, prescale_factor=2.0, name="ints"), "'ints'")


def _gather_checks(mc, rank, world):
    mine = torch.full((rank + 1, 2), float(rank))                # rank r: r+1 rows of r
    gathered = mc.allgather(mine, name="rows")
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world)])
    assert torch.equal(gathered, expected)
    handle = mc.allgather_async(torch.tensor([rank] * rank, dtype=torch.int32))  # rank 0 sends nothing
    assert mc.synchronize(handle).tolist() == [r for r in range(world) for _ in range(r)]
    assert mc.allgather(torch.tensor(float(rank))).tolist() == [float(r) for r in range(world)]
    bad = torch.zeros(2, 3 if rank == world - 1 else 2)
    message = _expect_raises(ValueError, lambda: mc.allgather(bad, name="bad"),
                             "'bad'", "rank 0", f"rank {world - 1}", "first dimension")
    assert "[2, 2]" in message and "[2, 3]" in message
    weight = torch.nn.Parameter(torch.full((1, 2), float(rank)))  # requires grad: gathered detached
    assert mc.allgather(weight).tolist() == [[float(r)] * 2 for r in range(world)]
    objects = mc.allgather_object({"rank": rank, "payload": "x" * (10 * rank)})
    assert objects == [{"rank": r, "payload": "x" * (10 * r)} for r in range(world)]


def _broadcast_checks(mc, rank, world):
    root = world - 1
    mine = torch.arange(3, dtype=torch.float64) * (rank + 1)
    kept = mine.clone()
    out = mc.broadcast(mine, root_rank=root, name="b")
    assert torch.equal(out, torch.arange(3, dtype=torch.float64) * world) and torch.equal(mine, kept)
    assert mc.broadcast_(mine, root) is mine and torch.equal(mine, out)
    strided = torch.arange(6.).reshape(2, 3).t() * (rank + 1)
    mc.broadcast_(strided, 0)
    assert torch.equal(strided, torch.arange(6.).reshape(2, 3).t())
    _expect_raises(ValueError, lambda: mc.broadcast(mine, world), "root_rank")


def _alltoall_checks(mc, rank, world):
    # rank r sends (d + r) % 3 rows to rank d; a row carries (sender, destination, index)
    splits = [(d + rank) % 3 for d in range(world)]
    rows = [[rank, d, i] for d in range(world) for i in range(splits[d])]
    tensor = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    out, received = mc.alltoall(tensor, splits=splits, name="a2a")
    expected = [[s, rank, i] for s in range(world) for i in range((rank + s) % 3)]
    assert out.tolist() == expected, (out.tolist(), expected)
    assert received.tolist() == [(rank + s) % 3 for s in range(world)]
    even = mc.alltoall(torch.arange(2 * world) + 100 * rank)     # equal splits, tensor only
    assert even.tolist() == [100 * s + 2 * rank + k for s in range(world) for k in range(2)]
    too_many = [tensor.shape[0] + 1] + [0] * (world - 1)
    _expect_raises(ValueError, lambda: mc.alltoall(tensor, splits=too_many, name="a2a"), "summing", "a2a")
    if world == 3:
        _expect_raises(ValueError, lambda: mc.alltoall(torch.zeros(4)), "divide")


def _misc_checks(mc, rank, world, hosts):
    import time

    mc.barrier()
    if rank == world - 1:
        time.sleep(0.5)
    assert mc.join() == world - 1
    assert mc.cross_size() == hosts and mc.cross_rank() == rank // (world // hosts)
    for fn in (mc.gloo_built, mc.nccl_built, mc.mpi_built, mc.mpi_enabled, mc.gloo_enabled, mc.cuda_built,
               mc.rocm_built, mc.mpi_threads_supported):
        assert isinstance(fn(), bool), fn
    assert mc.gloo_built() and mc.gloo_enabled() and not mc.mpi_enabled() and not mc.mpi_threads_supported()


def _collectives_worker(rank, world, hosts):
    import mergecomp.torch as mc

    _allreduce_checks(mc, rank, world)
    _gather_checks(mc, rank, world)
    _broadcast_checks(mc, rank, world)
    _alltoall_checks(mc, rank, world)
    _misc_checks(mc, rank, world, hosts)
    return True


def test_collectives_two_ranks():
    assert run_workers(_collectives_worker, 2, 2, 1) == [True, True]


def test_collectives_three_ranks_one_process_per_host():
    # LOCAL_WORLD_SIZE=1: every rank is alone on its "host", so cross_rank == rank
    assert run_workers(_collectives_worker, 3, 3, 3, env={"LOCAL_WORLD_SIZE": "1"}) == [True] * 3


def _sync_bn_worker(rank, world):
    import mergecomp.torch as mc

    torch.manual_seed(0)
    full = torch.randn(8 * world, 3, 5)
    reference = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        reference.weight.uniform_()
        reference.bias.uniform_()
    bn = mc.SyncBatchNorm(3)
    bn.load_state_dict(reference.state_dict())
    assert bn.training
    x = full[8 * rank:8 * (rank + 1)].clone().requires_grad_()
    y = bn(x)
    (y * torch.arange(5.)).sum().backward()
    ref_x = full.clone().requires_grad_()
    ref_y = reference(ref_x)
    (ref_y * torch.arange(5.)).sum().backward()
    assert torch.allclose(y, ref_y[8 * rank:8 * (rank + 1)], atol=1e-5)
    assert torch.allclose(x.grad, ref_x.grad[8 * rank:8 * (rank + 1)], atol=1e-5)
    weight_grad = mc.allreduce(bn.weight.grad, op=mc.Sum)        # every rank's share of the full-batch grad
    assert torch.allclose(weight_grad, reference.weight.grad, atol=1e-4)
    assert torch.allclose(bn.running_mean, reference.running_mean, atol=1e-5)
    assert torch.allclose(bn.running_var, reference.running_var, atol=1e-5)
    bn.eval()
    assert torch.allclose(bn(full[:2]), reference.eval()(full[:2]), atol=1e-5)
    # a large mean must not cancel the variance (E[x^2] - E[x]^2 in fp32 loses it at 1e4)
    shifted, shifted_ref = mc.SyncBatchNorm(3, affine=False), torch.nn.BatchNorm1d(3, affine=False)
    far = 1e4 + full
    assert torch.allclose(shifted(far[8 * rank:8 * (rank + 1)]), shifted_ref(far)[8 * rank:8 * (rank + 1)],
                          atol=1e-3)
    return True


def test_sync_batch_norm_matches_full_batch_on_two_ranks():
    assert run_workers(_sync_bn_worker, 2, 2) == [True, True]


def test_exported_from_mergecomp_torch():
    import mergecomp.torch as mc

    for name in ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather",
                 "allgather_async", "allgather_object", "broadcast", "broadcast_", "alltoall", "synchronize",
                 "poll", "barrier", "join", "cross_rank", "cross_size", "SyncBatchNorm", "nccl_built"):
        assert name in mc.__all__ and callable(getattr(mc, name)), name


def _early_join_worker(rank):
    import mergecomp.torch as mc
    from mergecomp.engines.communicator import CommunicationError

    try:
        mc.join() if rank == 0 else mc.allreduce(torch.ones(3), name="late")  # rank 0 does not serve it
    except CommunicationError as err:
        return str(err)
    return "no error"


def test_collective_after_a_rank_joined_times_out_instead_of_hanging():
    joined, late = run_workers(_early_join_worker, 2, env={"MERGECOMP_TIMEOUT": "3"}, timeout=60)
    assert joined.startswith("join") and "timed out" in joined
    assert late.startswith("allreduce of 'late'") and "timed out" in late

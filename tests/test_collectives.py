"""Horovod-shaped tensor collectives (mc.allreduce, allgather, broadcast, alltoall, join ...) on
real gloo ranks.  Checks are grouped into few worker runs: each spawn costs seconds."""
import math

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
    averaged = mc.allreduce(ints)                                # the sum divided, truncated toward zero
    assert averaged.tolist() == [int(sum(range(world)) / world), int(-sum(range(world)) / world), 7]
    scaled = mc.allreduce(ints, op=mc.Sum, prescale_factor=1.5)  # integers scale in float64, truncated
    assert scaled.tolist() == [sum(int(1.5 * r) for r in range(world)), sum(int(-1.5 * r) for r in range(world)),
                               10 * world]
    # argument errors (raised before any communication, so the ranks stay in step)
    _expect_raises(NotImplementedError, lambda: mc.allreduce(base, op=mc.Adasum), "Adasum")
    _expect_raises(ValueError, lambda: mc.allreduce(base, average=True, op=mc.Sum), "not both")
    assert mc.allreduce(ints, op=mc.Sum, prescale_factor=2.0, name="ints").tolist() == [
        2 * sum(range(world)), -2 * sum(range(world)), 14 * world]
    assert mc.allreduce(torch.tensor([rank, 5 - rank]), op=mc.Min).tolist() == [0, 5 - (world - 1)]
    assert mc.allreduce(torch.tensor([rank, 5 - rank]), op=mc.Max).tolist() == [world - 1, 5]
    assert mc.allreduce(torch.tensor([rank + 1.0]), op=mc.Product).tolist() == [float(math.factorial(world))]


def _gather_checks(mc, rank, world):
    mine = torch.full((rank + 1, 2), float(rank))                # rank r: r+1 rows of r
    gathered = mc.allgather(mine, name="rows")
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world)])
    assert torch.equal(gathered, expected)
    handle = mc.allgather_async(torch.tensor([rank] * rank, dtype=torch.int32))  # rank 0 sends nothing
    assert mc.synchronize(handle).tolist() == [r for r in range(world) for _ in range(r)]
    assert mc.allgather(torch.tensor(float(rank))).tolist() == [float(r) for r in range(world)]
    bad = torch.zeros(2, 3 if rank == world - 1 else 2)
    message = _expect_raises(mc.MismatchError, lambda: mc.allgather(bad, name="bad"),
                             "'bad'", "rank 0", f"rank {world - 1}", "first dimension")
    assert "[2, 2]" in message and "[2, 3]" in message
    for dtype in (torch.int16, torch.bool, torch.complex64):       # dtypes gloo lacks travel as bytes
        assert mc.allgather(torch.tensor([rank % 2], dtype=dtype)).tolist() == [
            torch.tensor([r % 2], dtype=dtype).item() for r in range(world)]
    assert mc.allreduce(torch.tensor([rank, 300], dtype=torch.int16), op=mc.Sum).tolist() == [
        sum(range(world)), 300 * world]
    weight = torch.nn.Parameter(torch.full((1, 2), float(rank)))  # requires grad: gathered detached
    assert mc.allgather(weight).tolist() == [[float(r)] * 2 for r in range(world)]
    objects = mc.allgather_object({"rank": rank, "payload": "x" * (10 * rank)})
    assert objects == [{"rank": r, "payload": "x" * (10 * r)} for r in range(world)]
    comm = mc.communicator()                                      # inline bytes, and longer than that on rank 1
    long = comm.allgather_object("y" * (rank * 3 * comm.INLINE_BYTES))
    assert long == ["y" * (r * 3 * comm.INLINE_BYTES) for r in range(world)]


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
    _expect_raises(mc.MismatchError, lambda: mc.broadcast(mine, rank, name="roots"), "'roots'", "root_rank")


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
        time.sleep(2.0)  # the last to join, whatever the machine's load
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


def _error_of(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reports what was raised
        return f"{type(err).__name__}: {err}"
    return "no error"


def _mismatch_worker(rank):
    """Arguments that differ between ranks: an error on every rank, at once, never a result."""
    import time

    import mergecomp.torch as mc

    start = time.monotonic()
    errors = {
        "dtype": _error_of(lambda: mc.allreduce(torch.ones(5, dtype=torch.int32 if rank else torch.float32))),
        "shape": _error_of(lambda: mc.allreduce(torch.ones(17 + rank, 3), name="grad")),
        "rank_of_shape": _error_of(lambda: mc.allreduce(torch.ones(6) if rank else torch.ones(2, 3))),
        "broadcast_dtype": _error_of(lambda: mc.broadcast(torch.ones(3, dtype=torch.int64 if rank else torch.float32),
                                                          0)),
        "broadcast_shape": _error_of(lambda: mc.broadcast(torch.ones(3, 2 + rank), 0)),
        "root": _error_of(lambda: mc.broadcast(torch.ones(3), rank, name="b")),
        "op": _error_of(lambda: mc.allreduce(torch.ones(3), op=mc.Sum if rank else mc.Max)),
        "reducescatter": _error_of(lambda: mc.reducescatter(torch.ones(4, 2 + rank))),
        "kind": _error_of(lambda: (mc.allgather if rank else mc.allreduce)(torch.ones(3), name="x")),
    }
    seconds = time.monotonic() - start
    after = mc.allreduce(torch.ones(2), op=mc.Sum).tolist()  # the ranks are still in step
    return errors, seconds, after


def test_mismatched_arguments_raise_on_every_rank_quickly():
    for errors, seconds, after in run_workers(_mismatch_worker, 2):
        assert after == [2.0, 2.0] and seconds < 10, seconds
        for case, error in errors.items():
            assert error.startswith("MismatchError"), (case, error)
            assert "rank 0" in error and "rank 1" in error, (case, error)
        assert "torch.float32" in errors["dtype"] and "torch.int32" in errors["dtype"]
        assert "'grad'" in errors["shape"] and "[17, 3]" in errors["shape"] and "[18, 3]" in errors["shape"]
        assert "root_rank 0" in errors["root"] and "'b'" in errors["root"]
        assert "op" in errors["op"] and "allgather" in errors["kind"] and "allreduce" in errors["kind"]


def _negotiation_worker(rank):
    """Collectives matched by name whatever the order; duplicate names; a non-blocking poll."""
    import time

    import mergecomp.torch as mc

    out = {}
    names = ["a", "b", "c"] if rank == 0 else ["c", "a", "b"]      # started in different orders
    handles = {n: mc.allreduce_async(torch.full((3,), float(ord(n) + rank)), name=n, op=mc.Sum) for n in names}
    out["by_name"] = {n: mc.synchronize(h).tolist() for n, h in handles.items()}
    if rank == 0:  # rank 0 starts "late" and goes into a barrier before rank 1 has started it
        pending = mc.allreduce_async(torch.ones(2), name="late")
        out["poll_before"] = mc.poll(pending)
        out["duplicate"] = _error_of(lambda: mc.allreduce_async(torch.ones(2), name="late"))
    mc.barrier()
    if rank == 1:
        time.sleep(0.3)
        pending = mc.allreduce_async(torch.ones(2), name="late")
    while not mc.poll(pending):
        time.sleep(0.001)
    out["late"] = mc.synchronize(pending).tolist()
    return out


def test_collectives_are_matched_by_name_and_poll_does_not_block():
    zero, one = run_workers(_negotiation_worker, 2)
    for out in (zero, one):
        assert out["by_name"] == {n: [2.0 * ord(n) + 1] * 3 for n in "abc"}
        assert out["late"] == [1.0, 1.0]
    assert zero["poll_before"] is False
    assert zero["duplicate"].startswith("ValueError") and "'late'" in zero["duplicate"]


def _join_worker(rank, world):
    import mergecomp.torch as mc

    out = {}
    if rank == 0:
        out["last"] = mc.join()
    else:  # rank 0 has joined: it contributes zeros to the reductions, and cannot take part in an allgather
        out["sum"] = mc.allreduce(torch.full((2,), float(rank)), op=mc.Sum, name="sum").tolist()
        out["average"] = mc.allreduce(torch.full((2,), float(rank)), name="average").tolist()
        out["allgather"] = _error_of(lambda: mc.allgather(torch.ones(1), name="while joined"))
        out["last"] = mc.join()
    out["after"] = mc.allreduce(torch.ones(1), op=mc.Sum, name="after").tolist()  # unnamed counts differ now
    return out


def test_join_stands_in_with_zeros_until_every_rank_joined():
    world = 3
    outs = run_workers(_join_worker, world, world)
    assert [o["last"] for o in outs] == [2] * world   # rank 2 joins last (rank 1 waits for it in allreduce)
    for rank in (1, 2):
        assert outs[rank]["sum"] == [3.0, 3.0] and outs[rank]["average"] == [1.0, 1.0]
        assert outs[rank]["allgather"].startswith("MismatchError") and "joined" in outs[rank]["allgather"]
    assert all(o["after"] == [float(world)] for o in outs)


def _reducescatter_worker(rank, world):
    import mergecomp.torch as mc

    out = {}
    rows = 2 * world + 1                                           # uneven: the first rank gets one more row
    tensor = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (rank + 1)
    total = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(range(1, world + 1))
    parts = [2 + (r < 1) for r in range(world)]
    mine = total.split(parts)[rank]
    out["sum"] = torch.equal(mc.reducescatter(tensor, op=mc.Sum), mine)
    out["average"] = torch.allclose(mc.reducescatter(tensor), mine / world)
    ints = mc.reducescatter(torch.arange(world * 2).reshape(world, 2) + rank, op=mc.Sum)
    out["ints"] = ints.tolist()
    half = mc.grouped_reducescatter([tensor.half(), tensor.double()], op=mc.Sum)
    out["grouped"] = [h.dtype for h in half] == [torch.float16, torch.float64] and torch.equal(half[1], mine.double())
    out["scalar"] = _error_of(lambda: mc.reducescatter(torch.tensor(1.0)))
    grad_in = tensor.clone().requires_grad_()
    mc.reducescatter(grad_in, op=mc.Sum).sum().backward()          # Horovod's gradient: allgather x size
    out["grad"] = torch.equal(grad_in.grad, torch.full_like(tensor, float(world)))
    return out


def test_reducescatter_splits_rows_like_horovod():
    world = 3
    for rank, out in enumerate(run_workers(_reducescatter_worker, world, world)):
        assert out["sum"] and out["average"] and out["grouped"] and out["grad"], out
        assert out["ints"] == [[2 * rank * world + sum(range(world)), (2 * rank + 1) * world + sum(range(world))]]
        assert out["scalar"].startswith("ValueError")


def _autograd_worker(rank, world):
    import mergecomp.torch as mc

    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    mc.allreduce(x, op=mc.Sum).sum().backward()
    grads = {"allreduce": x.grad.tolist()}
    x = torch.full((rank + 1, 3), 1.0, requires_grad=True)
    gathered = mc.allgather(x)
    (gathered * torch.arange(gathered.shape[0], dtype=torch.float32)[:, None]).sum().backward()
    grads["allgather"] = x.grad[:, 0].tolist()
    x = torch.ones(3, requires_grad=True)
    mc.broadcast(x, root_rank=1).sum().backward()
    grads["broadcast"] = x.grad.tolist()
    x = torch.arange(world * 2, dtype=torch.float32, requires_grad=True)
    (mc.alltoall(x) * (rank + 1)).sum().backward()
    grads["alltoall"] = x.grad.tolist()
    return grads


def test_collectives_are_differentiable_as_in_horovod():
    world = 2
    for rank, grads in enumerate(run_workers(_autograd_worker, world, world)):
        assert grads["allreduce"] == [[2.0] * 3] * 2
        offset = sum(r + 1 for r in range(rank))                   # this rank's rows in the gathered tensor
        assert grads["allgather"] == [float(offset + i) for i in range(rank + 1)]
        assert grads["broadcast"] == ([1.0] * 3 if rank == 1 else [0.0] * 3)
        assert grads["alltoall"] == [1.0, 1.0, 2.0, 2.0]             # each block's gradient from its receiver


def _process_set_worker(rank, world):
    import mergecomp.torch as mc

    evens = mc.add_process_set([r for r in range(world) if r % 2 == 0])
    odds = mc.add_process_set([r for r in range(world) if r % 2])
    mine = evens if rank % 2 == 0 else odds
    out = {"set_rank": mine.rank(), "set_size": mine.size(), "included": evens.included()}
    out["sum"] = mc.allreduce(torch.tensor([float(rank)]), op=mc.Sum, process_set=mine).tolist()
    out["gather"] = mc.allgather(torch.tensor([rank]), process_set=mine).tolist()
    last = max(r for r in range(world) if r % 2 == rank % 2)       # root_rank: a rank of the job, as in Horovod
    out["broadcast"] = mc.broadcast(torch.tensor([rank]), root_rank=last, process_set=mine).tolist()
    out["object"] = mc.broadcast_object(f"from {rank}", root_rank=last, process_set=mine)
    other = odds if mine is evens else evens
    out["outside"] = _error_of(lambda: mc.allreduce(torch.ones(1), process_set=other))
    out["disagree"] = _error_of(lambda: mc.add_process_set([rank]))
    torch.manual_seed(rank)                                        # every rank starts and trains differently
    model = torch.nn.Linear(3, 1)
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                  process_set=mine)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    model(torch.randn(4, 3) * (rank + 1)).pow(2).sum().backward()
    opt.step()
    weights = mc.allgather(model.weight.detach(), process_set=mine)
    out["set_trains_together"] = all(torch.equal(w, weights[0]) for w in weights)
    everyone = mc.allgather(model.weight.detach())
    out["sets_differ"] = not torch.equal(everyone[0], everyone[1])
    outsider = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                       process_set=other)        # not a member: steps on its own gradients
    out["outsider_alone"] = outsider.merged.comm.size == 1
    outsider.remove_hooks()
    mc.barrier(process_set=mine)
    out["removed"] = (mc.remove_process_set(odds), mc.remove_process_set(evens), mc.remove_process_set(evens))
    out["after"] = _error_of(lambda: mc.allreduce(torch.ones(1), process_set=mine))
    return out


def test_process_sets_run_among_their_members():
    world = 3
    for rank, out in enumerate(run_workers(_process_set_worker, world, world)):
        members = [r for r in range(world) if r % 2 == rank % 2]
        assert out["set_rank"] == members.index(rank) and out["set_size"] == len(members)
        assert out["included"] == (rank % 2 == 0)
        assert out["sum"] == [float(sum(members))] and out["gather"] == members
        assert out["broadcast"] == [members[-1]] and out["object"] == f"from {members[-1]}"
        assert out["outside"].startswith("ValueError") and "not in" in out["outside"]
        assert out["disagree"].startswith("ValueError") and "disagree" in out["disagree"]
        assert out["removed"] == (True, True, False)
        assert out["set_trains_together"] and out["sets_differ"] and out["outsider_alone"]
        assert out["after"].startswith("ValueError") and "removed" in out["after"]


def _reinit_worker(rank):
    import time

    import mergecomp.torch as mc

    first = mc.allreduce(torch.ones(1), op=mc.Sum).tolist()
    mc.shutdown()
    time.sleep(0.5 * rank)                                         # the ranks come back at different moments
    mc.init()
    return first, mc.allreduce(torch.ones(1), op=mc.Sum).tolist(), mc.rank()


def test_init_after_shutdown_works():
    outs = run_workers(_reinit_worker, 2, timeout=60)
    assert outs == [([2.0], [2.0], 0), ([2.0], [2.0], 1)]


def _missing_peer_worker(rank):
    import mergecomp.torch as mc

    if rank == 0:
        return _error_of(lambda: mc.allreduce(torch.ones(3), name="lonely"))
    return "no call"


def test_collective_no_other_rank_asks_for_fails_after_the_timeout():
    lonely, _ = run_workers(_missing_peer_worker, 2, env={"MERGECOMP_TIMEOUT": "3"}, timeout=60)
    assert lonely.startswith(("MismatchError", "CommunicationError")) and "'lonely'" in lonely, lonely


def test_horovod_compression_contract():
    import mergecomp.torch as mc

    packed, ctx = mc.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert packed.dtype == torch.float16 and mc.Compression.fp16.decompress(packed, ctx).dtype == torch.float64
    same, ctx = mc.Compression.none.compress(torch.ones(3, dtype=torch.int8))
    assert same.dtype == torch.int8 and mc.Compression.none.decompress(same, ctx).dtype == torch.int8
    assert mc.Compression.fp16 == "fp16"  # still the compressor's name for DistributedOptimizer


def test_timeline_records_negotiation_and_collective(tmp_path):
    import json

    import mergecomp.torch as mc

    mc.init(engine="local")
    try:
        mc.start_timeline(str(tmp_path / "timeline.json"), mark_cycles=True)
        mc.allreduce(torch.ones(3), name="loss")
        mc.stop_timeline()
    finally:
        mc.shutdown()
    events = json.loads((tmp_path / "timeline.json").read_text())
    phases = {e["name"] for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"} <= phases
    assert any(e.get("args", {}).get("name") == "allreduce.loss" for e in events)

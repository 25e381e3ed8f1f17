"""Resuming from checkpoints the way Horovod scripts do: the checkpoint is loaded on rank 0 only
(then broadcast_parameters + broadcast_optimizer_state), or on every rank; 2 gloo ranks."""
import io
import logging

import pytest
import torch

from distributed import run_workers
from test_optimizer_dist import flat_params, make_data, make_model, shard, train


def _resume_worker(rank, compression, who_loads, groups, memory=None):
    import mergecomp
    import mergecomp.torch as mc

    x, y = make_data()
    xs, ys = shard(x, rank), shard(y, rank)

    def fresh():
        model = make_model()
        own_memory = mergecomp.get_memory(memory[0], **memory[1]) if memory else None  # (name, arguments)
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      model.named_parameters(), compression=compression, memory=own_memory,
                                      groups=groups)
        return model, opt

    model, opt = fresh()
    train(model, opt, xs, ys, steps=3)
    buffer = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buffer)  # as a checkpoint file would
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    train(model, opt, xs, ys, steps=2)
    uninterrupted = flat_params(model)

    model, opt = fresh()
    train(model, opt, xs, ys, steps=1)  # a run that started, then was restarted from the checkpoint
    if who_loads == "rank 0's file on every rank":
        saved = mc.broadcast_object(saved, root_rank=0)
    model, opt = fresh()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mergecomp").addHandler(handler)
    if who_loads != "rank 0" or rank == 0:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    mc.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, xs, ys, steps=2)
    residuals = sum(len(fields) for fields in opt.memory.state.values())
    return (flat_params(model), uninterrupted, opt.merged.step, opt.plan,
            [r.getMessage() for r in records], residuals)


@pytest.mark.parametrize("compression,memory,who_loads,exact", [
    ("none", None, "rank 0", True),            # nothing per rank: the continuation is the uninterrupted run
    ("topk", None, "every rank", True),        # every rank's own residuals: exact too
    ("onebit", None, "every rank", True),      # a residual carried by the sign codes' one pass: written out, exact
    ("signum", None, "every rank", True),      # a momentum stepped part by part into a second buffer: exact
    ("powersgd", None, "every rank", True),    # a residual its decode wrote, and the warm-start Q: exact
    ("topk", ("averaged", {"reset_every": 3}), "every rank", True),  # the averaged errors, their update counts
                                                                    # and the clearing at step 4: exact
    ("topk", None, "rank 0", False),           # rank 0's residuals alone: reset on every rank, said so
    ("topk", None, "rank 0's file on every rank", False),  # rank 0's residuals are not rank 1's: reset, said so
])
def test_resume_from_a_checkpoint_loaded_on_rank_0_or_on_every_rank(compression, memory, who_loads, exact):
    results = run_workers(_resume_worker, 2, compression, who_loads, 2, memory)
    params = [r[0] for r in results]
    assert torch.equal(params[0], params[1]), "the ranks' parameters differ after resuming"
    for final, uninterrupted, step, plan, messages, residuals in results:
        assert step == 5 and plan == results[0][3]
        if exact:
            assert torch.equal(final, uninterrupted)
        else:
            assert residuals > 0  # error feedback runs again from the resumed step
    warned = [m for m in results[0][4] if "start afresh" in m]
    assert bool(warned) == (compression == "topk" and who_loads != "every rank")
    if who_loads == "rank 0's file on every rank":
        assert any("holds rank 0's error-feedback residuals" in m for m in results[1][4])
        assert not any("holds rank" in m for m in results[0][4])  # rank 0 loaded its own


def test_resume_with_the_scheduler_loaded_on_rank_0_only():
    """groups="auto": rank 0's chosen plan and scheduler state reach rank 1, so both run the same
    collectives (before, rank 1 started a search of its own and the ranks hung)."""
    results = run_workers(_resume_worker, 2, "none", "rank 0", "auto", timeout=240)
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][3] == results[1][3]


def _world_size_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", groups=1)
    x, y = make_data()
    train(model, opt, shard(x, rank), shard(y, rank), steps=2)
    state = opt.state_dict()
    state["mergecomp"]["world_size"] = 4  # as if saved on 4 ranks
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mergecomp").addHandler(handler)
    opt.load_state_dict(state)
    return [r.getMessage() for r in records], len(opt.memory.state)


def test_a_checkpoint_from_another_world_size_says_what_it_resets():
    for messages, groups_with_residuals in run_workers(_world_size_worker, 2):
        assert any("saved with 4 ranks and runs on 2" in m for m in messages)
        assert groups_with_residuals == 0

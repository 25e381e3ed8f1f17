"""The step-scoped buffer pool behind the codecs' full-size outputs on CPU."""
import pytest
import torch

import mergecomp
from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import build_plan, layout
from mergecomp.kernels.workspace import Workspace

CPU = torch.device("cpu")


def test_buffers_are_distinct_within_a_step_and_recycled_on_the_next():
    ws = Workspace()
    a, b = ws.empty(10, torch.float32, CPU), ws.empty(10, torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()
    ws.advance(1)
    again = {ws.empty(10, torch.float32, CPU).data_ptr() for _ in range(2)}
    assert again == {a.data_ptr(), b.data_ptr()}
    assert ws.empty(10, torch.float64, CPU).dtype == torch.float64  # other keys: fresh
    ws.advance(2)
    ws.advance(3)  # nothing taken in step 2: step 1's buffers were dropped, not kept forever
    assert not ws._free.get((10, torch.float32, CPU))


def test_workspace_is_not_a_setting_and_results_stay_valid_within_the_step():
    comm = LocalCommunicator()
    exchange = Exchange.create("topk", None, comm)
    assert exchange.workspace is not None
    assert "workspace" not in exchange.compressor.settings()
    assert "workspace" not in repr(exchange.compressor)
    shapes = [torch.Size([300]), torch.Size([200])]
    plan = build_plan(2, [0, 1], ["a", "b"], [1200, 800])
    groups = layout(plan, shapes)
    grads = [torch.randn(g.numel) for g in groups]
    jobs = [exchange.start(g, x.clone()) for g, x in zip(groups, grads)]
    results = [exchange.finish(job) for job in jobs]
    kept = [r.clone() for r in results]
    assert results[0].data_ptr() != results[1].data_ptr()
    for r, k in zip(results, kept):
        assert torch.equal(r, k)
    step0 = {t.data_ptr() for ts in exchange.workspace._taken.values() for t in ts}
    exchange.step += 1
    # Next step: step 0's buffers come back (no fresh allocation for the same group sizes).
    jobs = [exchange.start(g, x.clone()) for g, x in zip(groups, grads)]
    again = [exchange.finish(job) for job in jobs]
    assert {r.data_ptr() for r in again} <= step0


def test_tensorflow_style_exchange_does_not_recycle():
    exchange = Exchange.create("signsgd", None, LocalCommunicator(), recycle=False)
    assert exchange.workspace is None and exchange.compressor.workspace is None
    assert isinstance(exchange.compressor, mergecomp.Compressor)


def test_serving_lends_the_callers_tensor_once_and_never_pools_it():
    ws, mine = Workspace(), torch.empty(10)
    with ws.serving(mine):
        assert ws.empty(10, torch.float64, CPU).data_ptr() != mine.data_ptr()  # other key
        assert ws.empty(10, torch.float32, CPU) is mine
        assert ws.empty(10, torch.float32, CPU) is not mine  # once
    with ws.serving(mine):
        pass
    assert ws.empty(10, torch.float32, CPU) is not mine  # not lent outside the block
    ws.advance(1)
    assert all(ws.empty(10, torch.float32, CPU) is not mine for _ in range(3))
    with pytest.raises(ValueError, match="flat contiguous"):
        with ws.serving(torch.empty(2, 5)):
            pass


def test_a_tensor_lent_as_zeros_is_known_only_inside_the_block():
    ws, mine = Workspace(), torch.zeros(10)
    with ws.serving(mine, zeroed=True):
        assert ws.holds_zeros(mine) and not ws.holds_zeros(torch.zeros(10))
    assert not ws.holds_zeros(mine)
    with ws.serving(mine):
        assert not ws.holds_zeros(mine)


def test_a_sparse_decode_scatters_into_a_tensor_lent_as_zeros_without_zeroing_it():
    """The workspace's word is trusted: a tensor lent as zeros is not zeroed again, the entries
    are added where they land (a lent tensor of sevens shows it); one lent without it is zeroed."""
    compressor = mergecomp.get_compressor("topk", ratio=0.25)
    compressor.workspace = ws = Workspace()
    payload, ctx = compressor.compress(torch.arange(8.0), "g")
    for zeroed in (True, False):
        sevens = torch.full((8,), 7.0)
        with ws.serving(sevens, zeroed=zeroed):
            dense = compressor.decompress(payload, ctx)
        assert dense is sevens
        assert dense.tolist() == ([7.0] * 6 + [13.0, 14.0] if zeroed else [0.0] * 6 + [6.0, 7.0])


@pytest.mark.parametrize("compression", ["topk", "dgc", "randk", "onebit", "none"])
def test_an_encode_that_zeroes_its_scratch_buffer_gives_the_same_result(compression):
    """start(scratch=True) and finish(out=) into the same buffer: top-k's fused encode zeroes
    the buffer as it reads it (:attr:`Job.zeroed`) and its decode scatters into it; the results
    and the memory are those of an exchange that leaves the buffer alone, step after step."""
    shapes = [torch.Size([300, 40]), torch.Size([900])]
    groups = layout(build_plan(1, [0, 1], ["a", "b"], [300 * 40 * 4, 900 * 4]), shapes)
    results = []
    for scratch in (False, True):
        torch.manual_seed(0)
        exchange = Exchange.create(compression, None, LocalCommunicator())
        for step in range(3):
            exchange.step = step
            buffer = torch.randn(groups[0].numel, generator=torch.Generator().manual_seed(step))
            job = exchange.start(groups[0], buffer, scratch=scratch)
            assert job.zeroed == (scratch and compression in ("topk", "dgc")) and (not job.zeroed or not buffer.any())
            results.append(exchange.finish(job, out=buffer).clone())
            exchange.end_step()
    assert all(torch.equal(a, b) for a, b in zip(results[:3], results[3:]))


class FreshOutput(mergecomp.Compressor):
    """A plugin whose aggregate ignores the workspace: finish(out=) must copy its result in."""
    name = "fresh-output"

    def compress(self, tensor, name, shapes=None):
        return (tensor.clone(),), None

    def decompress(self, payload, ctx):
        return payload[0].clone()


@pytest.mark.parametrize("compression", sorted(mergecomp.compressor_names()) + ["fresh"])
def test_finish_writes_the_result_into_out(compression):
    """finish(job, out=buffer) gives the result of finish(job) in the caller's buffer."""
    shapes = [torch.Size([64, 32]), torch.Size([300])]
    groups = layout(build_plan(1, [0, 1], ["a", "b"], [64 * 32 * 4, 1200]), shapes)
    grad = torch.randn(groups[0].numel, generator=torch.Generator().manual_seed(3))
    results = []
    for into in (False, True):
        torch.manual_seed(0)
        codec = FreshOutput() if compression == "fresh" else compression
        exchange = Exchange.create(codec, None, LocalCommunicator())
        for step in range(2):  # the second step also exercises recycled buffers and memory
            exchange.step = step
            buffer = grad.clone()
            result = exchange.finish(exchange.start(groups[0], buffer), out=buffer if into else None)
        if into:
            assert result.data_ptr() == buffer.data_ptr()
        results.append(result.clone())
    assert torch.equal(results[0], results[1])

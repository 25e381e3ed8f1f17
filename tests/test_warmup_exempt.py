"""Convergence safety on 2 gloo ranks: the compression warm-up (``compression_warmup_steps``) and
tensors exempt from compression (``uncompressed``, ``min_compress_numel``), in the core, the
PyTorch optimizer (checkpoints, the scheduler) and the DDP hook.  One launch; the tests below
read its results."""
import io
import warnings

import pytest
import torch
from distributed import run_workers
from test_ddp_hook import ddp
from test_optimizer_dist import flat_params, make_data, make_model, shard, train

NAMES = ["w1", "b1", "w2", "b2"]
SHAPES = [(40, 8), (40,), (6, 40), (6,)]
#: make_model()'s parameters under min_compress_numel=200: the biases and the last weight (128)
SMALL = {"0.bias", "2.bias", "4.weight", "4.bias"}


def step_grads(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def exact_average(model, x, y):
    """The gradients averaged over both ranks' shards, computed here without any collective."""
    grads = []
    for r in (0, 1):
        twin = make_model()  # a plain copy: no exchange hooks
        twin.load_state_dict(model.state_dict())
        torch.nn.functional.cross_entropy(twin(shard(x, r)), shard(y, r)).backward()
        grads.append({n: p.grad for n, p in twin.named_parameters()})
    return {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}


def exact_grads(model, opt, x, y, rank, steps):
    """Per step, the names of the parameters whose exchanged gradient is bit-exact the average."""
    exact = []
    for _ in range(steps):
        want = exact_average(model, x, y)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
        exact.append({n for n, p in model.named_parameters() if torch.equal(p.grad, want[n])})
    return exact


def ddp_errors(model, x, y, rank, steps):
    """Per step of ``model`` (in DDP) under SGD, each parameter's largest error against the exact
    averaged gradient, relative to the largest element of that average."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for _ in range(steps):
        want = exact_average(model.module, x, y)
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
        sgd.step()
        errors.append({n: float((p.grad - want[n]).abs().max() / want[n].abs().max())
                       for n, p in model.module.named_parameters()})
    return errors


def _core(rank):
    """MergedStep with DGC (momentum in the memory): K warm-up steps, then the compressor."""
    from steps import planned

    import mergecomp.torch as mc
    from mergecomp.exchange.plan import GroupPlan

    comm = mc.communicator()

    def merged(compression, **options):
        return planned(compression, None, comm, NAMES, SHAPES, [torch.float32] * 4,
                       groups=GroupPlan(((3, 2), (1, 0))), **options)

    def run(step, steps):
        out = []
        for s in steps:
            for i, g in enumerate(step_grads(rank, s)):
                step.add(i, g)
            out.append([t.clone() for t in step.finish().tensors(4)])
        return out

    warm = merged("dgc", compression_warmup_steps=2)
    got = run(warm, range(2))
    state_after_warmup = len(warm.exchange.memory.state)
    got += run(warm, range(2, 5))
    # two separate runs: the plain average for steps 0-1, a fresh DGC from step 2 on
    want = run(merged("none"), range(2)) + run(merged("dgc"), range(2, 5))
    # compression_warmup_codec="fp16": the warm-up's groups are the fp16 codec's average, with
    # no error feedback (DGC starts as fresh as after the exact warm-up)
    half = merged("dgc", compression_warmup_steps=2, compression_warmup_codec="fp16")
    got_half = run(half, range(2))
    half_state = len(half.exchange.memory.state)
    got_half += run(half, range(2, 5))
    want_half = run(merged("fp16"), range(2)) + want[2:]
    # compression_warmup_codec="qsgd": 8-bit QSGD, allgathered, outside error feedback likewise
    eight = merged("dgc", compression_warmup_steps=2, compression_warmup_codec="qsgd")
    got_eight = run(eight, range(2))
    eight_state = len(eight.exchange.memory.state)
    got_eight += run(eight, range(2, 5))
    # compression_warmup_codec="qsgd4": its 4-bit codes (levels=7), likewise
    four = merged("dgc", compression_warmup_steps=2, compression_warmup_codec="qsgd4")
    got_four = run(four, range(2))
    four_state = len(four.exchange.memory.state)
    got_four += run(four, range(2, 5))
    # a gradient beyond fp16's range in such a warm-up is a non-finite step, named, not an Inf
    huge = merged("dgc", compression_warmup_steps=2, compression_warmup_codec="fp16", nonfinite="raise")
    for i, g in enumerate(step_grads(rank, 0)):
        huge.add(i, g * 1e6 if i == 0 and rank == 1 else g)
    try:
        huge.finish()
        overflow = None
    except FloatingPointError as err:
        overflow = str(err)
    # an exact step sent as fp16 after compression began (the momentum exchange's variance
    # refresh) that overflows is skipped and leaves the compressor's memory as it was
    kept = merged("dgc", compression_warmup_codec="fp16", nonfinite="skip")
    run(kept, range(2))  # compressed: DGC's memory fills
    before = kept.exchange.memory.state_dict()  # copies
    kept.exact = True
    for i, g in enumerate(step_grads(rank, 2)):
        kept.add(i, g * 1e6 if i == 0 and rank == 1 else g)
    skipped = kept.finish() is None
    after = kept.exchange.memory.state_dict()
    memory_kept = bool(before) and after.keys() == before.keys() and all(
        torch.equal(after[g][k], v) for g, fields in before.items() for k, v in fields.items())
    return {"equal": [all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got, want)],
            "compressed": [not torch.equal(a, b) for a, b in zip(got[2], run(merged("none"), [2])[0])],
            "state_after_warmup": state_after_warmup,
            "half": [all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got_half, want_half)],
            "half_differs": not all(torch.equal(a, b) for a, b in zip(got_half[0], got[0])),
            "half_state": half_state, "overflow": overflow, "refresh_overflow": (skipped, memory_kept),
            "eight": got_eight[:2], "eight_state": eight_state, "eight_then_fresh": [
                all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got_eight[2:], want[2:])],
            "four": got_four[:2], "four_state": four_state, "four_then_fresh": [
                all(torch.equal(a, b) for a, b in zip(g, w)) for g, w in zip(got_four[2:], want[2:])],
            "exact": got[:2]}


def _optimizer(rank):
    import mergecomp.torch as mc
    from mergecomp.scheduler.online import SchedulerConfig

    x, y = make_data()
    out = {}

    def wrapped(model, **options):
        return mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       compression="topk", **options)

    model = make_model()
    out["warmup"] = exact_grads(model, wrapped(model, groups=2, compression_warmup_steps=2), x, y, rank, 3)
    model = make_model()
    opt = wrapped(model, groups=2, uncompressed=["*.bias"])
    out["bias"] = (exact_grads(model, opt, x, y, rank, 3), opt.merged.exempt, opt.plan.codec_names())
    model = make_model()
    out["small"] = exact_grads(model, wrapped(model, groups=2, min_compress_numel=200), x, y, rank, 3)
    model = make_model()
    opt = wrapped(model, groups=2, uncompressed=["*.bias"], compression_warmup_steps=2, compression_warmup_codec="fp16")
    out["half_bias"] = exact_grads(model, opt, x, y, rank, 3)

    # checkpoint inside the warm-up (K=3, saved after step 2), resumed by a fresh optimizer
    model = make_model()
    opt = wrapped(model, groups=2, compression_warmup_steps=3)
    exact_grads(model, opt, x, y, rank, 2)
    buffer = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buffer)
    uninterrupted = exact_grads(model, opt, x, y, rank, 3), flat_params(model)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model = make_model()
    opt = wrapped(model, groups=2, compression_warmup_steps=3)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    resumed = exact_grads(model, opt, x, y, rank, 3), flat_params(model)
    out["resume"] = (uninterrupted[0], resumed[0], torch.equal(uninterrupted[1], resumed[1]))

    # the scheduler: no sample during the warm-up, and the exempt group survives its plans
    xs, ys = shard(x, rank), shard(y, rank)
    config = SchedulerConfig(warmup_steps=1, settle_steps=0, probe_steps=1, candidates=2, runoff_rounds=0)
    model = make_model()
    opt = wrapped(model, scheduler=config, compression_warmup_steps=3, uncompressed=["*.bias"])
    train(model, opt, xs, ys, steps=14)
    report = opt.schedule_report()
    out["scheduler"] = (report["phase"], report["steps"], opt.plan.codec_names(),
                        exact_grads(model, opt, x, y, rank, 1)[0])

    # the DDP hook: warm-up, then exempt parameters (split out of DDP's buckets) stay exact
    model, _ = ddp(make_model(), "topk", compression_warmup_steps=2, uncompressed=["*.bias"],
                   min_compress_numel=200)
    out["ddp"] = [{n for n, e in errors.items() if e == 0} for errors in ddp_errors(model, x, y, rank, 4)]
    # with an fp16 warm-up: its buckets cast (close to the exact average, not equal to it), the
    # exempt biases exact
    model, _ = ddp(make_model(), "topk", compression_warmup_steps=2, compression_warmup_codec="fp16",
                   uncompressed=["*.bias"])
    out["ddp_half"] = [({n for n, e in errors.items() if e == 0}, max(errors.values()) <= 1e-3)  # fp16's rounding
                       for errors in ddp_errors(model, x, y, rank, 2)]

    errors = {}
    for case, options in {"negative": {"compression_warmup_steps": -1},
                          "numel": {"min_compress_numel": -5},
                          "codec": {"compression_warmup_codec": "bf16"}}.items():
        try:
            wrapped(make_model(), **options)
        except ValueError as err:
            errors[case] = str(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(make_model(), groups=1, uncompressed=["*.bias", "*.gamma"])
    errors["unmatched"] = [str(w.message) for w in caught]
    out["errors"] = errors
    return out


def _worker(rank):
    return {"core": _core(rank), **_optimizer(rank)}


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 2)


ALL = {f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")}
BIASES = {"0.bias", "2.bias", "4.bias"}


def test_warmup_steps_are_the_plain_average_then_compression_starts_clean(results):
    for out in results:
        core = out["core"]
        assert core["equal"] == [True] * 5  # = none for 2 steps, then = a fresh DGC run
        assert core["state_after_warmup"] == 0 and all(core["compressed"])
        assert out["warmup"] == [ALL, ALL, set()]


@pytest.mark.parametrize("codec,levels", [("eight", 127), ("four", 7)], ids=["qsgd", "qsgd4"])
def test_a_qsgd_warmup_sends_the_quantized_average_outside_error_feedback(results, codec, levels):
    """Every rank gets the same average, within QSGD's rounding of the exact one (each group is
    one bucket here: one level is its norm / 127 on each rank with ``"qsgd"``, norm / 7 with the
    4-bit ``"qsgd4"``), and compression then starts as fresh as after the exact warm-up."""
    groups = ((3, 2), (1, 0))
    for out in results:
        core = out["core"]
        assert core[f"{codec}_state"] == 0 and core[f"{codec}_then_fresh"] == [True] * 3
        for step, (got, exact) in enumerate(zip(core[codec], core["exact"])):
            grads = [step_grads(rank, step) for rank in range(len(results))]
            for group in groups:
                level = max(float(torch.cat([g[i].flatten() for i in group]).norm()) / levels for g in grads)
                for i in group:
                    assert torch.equal(got[i], results[0]["core"][codec][step][i]), "ranks agree"
                    error = float((got[i] - exact[i]).abs().max())
                    assert 0 < error <= level, (step, i, error, level)
    fine = max(float((a - b).abs().max()) for got, exact in zip(results[0]["core"]["eight"], results[0]["core"]["exact"])
               for a, b in zip(got, exact))
    coarse = max(float((a - b).abs().max()) for got, exact in zip(results[0]["core"]["four"], results[0]["core"]["exact"])
                 for a, b in zip(got, exact))
    assert coarse > fine, "the 4-bit codes round more coarsely"


def test_an_fp16_warmup_sends_the_fp16_average_outside_error_feedback(results):
    for rank, out in enumerate(results):
        core = out["core"]
        assert core["half"] == [True] * 5 and core["half_differs"] and core["half_state"] == 0
        assert "rank 1" in core["overflow"] and "overflowed the 16-bit cast" in core["overflow"]
        assert core["refresh_overflow"] == (True, True), rank  # skipped; the memory kept on every rank
        assert "error feedback" not in core["overflow"]  # the warm-up's payload holds none
        assert out["half_bias"] == [BIASES] * 3  # uncompressed tensors stay exact, the others do not
        assert out["ddp_half"] == [(BIASES, True)] * 2


def test_exempt_parameters_get_the_exact_average_while_the_others_are_compressed(results):
    for out in results:
        exact, exempt, codecs = out["bias"]
        assert exact == [BIASES] * 3
        assert sorted(exempt) == sorted(BIASES) and codecs[-1] == "exempt"
        assert out["small"] == [SMALL] * 3


def test_checkpoint_inside_the_warmup_resumes_across_its_end(results):
    for out in results:
        uninterrupted, resumed, same_params = out["resume"]
        assert uninterrupted == resumed == [ALL, set(), set()] and same_params


def test_the_scheduler_searches_after_the_warmup_and_keeps_the_exempt_group(results):
    for out in results:
        phase, steps, codecs, exact = out["scheduler"]
        assert phase == "monitor" and steps == 14 - 3
        assert codecs[-1] == "exempt" and "exempt" not in codecs[:-1]
        assert BIASES <= exact  # (the search may pick an uncompressed plan for the rest)


def test_ddp_hook_warmup_and_exemptions(results):
    for out in results:
        assert out["ddp"] == [ALL, ALL, SMALL, SMALL]


def test_bad_options_name_the_option(results):
    errors = results[0]["errors"]
    assert "compression_warmup_steps must be an int >= 0, got -1" in errors["negative"]
    assert "min_compress_numel must be an int >= 0, got -5" in errors["numel"]
    assert "compression_warmup_codec must be one of ('none', 'fp16', 'qsgd', 'qsgd4'), got 'bf16'" in errors["codec"]
    assert len(errors["unmatched"]) == 1 and "pattern(s) ['*.gamma'] match none" in errors["unmatched"][0]

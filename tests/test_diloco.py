"""mc.DiLoCo on real gloo ranks: dense DiLoCo and Streaming DiLoCo against the algorithm written
out by hand, compressed DiLoCo keeping every rank equal, resume (also with a fragment's exchange in
flight), NaN/Inf, bad input."""
import copy

import pytest
import torch
from distributed import run_workers

from mergecomp.exchange.plan import WARMUP_QSGD4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(rank, steps):
    data = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data)) for _ in range(steps)]


def inner_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _dense_worker(rank, world, H=3, rounds=4):
    """mergecomp's DiLoCo (dense) and the algorithm by hand (AdamW inner, the pseudo-gradients
    allreduced and averaged, Nesterov SGD outer), from rank-different data."""
    import torch.distributed as dist

    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    with torch.no_grad():  # ranks start apart: DiLoCo starts every rank from rank 0's
        for p in model.parameters():
            p.add_(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H)
    for x, y in data:
        inner_step(model, opt, x, y)
    ours = [p.detach().clone() for p in model.parameters()]

    reference = make_model()
    inner = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    global_params = [p.detach().clone() for p in reference.parameters()]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    for step, (x, y) in enumerate(data, 1):
        inner_step(reference, inner, x, y)
        if step % H == 0:
            for g, p in zip(global_params, reference.parameters()):
                delta = (g - p.detach()).contiguous()
                dist.all_reduce(delta)
                g.grad = delta / world
            outer.step()
            with torch.no_grad():
                for p, g in zip(reference.parameters(), global_params):
                    p.copy_(g)
    theirs = [p.detach() for p in reference.parameters()]
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs)), diloco.state_bytes(), diloco.inner_steps


@pytest.mark.parametrize("world", [2, 3])
def test_dense_diloco_is_the_algorithm(world):
    for gap, state_bytes, steps in run_workers(_dense_worker, world, world, timeout=120):
        assert gap < 1e-5, gap
        params = sum(p.numel() for p in make_model().parameters())
        assert state_bytes == 2 * params * 4, "the global parameters and the outer momentum, fp32"
        assert steps == 12


def _streaming_worker(rank, world, fragments, delay, alpha, H=4, rounds=4):
    """Streaming DiLoCo (dense) against the algorithm by hand: fragment p (consecutive
    parameters) sends global minus local at the steps (p + 1) * H // P modulo H, its outer
    Nesterov step lands ``delay`` inner steps later, and its local parameters become
    alpha * local + (1 - alpha) * global.  ``delay="auto"``: the first round lands at once,
    the later ones after the delay DiLoCo chose (returned third; None before the first round
    is over, fourth)."""
    import torch.distributed as dist

    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, fragments=fragments,
                       fragment_sync_delay=delay, fragment_update_alpha=alpha)
    split = [f.indices for f in diloco.fragments]
    undecided = []
    for x, y in data:
        inner_step(model, opt, x, y)
        undecided.append(diloco.sync_delay is None)
    ours = [p.detach().clone() for p in model.parameters()]
    chosen = diloco.sync_delay
    delay_at = (lambda step: 0 if step <= H else chosen) if delay == "auto" else (lambda step: delay)

    reference = make_model()
    params = list(reference.parameters())
    inner = torch.optim.AdamW(params, lr=1e-2)
    global_params = [p.detach().clone() for p in params]
    outers = [torch.optim.SGD([global_params[i] for i in f], lr=0.7, momentum=0.9, nesterov=True) for f in split]
    sent = {}
    for step, (x, y) in enumerate(data, 1):
        inner_step(reference, inner, x, y)
        for k, f in enumerate(split):
            if step % H == (k + 1) * H // len(split) % H:
                sent[step + delay_at(step)] = k, [(global_params[i] - params[i].detach()).contiguous() for i in f]
        if step in sent:
            k, deltas = sent.pop(step)
            for i, delta in zip(split[k], deltas):
                dist.all_reduce(delta)
                global_params[i].grad = delta / world
            outers[k].step()
            with torch.no_grad():
                for i in split[k]:
                    params[i].mul_(alpha).add_(global_params[i], alpha=1 - alpha)
    theirs = [p.detach() for p in params]
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs)), [len(f) for f in split], chosen, undecided


@pytest.mark.parametrize("world,fragments,delay,alpha", [(2, 2, 0, 0.0), (2, 2, 1, 0.5), (3, 4, 0, 0.0)])
def test_streaming_diloco_is_the_algorithm(world, fragments, delay, alpha):
    for gap, sizes, chosen, _ in run_workers(_streaming_worker, world, world, fragments, delay, alpha, timeout=120):
        assert gap < 1e-5, gap
        assert len(sizes) == fragments and sum(sizes) == 4 and min(sizes) >= 1
        assert chosen == delay


@pytest.mark.parametrize("world", [2, 3])
def test_an_auto_delay_is_timed_on_the_first_round_and_the_same_on_every_rank(world):
    """H = 8, 2 fragments: both fragments' first exchanges (steps 4 and 8) are waited for at once;
    from step 8 on every rank keeps each exchange in flight for the delay chosen, 1 to 3 steps."""
    results = run_workers(_streaming_worker, world, world, 2, "auto", 0.5, 8, 4, timeout=120)
    chosen = {result[2] for result in results}
    assert len(chosen) == 1 and 1 <= chosen.pop() <= 3, results
    for gap, _, _, undecided in results:
        assert gap < 1e-5, gap
        assert undecided == [True] * 7 + [False] * 25


def test_the_auto_delay_covers_the_exchange_with_the_fewest_steps():
    from mergecomp.torch.diloco import covering_delay

    assert covering_delay(0.25, 0.06, 7) == 5
    assert covering_delay(0.24, 0.06, 7) == 4
    assert covering_delay(1e-4, 0.06, 7) == 1, "an exchange that takes no time still overlaps one step"
    assert covering_delay(10.0, 0.06, 7) == 7, "no more than H // P - 1"
    assert covering_delay(0.1, 0.0, 3) == 3


def test_the_codec_for_the_link_is_the_least_lossy_that_fits_the_window():
    from mergecomp.scheduler.fragment_codecs import FIT_SHARE, LADDER, Candidate, choose

    bits = {"none": 32.0, "fp16": 16.0, LADDER[2]: 8.06, LADDER[3]: 4.06}
    ladder = [Candidate(c, bits[c]) for c in LADDER]
    onebit = Candidate("compressed", 1.0)

    def pick(window_s, floor=onebit, own=0.001, latency=0.002):
        """1 M elements on a link of 1e-8 s a bit past a fixed cost; the candidates predicted, in order."""
        asked = []

        def predict(c):
            asked.append(c.codec)
            return own(c) if callable(own) else own, latency + 1e-8 * c.bits * 1e6
        return choose(0.005, [*ladder, floor], predict, window_s), asked
    choice, asked = pick(1.0)
    assert choice["codec"] == "none" and choice["predicted_s"] == pytest.approx(0.323)
    assert asked == list(reversed(LADDER)), "from the fewest bits up"
    assert pick(0.323 / FIT_SHARE)[0]["codec"] == "none", "exactly at the share of the window"
    choice, asked = pick(0.3)
    assert choice["codec"] == "fp16" and asked == list(reversed(LADDER)), "fp32 predicted, not fitting"
    choice, asked = pick(0.12)
    assert choice["codec"] == LADDER[2] and choice["predicted_s"] == pytest.approx(0.0836)
    assert asked == [LADDER[3], LADDER[2], "fp16"], "fp16's collectives overrun: fp32 is not probed"
    choice, asked = pick(0.01)
    assert choice["codec"] == "compressed" and choice["predicted_s"] == 0.005, "nothing fits: the compressor"
    assert asked == [LADDER[3]] and choice["predictions"] == {"compressed": 0.005, LADDER[3]: pytest.approx(0.0436)}
    # a codec whose own work does not fit, where the next one's does, does not end the climb
    choice, asked = pick(0.12, own=lambda c: 0.07 if c.codec == LADDER[3] else 0.001)
    assert choice["codec"] == LADDER[2] and asked[:2] == [LADDER[3], LADDER[2]]
    choice, asked = pick(0.3, floor=Candidate("compressed", 16.0))
    assert choice["codec"] == "compressed" and asked == ["none"], "never fewer bits than the compressor"


def _codecs_worker(rank, world, H=8, rounds=4, pause=0.02):
    """``fragment_codecs="auto"`` with 1-bit SGD, two fragments and the delay chosen: after the
    first round (steps 4 and 8, timed) each fragment's plan takes the codec chosen, the same on
    every rank; the inner steps wait ``pause`` s to leave room for an exchange."""
    import time

    import mergecomp.torch as mc
    from mergecomp.scheduler.fragment_codecs import FIT_SHARE, LADDER

    data = batches(rank, H * rounds)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="onebit", fragments=2,
                       fragment_sync_delay="auto", fragment_codecs="auto")
    undecided = []
    for x, y in data:
        inner_step(model, opt, x, y)
        time.sleep(pause)
        undecided.append(diloco.fragment_codecs is None)
    diloco.sync()
    plans = [f.merged.plan.codec_names() for f in diloco.fragments]
    order = [*LADDER, "compressed"]
    for choice in diloco.codec_choices:  # the least lossy predicted that fits, else the compressor
        predicted = choice["predictions"]
        fits = [c for c in order[:-1] if c in predicted and predicted[c] <= FIT_SHARE * choice["window_s"]]
        assert choice["codec"] == (fits[0] if fits else "compressed"), choice
        assert LADDER[-1] in predicted and choice["probe_s"] > 0, choice
    return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), diloco.fragment_codecs, plans,
            diloco.sync_delay, undecided)


@pytest.mark.parametrize("world", [2, 3])
def test_auto_fragment_codecs_are_chosen_after_the_first_round_the_same_on_every_rank(world):
    results = run_workers(_codecs_worker, world, world, timeout=120)
    params, codecs, plans, delay, undecided = results[0]
    assert len(codecs) == 2 and 1 <= delay <= 3
    assert plans == [(codec,) for codec in codecs]
    assert undecided == [True] * 7 + [False] * 25
    for other in results[1:]:
        assert torch.equal(other[0], params) and other[1:4] == (codecs, plans, delay)


def _codecs_bad_input_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for kwargs in ({"fragment_codecs": "fast"}, {"fragment_codecs": "auto"},
                   {"fragment_codecs": "auto", "fragment_sync_delay": 1, "groups": "auto"},
                   {"fragment_codecs": "auto" if rank else None, "fragment_sync_delay": 1}):
        try:
            mc.DiLoCo(model.named_parameters(), opt, sync_every=4, fragments=2, **kwargs).close()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_auto_fragment_codecs_refuse_what_they_cannot_do_by_name_on_every_rank():
    for unknown, blocking, searched, disagree in run_workers(_codecs_bad_input_worker, 2, timeout=120):
        assert "fragment_codecs must be None or 'auto'" in unknown and "'fast'" in unknown
        assert "fragment_sync_delay >= 1 or 'auto'" in blocking
        assert "groups='auto'" in searched and "give one" in searched
        assert disagree is not None and "fragment_codecs" in disagree, disagree


def _compressed_worker(rank, H=4, rounds=6):
    """Top-k 10 % with its residual memory on the pseudo-gradients: every rank ends with the same
    parameters, the loss falls, the memory holds this rank's residual."""
    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", groups=2)
    x0, y0 = data[0]
    before = float(torch.nn.functional.cross_entropy(model(x0), y0))
    for x, y in data:
        inner_step(model, opt, x, y)
    after = float(torch.nn.functional.cross_entropy(model(x0), y0))
    merged = diloco.fragments[0].merged
    residual = sum(float(t.abs().sum()) for fields in merged.exchange.memory.state_dict().values()
                   for t in fields.values())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), before, after, residual, len(merged.groups)


def test_compressed_diloco_keeps_the_ranks_equal_and_learns():
    out = run_workers(_compressed_worker, 2, timeout=120)
    assert torch.equal(out[0][0], out[1][0])
    for _, before, after, residual, groups in out:
        assert after < before and residual > 0 and groups == 2


def _scaler_worker(rank, H=4, rounds=3):
    """Streaming DiLoCo on 4 ranks with a GradScaler and clipping in the inner steps; rank 1's
    loss is Inf at step 3, so its scaler skips that step there alone."""
    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", fragments=2,
                       fragment_sync_delay=1, grad_scaler=scaler)
    for step, (x, y) in enumerate(data, 1):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss * (float("inf") if rank == 1 and step == 3 else 1.0)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    diloco.sync()
    diloco.close()
    return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), diloco.inner_steps, scaler.get_scale(),
            all(bool(torch.isfinite(p).all()) for p in model.parameters()))


def test_a_grad_scaler_skipping_one_ranks_step_keeps_the_ranks_in_step():
    out = run_workers(_scaler_worker, 4, timeout=120)
    for params, steps, scale, finite in out:
        assert torch.equal(params, out[0][0]) and steps == 12 and finite
    assert [scale for _, _, scale, _ in out] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10]


def _resume_worker(rank, path, H, streaming, saved_at, codec=None):
    """Save after ``saved_at`` inner steps (model, inner optimizer, DiLoCo, torch's RNG state as
    the frameworks' checkpoints hold it), go on to 4 rounds; a fresh run loads the checkpoint and
    goes on the same way.  ``streaming``: two fragments with a delay of one step (``"auto"``:
    chosen, which H = 4 leaves at 1), saved while the first fragment's exchange is in flight.
    ``codec``: the codec ``fragment_codecs="auto"`` takes whatever the link (None: its choice)."""
    import mergecomp.torch as mc
    import mergecomp.torch.diloco as diloco_module

    if codec is not None:
        chosen_by = diloco_module.choose

        def forced(*args):
            return {**chosen_by(*args), "codec": codec}
        diloco_module.choose = forced

    data = batches(rank, 4 * H)
    delay = 1 if streaming is True else "auto"
    streams = {"fragments": 2, "fragment_sync_delay": delay, "fragment_update_alpha": 0.5} if streaming else {}
    if streaming == "codecs":  # fragment_codecs="auto" too, chosen at step 4
        streams["fragment_codecs"] = "auto"

    def build():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", **streams)

    model, opt, diloco = build()
    for x, y in data[:saved_at]:
        inner_step(model, opt, x, y)
    in_flight = diloco.in_flight == 0 or streaming == "auto" and diloco.sync_delay is None
    chosen = diloco.fragment_codecs
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict(),
                           "rng": torch.get_rng_state()})  # QSGD's rounding, if "codecs" chose it, draws from it
    torch.save(saved, f"{path}.{rank}")
    for x, y in data[saved_at:]:
        inner_step(model, opt, x, y)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, diloco = build()
    loaded = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    diloco.load_state_dict(loaded["diloco"])
    torch.set_rng_state(loaded["rng"])
    assert diloco.fragment_codecs == chosen
    assert streaming != "codecs" or [f.merged.plan.codec_names() for f in diloco.fragments] == [(c,) for c in chosen]
    for x, y in data[saved_at:]:
        inner_step(model, opt, x, y)
    return all(torch.equal(a, b) for a, b in zip(straight, model.parameters())), diloco.inner_steps, in_flight


@pytest.mark.parametrize("H,streaming,saved_at,codec", [(3, False, 7, None), (4, True, 6, None), (4, "auto", 6, None),
                                                        (4, "auto", 3, None), (4, "codecs", 6, None),
                                                        (4, "codecs", 6, WARMUP_QSGD4)])
def test_resume_continues_exactly(tmp_path, H, streaming, saved_at, codec):
    """``"auto"`` saved after its choice (step 6: in flight), and before it (step 3: the first
    fragment's exchange timed, the second's not yet); 4-bit QSGD's stochastic rounding, whichever
    codec the link makes ``fragment_codecs="auto"`` choose."""
    for exact, steps, in_flight in run_workers(_resume_worker, 2, str(tmp_path / "ckpt"), H, streaming, saved_at,
                                               codec, timeout=120):
        assert exact and steps == 4 * H and in_flight == bool(streaming)


def _nonfinite_worker(rank, nonfinite):
    """Rank 1's model blows up in the second round: under "skip" every rank goes back to the
    global parameters of round 1 and the next round goes on; under "raise" every rank raises."""
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=2, nonfinite=nonfinite)
    data = batches(rank, 6)
    for x, y in data[:2]:
        inner_step(model, opt, x, y)
    global_after_one = [g.clone() for g in diloco.global_params]
    inner_step(model, opt, *data[2])
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    try:
        inner_step(model, opt, *data[3])
    except FloatingPointError as err:
        return "raised", str(err)
    back = all(torch.equal(p, g) for p, g in zip(model.parameters(), global_after_one))
    for x, y in data[4:]:
        inner_step(model, opt, x, y)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return back, diloco.skipped_steps, finite


def test_a_nonfinite_pseudo_gradient_skips_the_round_on_every_rank():
    for back, skipped, finite in run_workers(_nonfinite_worker, 2, "skip", timeout=120):
        assert back and skipped == 1 and finite
    for raised, message in run_workers(_nonfinite_worker, 2, "raise", timeout=120):
        assert raised == "raised" and "rank 1" in message and "0.weight" in message


def _bad_input_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for kwargs in ({"sync_every": 0}, {"sync_every": 2, "nonfinite": "propagate"}, {"sync_every": 2, "average": False},
                   {"sync_every": 2 + rank}, {"sync_every": 4, "fragments": 5}, {"sync_every": 2, "fragments": 3},
                   {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2},
                   {"sync_every": 4, "fragment_update_alpha": 1.0}, {"sync_every": 4, "fragments": [model[0]]},
                   {"sync_every": 4, "fragments": 2, "fragment_sync_delay": rank},
                   {"sync_every": 3, "fragments": 2, "fragment_sync_delay": "auto"},
                   {"sync_every": 4, "fragment_sync_delay": "soon"}):
        try:
            mc.DiLoCo(model.named_parameters(), opt, **kwargs).close()
            errors.append(None)
        except (ValueError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    return errors


def test_bad_input_is_refused_by_name_on_every_rank():
    for (every, propagate, average, disagree, too_many, more_than_h, delay, alpha, uncovered,
         disagree_delay, auto_without_room, unknown_delay) in run_workers(_bad_input_worker, 2, timeout=120):
        assert "fragment_sync_delay='auto' needs sync_every // fragments >= 2" in auto_without_room
        assert "sync_every=3 with 2 fragment(s)" in auto_without_room
        assert "fragment_sync_delay" in unknown_delay and "'soon'" in unknown_delay
        assert every.startswith("ValueError") and "sync_every" in every
        assert "fragments must be between 1 and the 4 parameters" in too_many
        assert "3 fragments" in more_than_h and "sync_every=2" in more_than_h
        assert "fragment_sync_delay" in delay and "[0, sync_every // fragments = 2)" in delay
        assert "fragment_update_alpha" in alpha
        assert "parameters [2, 3] (by position) are in no fragment" in uncovered
        assert disagree_delay is not None and "fragment_sync_delay" in disagree_delay, disagree_delay
        assert propagate.startswith("ValueError") and "nonfinite" in propagate and "'propagate'" in propagate
        assert average.startswith("TypeError") and "average" in average
        assert disagree is not None and "sync_every" in disagree, disagree


def _save_on_three(rank, path, H=4):
    """Compressed DiLoCo on 3 ranks, saved after two syncs and one more inner step."""
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", groups=2)
    for x, y in batches(rank, 2 * H + 1):
        inner_step(model, opt, x, y)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict()}
    torch.save(state, f"{path}.{rank}")
    return state["diloco"]


def _resume_on_two(rank, path, residuals, H=4):
    """Every rank loads the 3 ranks' DiLoCo states and rank 0's model and optimizer, then trains
    to the next sync."""
    import mergecomp.torch as mc

    saved = [torch.load(f"{path}.{r}", weights_only=False) for r in range(3)]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", groups=2)
    model.load_state_dict(saved[0]["model"])
    opt.load_state_dict(saved[0]["opt"])
    diloco.load_every_rank([state["diloco"] for state in saved], residuals=residuals)
    loaded = diloco.state_dict()
    for x, y in batches(10 + rank, H - 1):
        inner_step(model, opt, x, y)
    return loaded, diloco.inner_steps, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("residuals", ["fold", "drop"])
def test_a_three_rank_checkpoint_resumes_on_two_ranks(tmp_path, residuals):
    """Replicated state (global parameters, outer momentum, steps) from rank 0's; each fragment's
    residual the mean of the 3 ranks' (fold) or none (drop), never one rank's own; the 2 ranks
    equal after the next sync."""
    path = str(tmp_path / "ckpt")
    saved = run_workers(_save_on_three, 3, path, timeout=120)
    out = run_workers(_resume_on_two, 2, path, residuals, timeout=120)
    old = [state["fragments"][0]["mergecomp"]["memory"] for state in saved]
    assert old[0] and not torch.equal(next(iter(next(iter(old[0].values())).values())),
                                      next(iter(next(iter(old[1].values())).values())))
    for loaded, steps, _ in out:
        assert steps == 12
        assert all(torch.equal(a, b) for a, b in zip(loaded["global_params"], saved[0]["global_params"]))
        assert loaded["fragments"][0]["outer_optimizer"]["state"].keys() == \
            saved[0]["fragments"][0]["outer_optimizer"]["state"].keys()
        memory = loaded["fragments"][0]["mergecomp"]["memory"]
        if residuals == "drop":
            assert not memory
            continue
        assert memory.keys() == old[0].keys()
        for group, fields in memory.items():
            for field, value in fields.items():
                each = [m[group][field] for m in old]
                assert not any(torch.equal(value, mine) for mine in each)
                torch.testing.assert_close(value, torch.stack(each).mean(dim=0))
    assert torch.equal(out[0][2], out[1][2])


def test_the_fragment_count_is_the_fewest_behind_the_smallest_delay():
    from mergecomp.scheduler.fragment_codecs import FIT_SHARE
    from mergecomp.scheduler.fragment_count import choose, covering

    step = 0.1 / FIT_SHARE  # 0.1 s of each inner step holds an exchange
    assert covering(0.25, step) == 3 and covering(0.2, step) == 2 and covering(0.0, step) == 1
    assert covering(0.1, 0.0) == float("inf")
    whole = {1: 0.6, 2: 0.31, 3: 0.19, 4: 0.16, 5: 0.13}  # H = 10: room for 9, 4, 2, 1, 1 steps
    choice = choose(whole, step, 10)
    assert (choice["fragments"], choice["delay"], choice["hidden"]) == (3, 2, True), choice
    assert choice["covering"] == {1: 6, 2: 4, 3: 2, 4: 2, 5: 2}
    choice = choose({**whole, 3: 0.21}, step, 10)  # three would need 3 steps of their 2: none hides it
    assert (choice["fragments"], choice["delay"], choice["hidden"]) == (3, 2, False), "the least held up"
    assert choice["wait_s"] == pytest.approx(0.03)
    assert choose({**whole, 1: 0.2}, step, 10)["fragments"] == 3, "one fragment late is not chosen where two fit"
    assert (choose({1: 0.05}, step, 3)["fragments"], choose({1: 0.05}, step, 3)["delay"]) == (1, 1), "H < 4: one"
    assert choose({**whole, 1: 0.25}, step, 10)["fragments"] == 3, "not in 3 of H = 10 steps"
    fast = {p: 0.01 / p for p in whole}
    assert choose(fast, step, 10)["fragments"] == 2 and choose(fast, step, 10)["delay"] == 1, "two hide it at once"
    assert choose({1: 0.6, 2: 0.31, 3: 0.21, 4: 0.1, 5: 0.08}, step, 10)["fragments"] == 4, "delay 1, then fewest"
    choice = choose({**whole, 1: 0.2, 2: 0.09}, step, 10)
    assert (choice["fragments"], choice["delay"]) == (2, 1), "a shorter delay before fewer fragments"
    slow = {p: 5.0 / p for p in whole}
    choice = choose(slow, step, 10)
    assert (choice["fragments"], choice["delay"], choice["hidden"]) == (3, 2, False), "the least held up"
    assert choose(whole, step, 10, delay=4)["fragments"] == 2, "the fewest hidden within the delay given"
    assert choose(whole, step, 10, delay=2)["fragments"] == 3
    choice = choose(whole, step, 10, delay=1)
    assert (choice["fragments"], choice["delay"], choice["hidden"]) == (5, 1, False), "none hides: the smallest waits"


def deep_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)], torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _auto_count_worker(rank, world, H, steer, codecs=False, saved_at=None, path=None):
    """``fragments="auto"`` with the delay chosen, top-k on the pseudo-gradients: the choice at
    step 2, the same on every rank, and the run then exactly DiLoCo with those fragments and
    that delay.  ``steer``: the probe's prediction replaced by the whole model's exchange taking
    that many inner steps' share (the real probe still runs), to make the choice deterministic.
    ``saved_at``: also saved there and resumed by a fresh run, which must end the same."""
    import mergecomp.torch as mc
    import mergecomp.torch.diloco as module

    probe, total = module.exchanges_within, sum(p.numel() for p in deep_model().parameters())

    def steered(comm, compressor, codec, sizes, dtype, device, budget):
        probe(comm, compressor, codec, sizes, dtype, device, budget)
        return {n: (0.0, n / total * steer * budget / module.PROBE_STEPS) for n in sizes}
    data = [(x.repeat(1, 2)[:, :8], y) for x, y in batches(rank, H * 4)]
    extra = {"fragment_codecs": "auto"} if codecs else {}

    def run(build, frm=0, state=None, save=None):
        model = deep_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        diloco = build(model, opt)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
        undecided = []
        for step, (x, y) in enumerate(data[frm:], frm + 1):
            inner_step(model, opt, x, y)
            undecided.append(diloco.fragment_choice == {})
            if step == save:
                torch.save(copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                          "diloco": diloco.state_dict()}), f"{path}.{rank}")
        diloco.sync()  # every rank's parameters the global ones
        diloco.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), diloco, undecided

    if steer:
        module.exchanges_within = steered
    try:
        auto = lambda model, opt: mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk",
                                            fragments="auto", fragment_sync_delay="auto", **extra)
        params, diloco, undecided = run(auto, save=saved_at)
        resumed = run(auto, saved_at, torch.load(f"{path}.{rank}", weights_only=False))[0] if saved_at else None
    finally:
        module.exchanges_within = probe
    count, delay = len(diloco.fragments), diloco.sync_delay
    fixed = run(lambda model, opt: mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk",
                                             fragments=count, fragment_sync_delay=delay))[0]
    return {"params": params, "count": count, "delay": delay, "choice": diloco.fragment_choice,
            "undecided": undecided, "codecs": diloco.fragment_codecs, "codec_choices": diloco.codec_choices,
            "fixed": fixed, "resumed": resumed}


@pytest.mark.parametrize("world", [2, 3])
def test_auto_fragments_are_chosen_at_the_second_step_and_run_as_given_ones(world):
    """Unsteered (whatever this machine's link and steps make of it) on 2 and 3 ranks."""
    from mergecomp.scheduler.fragment_count import choose

    results = run_workers(_auto_count_worker, world, world, 8, None, timeout=120)
    first = results[0]
    choice = first["choice"]
    assert first["undecided"] == [True] + [False] * 31
    assert torch.equal(first["params"], first["fixed"]), "after the choice: DiLoCo with those fragments and delay"
    assert set(choice["exchange_s"]) == {1, 2, 3, 4} and choice["step_s"] > 0 and choice["probe_s"] > 0
    again = choose(choice["exchange_s"], choice["step_s"], 8)
    assert (again["fragments"], again["delay"]) == (first["count"], first["delay"]) == (choice["fragments"],
                                                                                       choice["delay"])
    for other in results[1:]:
        assert torch.equal(other["params"], first["params"])
        assert {**other["choice"], "probe_s": 0} == {**choice, "probe_s": 0}, "the same on every rank but its clock"


def test_auto_fragments_steered_to_a_slow_link_split_the_model():
    """The whole model's exchange predicted at 3.5 inner steps' share: one fragment would wait 4
    steps, more than a quarter of H = 8, two 2 (room for 2), three and four 2 (room for 1): two
    fragments, 2 steps late."""
    for result in run_workers(_auto_count_worker, 2, 2, 8, 3.5, timeout=120):
        choice = result["choice"]
        assert (result["count"], result["delay"]) == (2, 2) and choice["hidden"]
        assert choice["covering"] == {1: 4, 2: 2, 3: 2, 4: 2}
        assert torch.equal(result["params"], result["fixed"])


@pytest.mark.parametrize("saved_at", [1, 5])
def test_auto_fragments_resume_exactly_before_and_after_the_choice(tmp_path, saved_at):
    """Saved at step 1 (before the choice: the resumed run chooses at its second step, steered
    alike) and at step 5 (two fragments chosen, the first's exchange in flight)."""
    for result in run_workers(_auto_count_worker, 2, 2, 8, 3.5, False, saved_at, str(tmp_path / "ckpt"),
                              timeout=120):
        assert result["count"] == 2 and torch.equal(result["params"], result["resumed"])


def test_auto_fragments_fit_the_codecs_into_the_delay_chosen():
    """With ``fragment_codecs="auto"`` too: each fragment's codec is chosen for the delay chosen
    (2 of H = 8 inner steps), the same on every rank, and the delay is what the codecs'
    predicted exchanges need where that is fewer steps."""
    from mergecomp.scheduler.fragment_count import covering

    results = run_workers(_auto_count_worker, 2, 2, 8, 3.5, True, timeout=120)
    first = results[0]
    step = first["choice"]["step_s"]
    assert first["count"] == 2 and len(first["codecs"]) == 2 and len(first["codec_choices"]) == 2
    assert all(c["window_s"] == 2 * step for c in first["codec_choices"])
    assert first["delay"] == min(2, covering(max(c["predicted_s"] for c in first["codec_choices"]), step))
    for other in results[1:]:
        assert torch.equal(other["params"], first["params"])
        assert (other["codecs"], other["delay"]) == (first["codecs"], first["delay"])


def _auto_count_bad_input_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for kwargs in ({"fragments": "auto"}, {"fragments": "many"}, {"fragments": "auto", "fragment_sync_delay": 4},
                   {"fragments": "auto" if rank else 2, "fragment_sync_delay": 1}):
        try:
            mc.DiLoCo(model.named_parameters(), opt, sync_every=4, **kwargs).close()
            errors.append(None)
        except (ValueError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    return errors


def test_auto_fragments_refuse_what_they_cannot_do_by_name_on_every_rank():
    for blocking, unknown, too_late, disagree in run_workers(_auto_count_bad_input_worker, 2, timeout=120):
        assert "fragments='auto'" in blocking and "fragment_sync_delay >= 1 or 'auto'" in blocking
        assert unknown.startswith("TypeError") and "'many'" in unknown and "'auto'" in unknown
        assert "fragment_sync_delay" in too_late and "[0, sync_every // fragments = 4)" in too_late
        assert disagree is not None and "fragments" in disagree, disagree

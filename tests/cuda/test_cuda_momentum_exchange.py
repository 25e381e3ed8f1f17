"""Adam's momentum exchange (``exchange_momentum_after``) on CUDA, two processes sharing one GPU
through gloo: the lossless run equals the one-process reference of the algorithm computed on the
GPU; every averaging compressor, with the fp16 warm-up and variance refreshes, keeps the ranks
identical and learns; ``GradScaler("cuda")``'s overflow on one rank skips the step everywhere.
The workers are ``tests/test_momentum_exchange.py``'s, given the device."""
import math

import pytest
import torch
from cuda_support import DEVICE
from distributed import run_workers
from test_momentum_exchange import (AVERAGING, STEPS, _compressor_worker, _lossless_worker, _scaler_worker,
                                    reference)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("refresh", [None, 2])
def test_lossless_equals_the_one_process_reference_on_the_gpu(refresh):
    expected = reference(2, STEPS, "AdamW", refresh=refresh, device=DEVICE)
    without_freeze = reference(2, STEPS, "AdamW", after=STEPS, device=DEVICE)  # the test can fail
    assert (expected - without_freeze).abs().max() > 1e-4
    for params, active in run_workers(_lossless_worker, 2, 2, "AdamW", 2, refresh, False, False, "cuda",
                                      timeout=300):
        assert active
        torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)


def test_every_averaging_compressor_keeps_ranks_identical_and_learns_on_the_gpu():
    for result in run_workers(_compressor_worker, 2, AVERAGING, None, 3, 2, "cuda", "fp16", timeout=300):
        for name, (identical, before, after, _) in result.items():
            assert identical, name
            assert math.isfinite(after) and after < before, (name, before, after)


def test_grad_scaler_skips_an_overflow_everywhere_on_the_gpu():
    for (plain, plain_updates, _), (scaled, scaled_updates, scale) in run_workers(_scaler_worker, 2, 1, "cuda",
                                                                                   timeout=300):
        assert scaled_updates == plain_updates == STEPS  # one step more, one skipped
        assert scale == 2.0 ** 9
        assert torch.equal(scaled, plain)

"""``mc.SyncBatchNorm``: batch normalisation whose training statistics cover every rank's batch,
on any engine and device (``torch.nn.SyncBatchNorm`` needs a torch.distributed group and
refuses CPU tensors in training mode)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mergecomp.horovod_api.arguments import Sum
from mergecomp.horovod_api.collectives import allreduce
from mergecomp.horovod_api.runtime import communicator, is_initialized

__all__ = ["SyncBatchNorm"]


class _SumOverRanks(torch.autograd.Function):
    """The sum over ranks; its gradient is the sum over ranks of the gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, what: str) -> torch.Tensor:
        ctx.what = what
        return allreduce(tensor, op=Sum, name=f"SyncBatchNorm {what}")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return allreduce(grad, op=Sum, name=f"SyncBatchNorm gradient of the {ctx.what}"), None


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Batch normalisation over the ``(N, C, ...)`` inputs of all ranks together (training mode).

    Two allreduces per forward (per channel: count and sum, then the sum of squared deviations
    from the global mean, so the variance does not cancel for inputs with a large mean) and two
    per backward.  In eval mode, or on one rank, it is plain batch normalisation.  Every rank
    must run each layer's forward and backward the same number of times.  ``process_group`` is
    not supported (all ranks).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects a (N, C, ...) input, got {input.dim()}-D")
        if self.process_group is not None:
            raise NotImplementedError("mc.SyncBatchNorm normalises over all ranks; process_group must be None")
        shared = self.training and is_initialized() and communicator().size > 1
        if not shared:
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch, self._momentum(), self.eps)
        dims = [0, *range(2, input.dim())]
        channels = input.shape[1]
        count = input.new_full((1,), input.numel() / channels)
        totals = _SumOverRanks.apply(torch.cat([count, input.sum(dims)]), "count and sum")
        n = totals[0]
        shape = [1, channels] + [1] * (input.dim() - 2)
        centered = input - (totals[1:] / n).view(shape)
        var = _SumOverRanks.apply(centered.square().sum(dims), "squared deviations") / n
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self._momentum()
                self.running_mean.lerp_(totals[1:] / n, momentum)
                self.running_var.lerp_(var * n / (n - 1).clamp_min(1), momentum)
        out = centered * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _momentum(self) -> float:
        """The running statistics' update weight (``momentum=None``: a cumulative average)."""
        if self.momentum is not None:
            return self.momentum
        return 1.0 / max(float(self.num_batches_tracked), 1.0)

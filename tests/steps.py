"""Building merged steps in tests: the options by keyword, as the front ends take them."""
import torch

from mergecomp.pipeline.buckets import BucketStep
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.planned import PlannedStep

FRONT_END = {"observe_order", "timed", "hand_out"}


def _split(kwargs):
    options = {k: v for k, v in kwargs.items() if k not in FRONT_END}
    return StepOptions(**options), FrontEnd(**{k: v for k, v in kwargs.items() if k in FRONT_END})


def planned(compression, memory, comm, names, shapes, dtypes, device=torch.device("cpu"), **kwargs) -> PlannedStep:
    """A :class:`PlannedStep`; ``kwargs``: :class:`StepOptions` and ``observe_order``, ``timed``, ``hand_out``."""
    return PlannedStep(compression, memory, comm, names, shapes, dtypes, device, *_split(kwargs))


def buckets(compression, memory, comm, names, shapes, dtypes, device=torch.device("cpu"), **kwargs) -> BucketStep:
    """A :class:`BucketStep`; ``kwargs`` as for :func:`planned`."""
    return BucketStep(compression, memory, comm, names, shapes, dtypes, device, *_split(kwargs))

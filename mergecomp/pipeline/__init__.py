"""The step pipeline: one training step of merged groups, from each gradient's arrival to the
reduced result (:mod:`.step`; groups from a merge plan, :mod:`.planned`, or from DDP's buckets,
:mod:`.buckets`), the options every front end shares (:mod:`.options`), the ranks' NaN/Inf
agreement (:mod:`.nonfinite`) and their agreement on how they were built (:mod:`.agreement`)."""

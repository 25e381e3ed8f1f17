"""The step pipeline: one training step of merged groups, from each gradient's arrival to the
reduced result (:mod:`.step`), and one group's trip through check, error feedback and
compression (:mod:`.exchange`); merge plans, the NaN/Inf agreement, timings, rank agreement."""

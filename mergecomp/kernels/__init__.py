"""Kernels and data layouts: the fused C++ codecs and their plain-torch twins (:mod:`.codecs`,
:mod:`.native`), bit packing, quantization helpers, payload bytes on the wire, and scratch
buffers recycled from step to step."""

"""What the compressors build on: the compressor and memory interfaces, per-group state, and the
bases of the compressor families (casts, sign codes with two values, sparsifiers)."""

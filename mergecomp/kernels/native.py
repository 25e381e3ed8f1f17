"""Fused CPU kernels for the codecs, compiled on first use: the build, the loading and thin
checked bindings.  The codecs call them through :mod:`mergecomp.kernels.codecs`, which runs each kernel
or its eager torch version beside it.

The eager torch versions of QSGD, TernGrad, 1-bit SGD, EF-SignSGD, signSGD/Signum (and their
majority vote) and the top-k threshold selection make two to eight passes over a merged group,
and the quantizers draw random numbers from torch's CPU generator (~3.5 ns a draw); the kernels
in ``csrc/codecs.cpp`` make one pass each and hash a counter instead.  They are compiled with
the system C++ compiler into ``~/.cache/mergecomp/native`` (``MERGECOMP_CACHE`` overrides the
root) the first time a codec asks for them (about 4 s, once per machine and source version)
and loaded with ``ctypes``; calls release the GIL.

They serve contiguous fp32 CPU tensors only; every other tensor (CUDA, fp16, bf16, fp64) takes
the eager path, which stays the reference.  ``MERGECOMP_NATIVE=0`` turns the kernels off, as
does a failed build (one warning, then the eager path).  Payload layouts are identical on both
paths; the random draws differ, so the two paths give different (equally unbiased) roundings.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch

from mergecomp.kernels.bitpack import packed_size
from mergecomp.kernels.tritpack import packed_size as trit_bytes

__all__ = ["usable", "disabled", "stochastic_codes", "qsgd_encode", "scale_levels", "decode_codes",
           "pack_signs", "compensated_signs", "CompensatedSignParts", "MomentumSignParts", "sign_residual",
           "momentum_signs", "majority_vote", "codes_sum", "trits_sum", "stochastic_trits", "levels_sum",
           "indices_above", "compensated_above", "keep_largest", "with_first_zeros", "sampled_threshold", "moments",
           "copy_finite",
           "cast_half_finite", "zero_fill", "low_rank", "momentum_to_wire_segments", "momentum_from_wire_segments",
           "frozen_adam_segments"]

_SOURCE = Path(__file__).with_name("csrc") / "codecs.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread"]
_ABI_VERSION = 36
#: largest bucket :func:`qsgd_encode` reads from cache the second time (the kernels' BLOCK)
CACHED_BUCKET = 1 << 15
#: outputs of at least this many elements are written with non-temporal stores (STREAM_MIN)
STREAM_MIN = 1 << 20

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_state = "unloaded"  # -> "loaded" | "failed"
_off = 0  # depth of `disabled()` contexts


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _library_path(compiler: str) -> Path:
    """Cache path keyed by source, flags, compiler and CPU (``-march=native``)."""
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    key.update(" ".join([compiler] + _FLAGS).encode())
    key.update(platform.machine().encode())
    with contextlib.suppress(OSError):
        key.update(next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")), "").encode())
    root = Path(os.environ.get("MERGECOMP_CACHE", Path.home() / ".cache" / "mergecomp"))
    return root / "native" / f"codecs-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks building at once never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)


_P, _I64, _F32, _U64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64, ctypes.c_int
#: every kernel of csrc/codecs.cpp: (argument types, return type)
_SIGNATURES = {
    "mc_abi_version": ([], _I32),
    "mc_stochastic_codes": ([_P, _I64, _P, _I64, _F32, _F32, _F32, _U64, _I32, _P, _I32], None),
    "mc_stochastic_trits": ([_P, _I64, _P, _I64, _F32, _F32, _F32, _U64, _P, _I32], None),
    "mc_qsgd_encode": ([_P, _I64, _I64, _I32, _U64, _I32, _P, _P, _I32], None),
    "mc_pack_signs": ([_P, _I64, _P, _P, _I32], None),
    "mc_compensated_signs": ([_P, _P, _F32, _F32, _P, _I64, _P, _P, _I32], None),
    "mc_compensated_signs_part": ([_P, _P, _F32, _F32, _P, _I64, _I64, _P, _P, _I32, _I32, _I32], _I32),
    "mc_sign_residual": ([_P, _I64, _F32, _F32, _P, _I32], None),
    "mc_momentum_signs": ([_P, _P, _F32, _I64, _P, _P, _I32], None),
    "mc_momentum_signs_part": ([_P, _P, _F32, _P, _I64, _I64, _P, _P, _I32, _I32], _I32),
    "mc_moments": ([_P, _I64, _P, _I32], None),
    "mc_majority_vote": ([_P, _I32, _I64, _P, _I32], None),
    "mc_codes_sum": ([_P, _I32, _P, _I32, _I64, _F32, _P, _I32], None),
    "mc_trits_sum": ([_P, _P, _I32, _I64, _F32, _P, _I32], None),
    "mc_levels_sum": ([_P, _I32, _I64, _I32, _F32, _P, _I64, _I64, _F32, _P, _I32], None),
    "mc_indices_above": ([_P, _I64, _F32, _P, _I64, _I32], _I64),
    "mc_compensated_above": ([_P, _P, _P, _F32, _P, _I64, _F32, _P, _P, _P, _P, _I64, _P, _P, _I32], _I64),
    "mc_keep_largest": ([_P, _P, _P, _I64, _I64, _P, _P], None),
    "mc_with_first_zeros": ([_P, _P, _I64, _I64, _P, _P, _P], None),
    "mc_sampled_threshold": ([_P, _P, _I64, _I64, _I64], _F32),
    "mc_copy_finite": ([_P, _P, _I64, _F32, _I32, _I32], _I32),
    "mc_cast_half_finite": ([_P, _P, _I64, _I32], _I32),
    "mc_zero_fill": ([_P, _I64, _I32], None),
    "mc_low_rank": ([_P, _P, _I64, _I64, _I64, _I32, _P, _P, _I64, _I32, _I32], None),
    "mc_momentum_to_wire_segments": ([_P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I32, _I32], _I32),
    "mc_momentum_from_wire_segments": ([_P, _P, _P, _P, _I64, _P, _P, _P, _P, _I32, _I32], None),
    "mc_frozen_adam_segments": ([_P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I32], None),
    "mc_use_openmp": ([_P, _P, _P], None),
}
#: OpenMP runtimes torch may run its operators on (GNU, LLVM, Intel: each has GOMP_parallel)
_OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so")


def _share_openmp(lib: ctypes.CDLL) -> None:
    """Points the kernels at the OpenMP runtime already loaded in the process (torch's), so
    their threads are torch's workers, not extra threads beside them; none: threads of their own."""
    for name in _OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            entries = [ctypes.cast(getattr(runtime, symbol), ctypes.c_void_p)
                       for symbol in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")]
        except (OSError, AttributeError):
            continue
        lib.mc_use_openmp(*entries)
        return


def _declare(lib: ctypes.CDLL) -> None:
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _state
    with _lock:
        if _state != "unloaded":
            return _lib
        _state = "failed"
        if os.environ.get("MERGECOMP_NATIVE", "1") == "0" or sys.platform == "win32":
            return None
        compiler = _compiler()
        if compiler is None:
            warnings.warn("mergecomp: no C++ compiler found; the codecs use their (slower) eager "
                          "torch path", RuntimeWarning, stacklevel=3)
            return None
        try:
            target = _library_path(compiler)
            if not target.exists():
                _build(compiler, target)
            lib = ctypes.CDLL(str(target))
            _declare(lib)
            if lib.mc_abi_version() != _ABI_VERSION:
                raise RuntimeError(f"{target} has ABI {lib.mc_abi_version()}, expected {_ABI_VERSION}")
            _share_openmp(lib)
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            warnings.warn(f"mergecomp: building the native codec kernels failed, the codecs use "
                          f"their (slower) eager torch path: {error}", RuntimeWarning, stacklevel=3)
            return None
        _lib, _state = lib, "loaded"
        return lib


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels are on and every tensor is a contiguous CPU tensor, fp32 where it
    is floating point (codes and levels may be any integer type)."""
    if _off:
        return False
    for t in tensors:  # a plain loop over cheap attributes: called per tensor on the hot path
        if not (t.is_cpu and t.is_contiguous() and (t.dtype is torch.float32 or not t.is_floating_point())):
            return False
    return _loaded() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block every codec takes its eager torch path (for tests and comparisons)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _loaded() -> Optional[ctypes.CDLL]:
    """The library, loading (or building) it the first time; None when unavailable."""
    return _lib if _state == "loaded" else _load()  # no lock once loaded


def _library() -> ctypes.CDLL:
    lib = _loaded()
    if lib is None:
        raise RuntimeError("mergecomp's native codec kernels are not available (see usable())")
    return lib


def _threads() -> int:
    return torch.get_num_threads()


def _buf(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int) -> int:
    """The address of ``t`` after checking that a kernel may read or write ``numel`` elements
    of ``dtype`` there (a wrong buffer raises here instead of corrupting memory)."""
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"native kernel argument {name!r}: need a contiguous CPU {dtype} tensor of at "
                         f"least {numel} elements, got {t.dtype} {tuple(t.shape)} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t.data_ptr()


def _streams(name: str, streams: Sequence[torch.Tensor], dtype: torch.dtype,
             numel: Union[int, Sequence[int]]) -> ctypes.Array:
    """A C array of the addresses of several tensors (ranks' code streams, a group's parameters)
    of ``numel`` ``dtype`` each (or ``numel[i]`` for the ``i``-th), each checked as argument
    ``name[i]``."""
    numels = [numel] * len(streams) if isinstance(numel, int) else numel
    return (ctypes.c_void_p * len(streams))(*[_buf(f"{name}[{i}]", t, dtype, count)
                                              for i, (t, count) in enumerate(zip(streams, numels))])


def _per_bucket(n: int, bucket: int) -> int:
    return -(-n // bucket)


def _seed() -> int:
    """A 63-bit seed from torch's CPU generator, so ``torch.manual_seed`` makes runs repeatable."""
    return int(torch.empty((), dtype=torch.int64).random_())


def stochastic_codes(x: torch.Tensor, scales: torch.Tensor, bucket: int, lo: float, hi: float,
                     shift: int, bits: int, out: torch.Tensor) -> torch.Tensor:
    """``floor(clamp(x * scales[i // bucket], lo, hi) + u) + shift`` per element, ``u`` uniform
    in (0, 1) (16-bit resolution): int8 codes into ``out`` (``numel`` int8) for ``bits == 8``,
    else packed ``bits``-bit codes as :func:`mergecomp.kernels.bitpack.pack` lays them out (``out``:
    ``packed_size`` uint8; the codes must lie in ``[0, 2 ** bits)``).  ``scales``: fp32, one
    per bucket of ``bucket`` elements.  Returns ``out``."""
    n, bucket = x.numel(), max(int(bucket), 1)
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"stochastic_codes: bits must be 1, 2, 4 or 8, got {bits}")
    scales = scales.to(torch.float32).contiguous()
    _library().mc_stochastic_codes(_buf("x", x, torch.float32, n), n,
                                   _buf("scales", scales, torch.float32, _per_bucket(n, bucket)), bucket,
                                   lo, hi, float(shift), _seed(), bits,
                                   _buf("out", out, *_code_layout(n, bits)), _threads())
    return out


def stochastic_trits(x: torch.Tensor, scales: torch.Tensor, bucket: int, lo: float, hi: float, shift: int,
                     out: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_codes`' codes, which must lie in ``{0, 1, 2}``, packed five to a byte in
    base 3 as :func:`mergecomp.kernels.tritpack.pack` lays them out (``out``: ``ceil(n / 5)``
    uint8), from the same draws.  Returns ``out``."""
    n, bucket = x.numel(), max(int(bucket), 1)
    scales = scales.to(torch.float32).contiguous()
    _library().mc_stochastic_trits(_buf("x", x, torch.float32, n), n,
                                   _buf("scales", scales, torch.float32, _per_bucket(n, bucket)), bucket,
                                   lo, hi, float(shift), _seed(), _buf("out", out, torch.uint8, trit_bytes(n)),
                                   _threads())
    return out


def qsgd_encode(x: torch.Tensor, bucket: int, levels: int, bits: int, out: torch.Tensor,
                norms: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """QSGD's encode in one pass: ``norms`` (fp32, one per bucket of ``bucket`` elements) gets
    each bucket's L2 norm and ``out`` the levels ``l = floor(levels * x / norm + u)`` (0 in a
    bucket whose norm is 0), ``u`` as in :func:`stochastic_codes`: ``numel`` int8 for
    ``bits == 8``; for ``bits == 4`` (``levels <= 7``) the codes ``l + levels`` packed two to a
    byte as :func:`mergecomp.kernels.bitpack.pack` does (``ceil(numel / 2)`` uint8).  Returns
    ``(out, norms)``."""
    n, bucket = x.numel(), max(int(bucket), 1)
    if not 1 <= int(levels) <= (127 if bits == 8 else 7) or bits not in (4, 8):
        raise ValueError(f"qsgd_encode: levels must be in [1, 127] at 8 bits or [1, 7] at 4 bits, "
                         f"got {levels} at {bits}")
    _library().mc_qsgd_encode(_buf("x", x, torch.float32, n), n, bucket, int(levels), _seed(), bits,
                              _buf("out", out, *_code_layout(n, bits)),
                              _buf("norms", norms, torch.float32, _per_bucket(n, bucket)), _threads())
    return out, norms


def scale_levels(codes: torch.Tensor, steps: torch.Tensor, bucket: int, bits: int, shift: int,
                 out: torch.Tensor) -> torch.Tensor:
    """``out[i] = (code[i] - shift) * steps[i // bucket]`` for the ``out.numel()`` codes: int8
    for ``bits == 8``, packed 4-bit codes (uint8) for ``bits == 4``; fp32 steps and ``out``
    (:func:`levels_sum` of one rank)."""
    return levels_sum([codes], [steps], bucket, bits, shift, 1, out)


def _code_layout(n: int, bits: int) -> Tuple[torch.dtype, int]:
    """dtype and numel of ``n`` codes of ``bits`` bits (8: int8; 1, 2, 4: packed uint8)."""
    return (torch.int8, n) if bits == 8 else (torch.uint8, packed_size(n, bits))


def decode_codes(packed: torch.Tensor, bits: int, n: int, values: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """``values[code]`` for the ``n`` packed ``bits``-bit codes, into ``out`` (``n`` fp32):
    :func:`mergecomp.kernels.bitpack.decode` in one threaded pass (:func:`codes_sum` of one rank)."""
    if bits not in (1, 2, 4):
        raise ValueError(f"decode_codes: bits must be 1, 2 or 4, got {bits}")
    return codes_sum([packed], bits, values.reshape(1, -1), n, 1, out)


def pack_signs(x: torch.Tensor, out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sign bits ``x >= 0`` packed into ``out`` (``ceil(n / 8)`` uint8) and, from the same
    pass, the fp64 tensor ``[sum of the x >= 0, sum of the x < 0, count(x >= 0)]``."""
    n = x.numel()
    stats = torch.empty(3, dtype=torch.float64)
    _library().mc_pack_signs(_buf("x", x, torch.float32, n), n, _buf("out", out, *_code_layout(n, 1)),
                             stats.data_ptr(), _threads())
    return out, stats


def compensated_signs(x: torch.Tensor, r: Optional[torch.Tensor], negative: float, positive: float,
                      keep: Optional[torch.Tensor], out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_signs` of ``v = x + (r - (positive where r >= 0, else negative))``, each step
    rounded to fp32 (``r`` None: ``v = x``; with ``negative = positive = 0``: ``x + r``), reading
    ``x`` and ``r`` once; ``keep`` (may be None, may be ``r``) receives ``v``.  All fp32 of ``x``'s
    numel."""
    n = x.numel()
    stats = torch.empty(3, dtype=torch.float64)
    _library().mc_compensated_signs(_buf("x", x, torch.float32, n), None if r is None else _buf("r", r, torch.float32, n),
                                    negative, positive, None if keep is None else _buf("keep", keep, torch.float32, n),
                                    n, _buf("out", out, *_code_layout(n, 1)), stats.data_ptr(), _threads())
    return out, stats


class _SignParts:
    """What the part-by-part sign kernels share: a group of ``n`` elements whose packed signs go
    to ``out`` and whose parts' stats to the rows of ``stats`` (fp64, ``(parts, 3)``), checked
    here once; each call checks its part's bounds and gradient."""

    def __init__(self, n: int, out: torch.Tensor, stats: torch.Tensor) -> None:
        if stats.dim() != 2 or stats.shape[1] != 3:
            raise ValueError(f"native kernel argument 'stats': need (parts, 3), got {tuple(stats.shape)}")
        self._numel, self._parts = n, stats.shape[0]
        self._out = _buf("out", out, *_code_layout(n, 1))
        self._stats = _buf("stats", stats, torch.float64, stats.numel())
        self._threads = _threads()

    def _part(self, part: int, at: int, x: torch.Tensor) -> Tuple[int, int, int]:
        """``(address of x, its numel, address of row part)`` once the part is checked."""
        n = x.numel()
        if not (0 <= part < self._parts and 0 <= at and at + n <= self._numel):
            raise ValueError(f"native kernel part {part}: elements [{at}, {at + n}) or its row are outside the "
                             f"group's {self._numel} elements and {self._parts} rows")
        return _buf("x", x, torch.float32, n), n, self._stats + 24 * part


class CompensatedSignParts(_SignParts):
    """:func:`compensated_signs` of one group of ``n`` elements, part by part as its gradients
    arrive: ``r`` (None: no residual) and ``keep`` (fp32, may be ``r``; None: ``v`` is not kept)
    hold the group's elements, ``out`` receives its packed signs and ``stats`` (fp64,
    ``(parts, 3)``) a row of sums per part.  ``stream``: ``keep`` is written past the cache.
    ``sums`` False (no ``r``, no ``keep``: signSGD's bits): the rows only tell whether the part
    is finite (``[0 or NaN, 0, 0]``), which skips the side sums' work."""

    def __init__(self, n: int, r: Optional[torch.Tensor], negative: float, positive: float,
                 keep: Optional[torch.Tensor], out: torch.Tensor, stats: torch.Tensor, stream: bool = False,
                 sums: bool = True) -> None:
        super().__init__(n, out, stats)
        if not sums and (r is not None or keep is not None):
            raise ValueError("native kernel CompensatedSignParts: sums=False is for the bits of x alone "
                             "(no r, no keep)")
        self._r = None if r is None else _buf("r", r, torch.float32, n)
        self._keep = None if keep is None else _buf("keep", keep, torch.float32, n)
        self._sides = (float(negative), float(positive))
        self._stream, self._side_sums = int(stream), int(sums)
        self._kernel = _library().mc_compensated_signs_part
        self._buffers = (r, keep, out, stats)  # alive while their addresses are in use

    def __call__(self, part: int, at: int, x: torch.Tensor) -> bool:
        """Code the group's elements ``[at, at + x.numel())`` from ``x`` (contiguous fp32, read
        flat) as part ``part``: their bits at those bits of ``out`` (the bits of other elements
        left as they are), their sums in row ``part``.  Returns whether the sums are finite (NaN
        or Inf in ``v`` makes them not)."""
        address, n, row = self._part(part, at, x)
        offset = 4 * at
        return bool(self._kernel(address, None if self._r is None else self._r + offset, *self._sides,
                                 None if self._keep is None else self._keep + offset, at, n, self._out, row,
                                 self._stream, self._side_sums, self._threads))


class MomentumSignParts(_SignParts):
    """Signum's step of one group of ``n`` elements, part by part as its gradients arrive: the
    new momentum ``keep = momentum + weight * (x - momentum)`` (fp32; ``keep`` may be
    ``momentum``) and its sign bits into ``out``; each part's row of ``stats`` only tells whether
    its new momentum is finite (``[0 or NaN, 0, 0]``).  ``stream``: ``keep`` is written past the
    cache."""

    def __init__(self, n: int, momentum: torch.Tensor, weight: float, keep: torch.Tensor, out: torch.Tensor,
                 stats: torch.Tensor, stream: bool = False) -> None:
        super().__init__(n, out, stats)
        self._momentum = _buf("momentum", momentum, torch.float32, n)
        self._keep = _buf("keep", keep, torch.float32, n)
        self._weight, self._stream = float(weight), int(stream)
        self._kernel = _library().mc_momentum_signs_part
        self._buffers = (momentum, keep, out, stats)  # alive while their addresses are in use

    def __call__(self, part: int, at: int, x: torch.Tensor) -> bool:
        """Step the group's elements ``[at, at + x.numel())`` with ``x`` (contiguous fp32, read
        flat) as part ``part``; returns whether their new momentum is finite."""
        address, n, row = self._part(part, at, x)
        offset = 4 * at
        return bool(self._kernel(address, self._momentum + offset, self._weight, self._keep + offset, at, n,
                                 self._out, row, self._stream, self._threads))


def sign_residual(v: torch.Tensor, negative: float, positive: float, out: torch.Tensor) -> torch.Tensor:
    """``out = v - (positive where v >= 0, else negative)`` in one pass; ``out`` (fp32, ``v``'s
    numel) may be ``v``.  Returns ``out``."""
    n = v.numel()
    _library().mc_sign_residual(_buf("v", v, torch.float32, n), n, negative, positive,
                                _buf("out", out, torch.float32, n), _threads())
    return out


def momentum_signs(x: torch.Tensor, momentum: torch.Tensor, beta: float,
                   out: torch.Tensor) -> torch.Tensor:
    """Signum's step in one pass: ``momentum = beta * momentum + (1 - beta) * x`` (in place,
    fp32 like ``x``), and its sign bits packed into ``out`` as :func:`pack_signs`.  Returns
    ``out``."""
    n = x.numel()
    stats = torch.empty(3, dtype=torch.float64)
    _library().mc_momentum_signs(_buf("x", x, torch.float32, n), _buf("momentum", momentum, torch.float32, n),
                                 1.0 - beta, n, _buf("out", out, *_code_layout(n, 1)),
                                 stats.data_ptr(), _threads())
    return out


#: most voters :func:`majority_vote` counts (one byte per element)
MAX_VOTERS = 255


def majority_vote(packed: Sequence[torch.Tensor], n: int, out: torch.Tensor) -> torch.Tensor:
    """The majority vote of the ``n`` sign bits in each of ``packed`` (contiguous uint8 CPU
    tensors as :func:`pack_signs` writes them, at most :data:`MAX_VOTERS`) into ``out`` (``n``
    fp32): +1, -1, or 0 on a tie.  Returns ``out``."""
    if not 1 <= len(packed) <= MAX_VOTERS:
        raise ValueError(f"majority_vote counts 1 to {MAX_VOTERS} voters, got {len(packed)}")
    _library().mc_majority_vote(_streams("packed", packed, *_code_layout(n, 1)), len(packed), n,
                                _buf("out", out, torch.float32, n), _threads())
    return out


def codes_sum(packed: Sequence[torch.Tensor], bits: int, values: torch.Tensor, n: int, divisor: float,
              out: torch.Tensor) -> torch.Tensor:
    """``out = (sum_r values[r, code_r]) / divisor``: rank ``r``'s ``n`` packed ``bits``-bit codes
    (1, 2 or 4; ``packed[r]``, laid out as :func:`mergecomp.kernels.bitpack.pack` does) decoded through
    its own ``values[r]`` (``2 ** bits`` of them), summed in rank order in one pass.  Returns
    ``out``."""
    values = values.to(torch.float32).contiguous()
    if not packed or bits not in (1, 2, 4) or values.shape != (len(packed), 1 << bits):
        raise ValueError(f"codes_sum needs {1 << bits} values per rank for {bits}-bit codes, got values of "
                         f"shape {tuple(values.shape)} for {len(packed)} rank(s)")
    _library().mc_codes_sum(_streams("packed", packed, *_code_layout(n, bits)), bits, values.data_ptr(), len(packed),
                            n, float(divisor), _buf("out", out, torch.float32, n), _threads())
    return out


def trits_sum(packed: Sequence[torch.Tensor], values: torch.Tensor, n: int, divisor: float,
              out: torch.Tensor) -> torch.Tensor:
    """``out = (sum_r values[r, code_r]) / divisor``: rank ``r``'s ``n`` base-3 codes (five to a
    byte, :mod:`mergecomp.kernels.tritpack`) decoded through its own ``values[r]`` (3 of them),
    summed in rank order in one pass.  Returns ``out``."""
    values = values.to(torch.float32).contiguous()
    if not packed or values.shape != (len(packed), 3):
        raise ValueError(f"trits_sum needs 3 values per rank, got values of shape {tuple(values.shape)} for "
                         f"{len(packed)} rank(s)")
    _library().mc_trits_sum(_streams("packed", packed, torch.uint8, trit_bytes(n)), values.data_ptr(), len(packed), n,
                            float(divisor), _buf("out", out, torch.float32, n), _threads())
    return out


def levels_sum(codes: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], bucket: int, bits: int, shift: int,
               divisor: float, out: torch.Tensor) -> torch.Tensor:
    """``out = (sum_r (codes_r - shift) * steps_r[i // bucket]) / divisor``: every rank's
    :func:`scale_levels` summed in rank order, in one pass over ``out``.  Returns ``out``."""
    n, bucket = out.numel(), max(int(bucket), 1)
    if not codes or bits not in (4, 8) or len(steps) != len(codes):
        raise ValueError(f"levels_sum needs 4- or 8-bit codes and one step tensor per rank, got bits={bits}, "
                         f"{len(codes)} code and {len(steps)} step tensor(s)")
    per_rank = _per_bucket(n, bucket)
    table = torch.stack([_checked_steps(s, per_rank) for s in steps])
    _library().mc_levels_sum(_streams("codes", codes, *_code_layout(n, bits)), len(codes), n, bits, float(shift),
                             table.data_ptr(), per_rank, bucket, float(divisor), _buf("out", out, torch.float32, n),
                             _threads())
    return out


def _checked_steps(steps: torch.Tensor, per_rank: int) -> torch.Tensor:
    """One rank's fp32 steps, one per bucket."""
    steps = steps.reshape(-1).to(torch.float32)
    if steps.numel() != per_rank:
        raise ValueError(f"levels_sum: {steps.numel()} steps for {per_rank} bucket(s)")
    return steps


def indices_above(x: torch.Tensor, threshold: float, capacity: int) -> torch.Tensor:
    """int64 indices (ascending) of the elements with ``|x| >= threshold``, in one pass without
    a mask; ``capacity`` is a guess of their number (a second call fixes a low guess)."""
    lib, n = _library(), x.numel()
    address = _buf("x", x, torch.float32, n)
    out = torch.empty(max(int(capacity), 1), dtype=torch.int64)
    count = lib.mc_indices_above(address, n, threshold, out.data_ptr(), out.numel(), _threads())
    if count > out.numel():
        out = torch.empty(count, dtype=torch.int64)
        lib.mc_indices_above(address, n, threshold, out.data_ptr(), count, _threads())
    return out[:count]


def compensated_above(x: torch.Tensor, residual: Optional[torch.Tensor], threshold: float, out: torch.Tensor,
                      capacity: int, momentum: Optional[Tuple[float, torch.Tensor, torch.Tensor]] = None,
                      clear: bool = False) -> Tuple[torch.Tensor, torch.Tensor, int, Optional[torch.Tensor], bool]:
    """Top-k's scan of ``c = x + residual`` (``residual`` None: ``x``) in one pass: ``out`` (fp32,
    ``x``'s numel; may be ``residual``) gets ``c``, except that the first ``capacity`` elements
    with ``|c| >= threshold`` get 0 and are returned as ``(indices, values, count, None,
    finite)`` (int64 ascending, their ``c``, how many passed: above ``capacity``, the rest keep
    ``out = c``; whether every element of ``x`` is finite: if not, the rest means nothing).
    With ``momentum = (m, u, u_out)`` (DGC; ``residual`` is the velocity): ``u_out`` (may be
    ``u``) gets ``m * u + x``, each step rounded to fp32, and ``c = residual + u_out``; a
    returned element's ``u_out`` is 0 where its ``c`` is not (momentum factor masking), its
    value before that is returned fourth.  :func:`keep_largest` then puts back what is not
    sent.  ``clear``: ``x`` is zeroed, each element once the scan has read it."""
    n = x.numel()
    indices = torch.empty(max(int(capacity), 1), dtype=torch.int64)
    values = torch.empty(indices.numel(), dtype=torch.float32)
    factor, u, u_out = (0.0, None, None) if momentum is None else momentum
    momenta = None if momentum is None else torch.empty(indices.numel(), dtype=torch.float32)
    finite = ctypes.c_int(1)
    count = _library().mc_compensated_above(
        _buf("x", x, torch.float32, n), None if residual is None else _buf("residual", residual, torch.float32, n),
        None if u is None else _buf("u", u, torch.float32, n), factor,
        None if u_out is None else _buf("u_out", u_out, torch.float32, n),
        n, threshold, _buf("out", out, torch.float32, n), indices.data_ptr(), values.data_ptr(),
        None if momenta is None else momenta.data_ptr(), indices.numel(), ctypes.byref(finite),
        _buf("x", x, torch.float32, n) if clear else None, _threads())
    stored = min(count, indices.numel())
    return indices[:stored], values[:stored], count, None if momenta is None else momenta[:stored], bool(finite.value)


def _check_fit(kernel: str, indices: torch.Tensor, numel: int) -> None:
    """Raise unless the candidate ``indices`` (ascending, not empty: the ends bound them) all
    fall in an output of ``numel`` elements that ``kernel`` writes at them."""
    first, last = int(indices[0]), int(indices[-1])
    if not 0 <= first <= last < numel:
        raise ValueError(f"{kernel}: candidate indices {first}..{last} do not fit an output of {numel} elements")


def keep_largest(indices: torch.Tensor, values: torch.Tensor, k: int, out: Optional[torch.Tensor] = None,
                 momentum: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Of candidates ``indices`` (int64, ascending) with fp32 ``values`` (``0 < k <= len``): the
    ``k`` largest in magnitude (of equal ones, the first), ``(indices[:k], values[:k])`` in
    ascending order, moved to the front in place.  The others go back into ``out`` (fp32):
    ``out[index] = value``, and with ``momentum = (momenta, u_out)`` from
    :func:`compensated_above`, ``u_out[index] = momentum``; ``out`` None: nothing goes back."""
    count = indices.numel()
    if not 0 < k <= count or values.numel() != count:
        raise ValueError(f"keep_largest: need 0 < k <= {count} candidates with as many values, got k={k}, "
                         f"{values.numel()} values")
    momenta, u_out = (None, None) if momentum is None else momentum
    numel = 0 if out is None else out.numel()
    if out is not None:
        _check_fit("keep_largest", indices, numel)
    _library().mc_keep_largest(
        _buf("indices", indices, torch.int64, count), _buf("values", values, torch.float32, count),
        None if momenta is None else _buf("momenta", momenta, torch.float32, count), count, k,
        None if out is None else _buf("out", out, torch.float32, numel),
        None if u_out is None else _buf("u_out", u_out, torch.float32, numel))
    return indices[:k], values[:k]


def with_first_zeros(indices: torch.Tensor, values: torch.Tensor, k: int,
                     out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a group with fewer than ``k`` nonzero elements, all of them among the
    candidates ``indices`` (int64, ascending) with their fp32 ``values``, every other element of
    ``out`` a zero: those and the first zeros to make ``k`` (of equal magnitudes the first, as
    :func:`keep_largest` breaks ties), ``(indices, values)`` in ascending order, the zeros taken
    read from ``out`` (a -0 stays one) and then zeroed there."""
    count, numel = indices.numel(), out.numel()
    if not count < k <= numel or values.numel() != count:
        raise ValueError(f"with_first_zeros: need {count} candidates with as many values and {count} < k <= "
                         f"{numel}, got k={k}, {values.numel()} values")
    if count:
        _check_fit("with_first_zeros", indices, numel)
    kept_indices, kept_values = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
    _library().mc_with_first_zeros(_buf("indices", indices, torch.int64, count),
                                   _buf("values", values, torch.float32, count), count, k,
                                   _buf("out", out, torch.float32, numel), kept_indices.data_ptr(),
                                   kept_values.data_ptr())
    return kept_indices, kept_values


def sampled_threshold(x: torch.Tensor, residual: Optional[torch.Tensor], stride: int, rank: int) -> float:
    """The ``rank``-th largest magnitude (1: the largest) of ``c = residual + x`` (``residual``
    None: ``x``) sampled every ``stride`` elements from the first: the float
    ``(residual[::stride] + x[::stride]).abs().topk(rank).values.min()`` gives, in one pass over
    the sample without materializing it (fp32 CPU; NaN where the sample holds one, as there)."""
    n, stride = x.numel(), int(stride)
    if stride < 1:
        raise ValueError(f"sampled_threshold: the stride must be >= 1, got {stride}")
    sample = -(-n // stride)
    if not 1 <= rank <= sample:
        raise ValueError(f"sampled_threshold: need 1 <= rank <= {sample} sampled elements, got rank={rank}")
    return float(_library().mc_sampled_threshold(
        _buf("x", x, torch.float32, n), None if residual is None else _buf("residual", residual, torch.float32, n),
        n, stride, int(rank)))


def moments(x: torch.Tensor) -> torch.Tensor:
    """fp64 ``[min x, max x, sum (x - mean x)^2]`` of a non-empty ``x`` in one pass over memory
    (the squared deviations summed stably: no cancellation however large the mean)."""
    if x.numel() == 0:
        raise ValueError("moments of an empty tensor")
    stats = torch.empty(3, dtype=torch.float64)
    _library().mc_moments(_buf("x", x, torch.float32, x.numel()), x.numel(), stats.data_ptr(), _threads())
    return stats


def copy_finite(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0, stream: bool = False) -> bool:
    """``dst[:n] = src * scale`` (``scale`` 1: a copy) for fp32 ``src`` of ``n`` elements and,
    from the same pass, whether every element written is finite (no NaN or Inf): a gradient's
    copy into its merged group, its prescale and the group's non-finite check in one read.
    ``stream``: ``dst`` is written past the cache (non-temporal stores), for a destination read
    again only later (a large group's buffer, read when the group is complete)."""
    n = src.numel()
    return bool(_library().mc_copy_finite(_buf("src", src, torch.float32, n),
                                          _buf("dst", dst, torch.float32, n), n, scale, int(stream), _threads()))


def cast_half_finite(src: torch.Tensor, dst: torch.Tensor) -> Optional[bool]:
    """``dst`` (fp16) = ``src`` (fp32, ``n`` elements) rounded as torch's cast rounds and, from
    the same pass, whether every element written is finite (a finite ``src`` beyond 65504 becomes
    Inf); None where the CPU has no F16C conversion (nothing written: the caller casts)."""
    n = src.numel()
    served = _library().mc_cast_half_finite(_buf("src", src, torch.float32, n), _buf("dst", dst, torch.float16, n),
                                            n, _threads())
    return None if served < 0 else bool(served)


def zero_fill(out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) set to zeros with non-temporal stores: written without being read first."""
    n = out.numel()
    _library().mc_zero_fill(_buf("out", out, torch.float32, n), n, _threads())
    return out


def matrices_usable(*tensors: Optional[torch.Tensor]) -> bool:
    """True when the kernels are on and every tensor (None: skipped) is a batch of fp32 CPU
    matrices, each row-major, the batch at any non-overlapping stride (``k x m x n`` with
    strides ``(s, n, 1)``, ``s >= m n``): equally spaced matrices viewed in a merged group."""
    if _off:
        return False
    for t in tensors:
        if t is not None and not (t.is_cpu and t.dtype is torch.float32 and _matrix_strides(t)):
            return False
    return _loaded() is not None


def _matrix_strides(t: torch.Tensor) -> bool:
    if t.dim() != 3:
        return False
    count, m, n = t.shape
    stride = t.stride()
    return (n < 2 or stride[2] == 1) and (m < 2 or stride[1] == n) and (count < 2 or stride[0] >= m * n)


def low_rank(p: torch.Tensor, qt: torch.Tensor, x: Optional[torch.Tensor], out: torch.Tensor,
             stream: bool = False) -> torch.Tensor:
    """``out = x - p @ qt`` (``x`` None: ``p @ qt``) in one pass, batched: ``p`` (k, m, r) and
    ``qt`` (k, r, n), contiguous fp32 CPU; ``x`` and ``out`` (k, m, n) fp32 CPU with the same
    strides ``(s, n, 1)`` (:func:`matrices_usable`; ``out`` may be ``x``).  ``stream``: ``out``
    is written past the cache (it is read only later).  Returns ``out``."""
    if p.dim() != 3 or qt.dim() != 3 or p.shape[0] != qt.shape[0] or p.shape[2] != qt.shape[1] \
            or not 1 <= p.shape[2] <= 2 ** 31 - 1:
        raise ValueError(f"native low_rank: need p (k, m, r) and qt (k, r, n), got {tuple(p.shape)} and "
                         f"{tuple(qt.shape)}")
    (count, m, r), n = p.shape, qt.shape[2]
    for name, t in (("out", out), ("x", x)):
        if t is not None and (tuple(t.shape) != (count, m, n) or t.stride() != out.stride()
                              or not matrices_usable(t)):
            raise ValueError(f"native low_rank: {name} must be {count} fp32 CPU row-major {m} x {n} matrices at "
                             f"out's strides, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    _library().mc_low_rank(_buf("p", p, torch.float32, count * m * r), _buf("qt", qt, torch.float32, count * r * n),
                           count, m, n, r, None if x is None else x.data_ptr(), out.data_ptr(),
                           out.stride(0), int(stream), _threads())
    return out


def _segments(offsets: torch.Tensor, numel: int, **per_segment: torch.Tensor) -> int:
    """The number of segments ``offsets`` (int64, ascending, from 0 to ``numel``) cuts, after
    checking it and each per-segment array (``active``: uint8, the others fp32) by name."""
    count = offsets.numel() - 1
    if offsets.dtype is not torch.int64 or not offsets.is_contiguous() or count < 0 or int(offsets[-1]) != numel \
            or int(offsets[0]) != 0:
        raise ValueError(f"native segment kernel: offsets must be int64 from 0 to {numel}, got {offsets.dtype} "
                         f"{offsets.tolist()[:4]}...")
    for name, t in per_segment.items():
        _buf(name, t, torch.uint8 if name == "active" else torch.float32, count)
    return count


def momentum_to_wire_segments(grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor,
                              offsets: torch.Tensor, mix: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor,
                              coefficient: torch.Tensor, limit: torch.Tensor, active: torch.Tensor,
                              divide: bool) -> bool:
    """In place over the flat fp32 ``grad``, segment by segment (``offsets``; per segment ``s``
    the fp32 values ``mix[s]`` ...): ``(grad * mix + momentum * weight) / (sqrt(variance) +
    eps) * coefficient`` with ``divide``, else ``fma(momentum, weight, grad * mix) *
    coefficient``, a value beyond ``limit[s]`` (+Inf: none) replaced by the limit with its
    sign; zeros where ``active[s]`` is 0.  One pass; returns whether every value, before the
    limit, is finite."""
    n = grad.numel()
    count = _segments(offsets, n, mix=mix, weight=weight, eps=eps, coefficient=coefficient, limit=limit,
                      active=active)
    return bool(_library().mc_momentum_to_wire_segments(
        _buf("grad", grad, torch.float32, n), _buf("momentum", momentum, torch.float32, n),
        _buf("variance", variance, torch.float32, n), offsets.data_ptr(), count, mix.data_ptr(), weight.data_ptr(),
        eps.data_ptr(), coefficient.data_ptr(), limit.data_ptr(), active.data_ptr(), int(divide), _threads()))


def momentum_from_wire_segments(wire: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor,
                                offsets: torch.Tensor, coefficient: torch.Tensor, eps: torch.Tensor,
                                weight: torch.Tensor, active: torch.Tensor, divide: bool) -> torch.Tensor:
    """In place over the flat fp32 ``wire``, segment by segment: ``wire / coefficient *
    (sqrt(variance) + eps)`` where ``divide`` and active, else ``wire / coefficient``; then,
    where active, ``fma(momentum, weight, wire)``.  One pass; returns ``wire``."""
    n = wire.numel()
    count = _segments(offsets, n, coefficient=coefficient, eps=eps, weight=weight, active=active)
    _library().mc_momentum_from_wire_segments(
        _buf("wire", wire, torch.float32, n), _buf("momentum", momentum, torch.float32, n),
        _buf("variance", variance, torch.float32, n), offsets.data_ptr(), count, coefficient.data_ptr(),
        eps.data_ptr(), weight.data_ptr(), active.data_ptr(), int(divide), _threads())
    return wire


def frozen_adam_segments(params: Sequence[torch.Tensor], grad: torch.Tensor, momentum: torch.Tensor,
                         variance: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor, correction: torch.Tensor,
                         eps: torch.Tensor, step: torch.Tensor, inv_bound2: torch.Tensor, active: torch.Tensor) -> None:
    """Adam's update with the variance frozen over a merged group: for each active segment
    ``s``, ``momentum = grad``, ``variance = max(variance, grad * grad * inv_bound2)`` and
    ``params[s] = params[s] * keep + step * (grad / (sqrt(variance) / correction + eps))`` over
    its elements; ``params[s]`` (contiguous fp32 of the segment's numel) is read and written
    where it lies.  One pass."""
    n = grad.numel()
    count = _segments(offsets, n, keep=keep, correction=correction, eps=eps, step=step, inv_bound2=inv_bound2,
                      active=active)
    if len(params) != count:
        raise ValueError(f"frozen_adam_segments: {len(params)} parameters for {count} segments")
    _library().mc_frozen_adam_segments(
        _streams("params", params, torch.float32, (offsets[1:] - offsets[:-1]).tolist()), _buf("grad", grad, torch.float32, n), _buf("momentum", momentum, torch.float32, n),
        _buf("variance", variance, torch.float32, n), offsets.data_ptr(), count, keep.data_ptr(),
        correction.data_ptr(), eps.data_ptr(), step.data_ptr(), inv_bound2.data_ptr(), active.data_ptr(), _threads())

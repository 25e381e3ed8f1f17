// Fused CPU kernels for the elementwise codecs (mergecomp.native loads this file).
//
// Each kernel makes one pass over a contiguous fp32 buffer where the eager torch code makes
// four to eight, and draws its random numbers from a counter-based hash instead of torch's
// generator.  Layouts match mergecomp.bitpack: element i of a ``bits``-bit code stream lives
// in byte i / (8 / bits) at bit offset bits * (i % (8 / bits)); a short last byte is padded
// with zero codes.
//
// Work is cut into fixed blocks of BLOCK elements that threads take in contiguous runs, and
// every reduction is summed per block and then in block order, so results do not depend on
// the thread count.  The random draw of element i depends only on (seed, i).
//
// Built by mergecomp.native with: -O3 -march=native -fopenmp-simd -fno-math-errno
// -fno-trapping-math -ffp-contract=off (no OpenMP runtime: threads are std::thread; every
// product and sum rounded on its own, as torch's elementwise steps round them).
#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <pthread.h>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 1 << 15;  // elements per block: a multiple of 8
// mc_trits_sum's elements per block: a multiple of 5 (codes a byte) and of 16 (64-byte stores)
constexpr int64_t TRIT_BLOCK = 80 * 409;
constexpr int64_t MIN_PER_THREAD = 1 << 18;

// The OpenMP runtime torch runs its own operators on (mc_use_openmp), when the process has one:
// kernels then run on torch's worker threads instead of beside them.  After an operator those
// threads spin for a while waiting for the next one; threads of our own would compete with them
// for the cores (measured on 2 cores: a 25 M-element sign pack 8.0 ms beside them, 6.0 ms with
// OMP_WAIT_POLICY=passive).
using OmpParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpIndex = int (*)();
OmpParallel omp_parallel = nullptr;
OmpIndex omp_thread = nullptr, omp_threads = nullptr;

// Runs body(first, last) over the units [0, units) of `unit` elements each, in contiguous
// runs on up to `threads` threads (fewer when there is little work).
template <typename Body>
void parallel_for(int64_t units, int64_t unit, int threads, Body body) {
  const int64_t work = units * unit;
  const int64_t workers = std::min({static_cast<int64_t>(std::max(threads, 1)),
                                    std::max<int64_t>(1, work / MIN_PER_THREAD), units});
  if (workers <= 1) {
    body(int64_t{0}, units);
    return;
  }
  // Worker w of `team` takes its contiguous share of the units with its own copy of body: a
  // worker reading the caller's stack would share its cache lines (the bodies' byte stores may
  // alias their captures, which are then read again and again).
  auto share = [units, &body](int64_t w, int64_t team) {
    const int64_t per = units / team, extra = units % team;
    const int64_t first = w * per + std::min(w, extra);
    Body own = body;
    own(first, first + per + (w < extra ? 1 : 0));
  };
  if (omp_parallel != nullptr) {
    using Share = decltype(share);
    omp_parallel([](void* data) { (*static_cast<const Share*>(data))(omp_thread(), omp_threads()); },
                 &share, static_cast<unsigned>(workers), 0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t w = 0; w + 1 < workers; ++w) pool.emplace_back(share, w, workers);
  share(workers - 1, workers);
  for (auto& t : pool) t.join();
}

// parallel_for over the blocks of BLOCK elements covering [0, n).
template <typename Body>
void parallel_blocks(int64_t n, int threads, Body body) {
  parallel_for((n + BLOCK - 1) / BLOCK, BLOCK, threads, body);
}

// body(s, start, stop) for the elements [start, stop) of segment s (segment s: the elements
// [offsets[s], offsets[s + 1]) of [0, offsets[segments]), offsets ascending), piece by piece
// as the blocks of parallel_blocks cut them: for kernels whose constants change by segment.
template <typename Body>
void parallel_segments(const int64_t* offsets, int64_t segments, int threads, Body body) {
  const int64_t n = offsets[segments];
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    const int64_t end = std::min(n, last * BLOCK);
    int64_t at = first * BLOCK;
    int64_t s = std::upper_bound(offsets, offsets + segments + 1, at) - offsets - 1;
    for (; at < end; ++s) {
      const int64_t stop = std::min(end, offsets[s + 1]);
      if (stop > at) body(s, at, stop);
      at = std::max(at, stop);
    }
  });
}

// body(i) for every element i of [0, n), block by block (parallel_blocks), each block's loop
// vectorized: for kernels whose elements are independent.
template <typename Body>
void parallel_elements(int64_t n, int threads, Body body) {
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    const int64_t stop = std::min(n, last * BLOCK);
#pragma omp simd
    for (int64_t i = first * BLOCK; i < stop; ++i) body(i);
  });
}

// A 32-bit integer hash (lowbias32, Wellons: full avalanche, a bijection of the counter) of
// the counter keyed by a 64-bit seed.  One round is enough for stochastic rounding: only the
// marginal of each draw matters, and neighbouring counters give unrelated words.
inline uint32_t hash32(uint32_t counter, uint32_t key_lo, uint32_t key_hi) {
  uint32_t x = (counter ^ key_lo) * 0x9e3779b9U + key_hi;
  x ^= x >> 16; x *= 0x7feb352dU;
  x ^= x >> 15; x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The 16-bit draws of elements [start, start + len): element i takes half (i % 2) of
// hash(i / 2).  `buf` is scratch; the result points into it.  The counter is 32 bits, so the
// draws of one call repeat after 2**33 elements (32 GiB of fp32).
inline const uint16_t* draw16(int64_t start, int64_t len, uint64_t seed, std::vector<uint32_t>& buf) {
  const uint32_t key_lo = static_cast<uint32_t>(seed), key_hi = static_cast<uint32_t>(seed >> 32);
  const int64_t pair0 = start / 2, pairs = (start + len + 1) / 2 - pair0;
  buf.resize(pairs);
  uint32_t* d = buf.data();
#pragma omp simd
  for (int64_t j = 0; j < pairs; ++j) d[j] = hash32(static_cast<uint32_t>(pair0 + j), key_lo, key_hi);
  return reinterpret_cast<const uint16_t*>(d) + (start & 1);
}

// dst[k] = floor(clamp(src[k] * s, lo, hi) + (r[k] + 0.5) / 2**16) + shift, k < len.
inline void round_run(const float* src, const uint16_t* r, int64_t len, float s, float lo, float hi,
                      float shift, int8_t* dst) {
#pragma omp simd
  for (int64_t k = 0; k < len; ++k) {
    const float v = std::min(std::max(src[k] * s, lo), hi);
    const float u = (static_cast<float>(r[k]) + 0.5f) * (1.0f / 65536.0f);
    dst[k] = static_cast<int8_t>(static_cast<int32_t>(std::floor(v + u) + shift));
  }
}

// round_run over elements [start, start + len) of x, in runs of one bucket (scales: one per
// bucket of `bucket` elements), with the draws of element start on: dst[0, len).
inline void round_range(const float* x, int64_t start, int64_t len, const float* scales, int64_t bucket, float lo,
                        float hi, float shift, uint64_t seed, std::vector<uint32_t>& draws, int8_t* dst) {
  const uint16_t* r = draw16(start, len, seed, draws);
  for (int64_t i = 0; i < len;) {
    const int64_t g = start + i, stop = std::min(len, i + (bucket - g % bucket));
    round_run(x + g, r + i, stop - i, scales[g / bucket], lo, hi, shift, dst + i);
    i = stop;
  }
}

// Packs `count` codes (each < 2**bits, one per byte, zero-padded to a multiple of 8 / bits)
// into count * bits / 8 bytes of `out`.
void pack_codes(const uint8_t* codes, int64_t count, int bits, uint8_t* out) {
  const int64_t bytes = count * bits / 8;
  if (bits == 1) {
    for (int64_t j = 0; j < bytes; ++j) {
      uint64_t w;
      std::memcpy(&w, codes + 8 * j, 8);
      out[j] = static_cast<uint8_t>((w * 0x0102040810204080ULL) >> 56);
    }
  } else if (bits == 2) {
#pragma omp simd
    for (int64_t j = 0; j < bytes; ++j) {
      uint32_t w;
      std::memcpy(&w, codes + 4 * j, 4);
      out[j] = static_cast<uint8_t>((w & 0x3U) | ((w >> 6) & 0xcU) | ((w >> 12) & 0x30U) |
                                    ((w >> 18) & 0xc0U));
    }
  } else {  // 4
#pragma omp simd
    for (int64_t j = 0; j < bytes; ++j) {
      out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
    }
  }
}

// Writes the 256 x (8 / bits) table of what each byte of packed ``bits``-bit codes decodes
// to: row b holds values[code j of b] for j = 0 .. 8 / bits - 1.
void spread_table(const float* values, int bits, float* table) {
  const int per = 8 / bits, mask = (1 << bits) - 1;
  for (int byte = 0; byte < 256; ++byte)
    for (int j = 0; j < per; ++j) table[byte * per + j] = values[(byte >> (bits * j)) & mask];
}

// EXPAND[b]: the 8 bits of byte b as 8 bytes of 0 or 1 (bit j in byte j).
const std::vector<uint64_t> EXPAND = [] {
  std::vector<uint64_t> table(256);
  for (uint64_t b = 0; b < 256; ++b)
    for (int j = 0; j < 8; ++j) table[b] |= ((b >> j) & 1) << (8 * j);
  return table;
}();

// Outputs of at least this many elements (4 MiB, a core's L2) are written with non-temporal
// stores (stream_out): an aggregate is read only once every group of the step is decoded (by the
// optimizer), a kept buffer at the next step, a group buffer once the group is complete.
// Measured, 2-rank 1-bit aggregates of 1 M, 2 M, 4 M and 6.4 M elements: 0.79, 1.31, 2.21 and
// 3.24 ms in place, 0.52, 0.70, 1.11 and 1.51 ms streamed; read right afterwards, streaming costs
// 0.1 ms at 1 M and 2 M elements and gains from 4 M on.
constexpr int64_t STREAM_MIN = 1 << 20;

// dst[0, len) = src[0, len); with `stream`, by non-temporal stores where dst is 32-byte aligned:
// the lines of dst are written whole, without being read into the cache first (a third of the
// memory traffic of writing a large output).  The caller ends its thread's stores with
// stores_done().
void stream_out(const float* src, float* dst, int64_t len, bool stream) {
  int64_t k = 0;
#if defined(__AVX__)
  if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
    for (; k + 8 <= len; k += 8) _mm256_stream_ps(dst + k, _mm256_loadu_ps(src + k));
  }
#endif
  std::memcpy(dst + k, src + k, (len - k) * sizeof(float));
}

// Orders the non-temporal stores of stream_out before what the thread does next.
void stores_done() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// Where pack_signs_impl takes each element v from: x; x + (r - side(r)), side(r) = positive
// where r >= 0, else negative (with both 0: x + r, the plain residual; else r holds the
// compensated gradient of the step before, whose residual is r less its sign decode); or the
// momentum r + weight * (x - r) of the momentum r (written out through keep; in place where
// keep is r).
enum class Input { kPlain, kCarried, kMomentum };

// Each side of a sign code is summed in SIGN_LANES fp32 lanes (element k of a block in lane
// k % SIGN_LANES) over runs of SIGN_RUN elements, each lane's run total then added in fp64, so
// a run adds SIGN_RUN / SIGN_LANES = 8 terms in fp32.  A side's terms share a sign, so the
// fp32 run totals are within 8 * 2**-24 of exact (relative), and a small side keeps its digits
// beside a large one.  The AVX-512 loop and the portable one add in the same order.
constexpr int SIGN_LANES = 16;
constexpr int64_t SIGN_RUN = 8 * SIGN_LANES;
static_assert(BLOCK % SIGN_RUN == 0, "a block is whole runs");

// fp64 partials of the side sums: run totals of lanes l and l + 8 go to acc[l % 8].
struct SideSums {
  double above[8] = {}, below[8] = {};
  static double total(const double* acc) {
    double t = 0;
    for (int j = 0; j < 8; ++j) t += acc[j];
    return t;
  }
};

// The value pack_signs_impl codes at element k (see Input).
template <Input In>
inline float sign_input(const float* x, const float* r, float negative, float positive, float weight, int64_t k) {
  float v = x[k];
  if (In == Input::kCarried) {
    const float carried = r[k];
    v += carried - (carried >= 0.0f ? positive : negative);
  }
  if (In == Input::kMomentum) v = r[k] + weight * (v - r[k]);
  return v;
}

// pack_signs_impl over elements [start, start + len) of one block (start a multiple of
// SIGN_RUN): bits into out + start / 8 (a short last byte zero-padded), sums into `sums`;
// returns the count of v >= 0.  With `stream` (keep 64-byte aligned), whole vectors of keep are
// written by non-temporal stores (the caller then calls stores_done()).  Without Sums only
// whether every v is finite is worked out: sums.above[0] is 0, or NaN for a NaN or Inf (v - v
// added up), and the count is 0.  Portable form: codes a byte per element, then packs them.
template <Input In, bool Keep, bool Sums = true>
int64_t sign_block(const float* x, const float* r, float negative, float positive, float weight, float* keep,
                   int64_t start, int64_t len, uint8_t* out, SideSums& sums, bool stream) {
#if defined(__AVX512F__)
  const __m512 zero = _mm512_setzero_ps(), pos = _mm512_set1_ps(positive), neg = _mm512_set1_ps(negative),
               w = _mm512_set1_ps(weight);
  __m512d above = _mm512_loadu_pd(sums.above), below = _mm512_loadu_pd(sums.below);
  int64_t count = 0;
  __m512 up = zero, down = zero, unfinite = zero;
  // one vector of lanes [i, i + 16) of which `live` are elements; the others code nothing
  const auto code = [&](int64_t i, __mmask16 live) {
    __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    if (In == Input::kCarried) {
      const __m512 carried = _mm512_maskz_loadu_ps(live, r + i);
      const __m512 side = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(carried, zero, _CMP_GE_OQ), neg, pos);
      v = _mm512_maskz_add_ps(live, v, _mm512_sub_ps(carried, side));
    }
    if (In == Input::kMomentum) {
      const __m512 old = _mm512_maskz_loadu_ps(live, r + i);
      v = _mm512_add_ps(old, _mm512_mul_ps(w, _mm512_sub_ps(v, old)));
    }
    if (Keep) {
      if (stream && live == 0xffff) {
        _mm512_stream_ps(keep + i, v);
      } else {
        _mm512_mask_storeu_ps(keep + i, live, v);
      }
    }
    const uint16_t bits = _mm512_mask_cmp_ps_mask(live, v, zero, _CMP_GE_OQ);
    if (Sums) {
      // zero first: the vector max and min return their second operand for a NaN, which then
      // reaches the sums (as the portable loop's std::max and std::min do)
      up = _mm512_add_ps(up, _mm512_max_ps(zero, v));
      down = _mm512_add_ps(down, _mm512_min_ps(zero, v));
      count += __builtin_popcount(bits);
    } else {
      unfinite = _mm512_add_ps(unfinite, _mm512_sub_ps(v, v));  // masked-off lanes are 0
    }
    return bits;
  };
  for (int64_t run = 0; run < len; run += SIGN_RUN) {
    up = down = zero;
    const int64_t whole = std::min(len, run + SIGN_RUN) / SIGN_LANES * SIGN_LANES;
    int64_t k = run;
    for (; k < whole; k += SIGN_LANES) {
      const uint16_t bits = code(start + k, 0xffff);
      std::memcpy(out + (start + k) / 8, &bits, 2);
    }
    if (k < std::min(len, run + SIGN_RUN)) {  // the last few elements of x
      const uint16_t bits = code(start + k, static_cast<__mmask16>((1u << (len - k)) - 1));
      out[(start + k) / 8] = static_cast<uint8_t>(bits);
      if (len - k > 8) out[(start + k) / 8 + 1] = static_cast<uint8_t>(bits >> 8);
    }
    if (!Sums) continue;
    above = _mm512_add_pd(above, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(up)),
                                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(up, 1))));
    below = _mm512_add_pd(below, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(down)),
                                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(down, 1))));
  }
  _mm512_storeu_pd(sums.above, above);
  _mm512_storeu_pd(sums.below, below);
  if (!Sums) sums.above[0] += _mm512_reduce_add_ps(unfinite);
  return count;
#elif defined(__AVX2__)
  // The AVX-512 loop's lanes as two vectors of 8 (lanes 0-7 and 8-15): the same sums in the
  // same order, bit for bit; the last few elements masked.
  const __m256 zero = _mm256_setzero_ps(), pos = _mm256_set1_ps(positive), neg = _mm256_set1_ps(negative),
               w = _mm256_set1_ps(weight);
  __m256d above[2] = {_mm256_loadu_pd(sums.above), _mm256_loadu_pd(sums.above + 4)};
  __m256d below[2] = {_mm256_loadu_pd(sums.below), _mm256_loadu_pd(sums.below + 4)};
  int64_t count = 0;
  __m256 up[2], down[2], unfinite = zero;
  const auto lanes = [](int64_t live) {  // the first `live` (0..8) lanes on
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  };
  // 8 lanes from element i, `live` of them elements (the others load and code 0); returns their bits
  const auto code = [&](int64_t i, int64_t live, int half) -> uint32_t {
    const __m256i mask = lanes(live);
    const bool whole = live == 8;
    __m256 v = whole ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, mask);
    if (In == Input::kCarried) {
      const __m256 carried = whole ? _mm256_loadu_ps(r + i) : _mm256_maskload_ps(r + i, mask);
      const __m256 side = _mm256_blendv_ps(neg, pos, _mm256_cmp_ps(carried, zero, _CMP_GE_OQ));
      v = _mm256_and_ps(_mm256_add_ps(v, _mm256_sub_ps(carried, side)), _mm256_castsi256_ps(mask));
    }
    if (In == Input::kMomentum) {
      const __m256 old = whole ? _mm256_loadu_ps(r + i) : _mm256_maskload_ps(r + i, mask);
      v = _mm256_and_ps(_mm256_add_ps(old, _mm256_mul_ps(w, _mm256_sub_ps(v, old))), _mm256_castsi256_ps(mask));
    }
    if (Keep) {
      if (stream && whole) {
        _mm256_stream_ps(keep + i, v);
      } else if (whole) {
        _mm256_storeu_ps(keep + i, v);
      } else {
        _mm256_maskstore_ps(keep + i, mask, v);
      }
    }
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ))) &
                          ((1u << live) - 1);
    if (Sums) {
      up[half] = _mm256_add_ps(up[half], _mm256_max_ps(zero, v));  // zero first, as the AVX-512 loop
      down[half] = _mm256_add_ps(down[half], _mm256_min_ps(zero, v));
      count += __builtin_popcount(bits);
    } else {
      unfinite = _mm256_add_ps(unfinite, _mm256_sub_ps(v, v));  // masked-off lanes are 0
    }
    return bits;
  };
  for (int64_t run = 0; run < len; run += SIGN_RUN) {
    up[0] = up[1] = down[0] = down[1] = zero;
    const int64_t stop = std::min(len, run + SIGN_RUN);
    for (int64_t k = run; k < stop; k += SIGN_LANES) {
      const int64_t live = std::min<int64_t>(SIGN_LANES, stop - k);
      const uint32_t bits = code(start + k, std::min<int64_t>(8, live), 0) |
                            (live > 8 ? code(start + k + 8, live - 8, 1) << 8 : 0u);
      if (live == SIGN_LANES) {
        const uint16_t both = static_cast<uint16_t>(bits);
        std::memcpy(out + (start + k) / 8, &both, 2);
      } else {
        out[(start + k) / 8] = static_cast<uint8_t>(bits);
        if (live > 8) out[(start + k) / 8 + 1] = static_cast<uint8_t>(bits >> 8);
      }
    }
    if (!Sums) continue;
    for (int q = 0; q < 2; ++q) {  // lanes 4q .. 4q + 3 of each half: fp64 partials 4q .. 4q + 3
      const auto quarter = [q](__m256 v) { return _mm256_cvtps_pd(q ? _mm256_extractf128_ps(v, 1)
                                                                      : _mm256_castps256_ps128(v)); };
      above[q] = _mm256_add_pd(above[q], _mm256_add_pd(quarter(up[0]), quarter(up[1])));
      below[q] = _mm256_add_pd(below[q], _mm256_add_pd(quarter(down[0]), quarter(down[1])));
    }
  }
  _mm256_storeu_pd(sums.above, above[0]);
  _mm256_storeu_pd(sums.above + 4, above[1]);
  _mm256_storeu_pd(sums.below, below[0]);
  _mm256_storeu_pd(sums.below + 4, below[1]);
  if (!Sums) {
    float lane[8];
    _mm256_storeu_ps(lane, unfinite);
    for (float value : lane) sums.above[0] += value;
  }
  return count;
#else
  (void)stream;  // the portable loop stores as it goes
  uint8_t codes[SIGN_RUN], packed[SIGN_RUN / 8];
  int64_t count = 0;
  for (int64_t run = 0; run < len; run += SIGN_RUN) {
    const int64_t stop = std::min(len - run, SIGN_RUN);
    float up[SIGN_LANES] = {}, down[SIGN_LANES] = {};
    for (int64_t k = 0; k < SIGN_RUN; ++k) {
      const float v = k < stop ? sign_input<In>(x, r, negative, positive, weight, start + run + k) : 0.0f;
      if (Keep && k < stop) keep[start + run + k] = v;
      codes[k] = k < stop && v >= 0.0f;
      if (!Sums) {
        up[0] += v - v;
        continue;
      }
      count += codes[k];
      up[k % SIGN_LANES] += std::max(v, 0.0f);
      down[k % SIGN_LANES] += std::min(v, 0.0f);
    }
    pack_codes(codes, SIGN_RUN, 1, packed);
    std::memcpy(out + (start + run) / 8, packed, (stop + 7) / 8);
    for (int j = 0; j < 8; ++j) {
      sums.above[j] += static_cast<double>(up[j]) + static_cast<double>(up[j + 8]);
      sums.below[j] += static_cast<double>(down[j]) + static_cast<double>(down[j + 8]);
    }
  }
  return count;
#endif
}

// The sign bits of v[i] (see Input) packed into out, with stats = {sum of the v >= 0, sum of the
// v < 0, count of v >= 0}, each side summed on its own (see SIGN_LANES).  One loop for every
// input, so the sums of equal v are equal bit for bit.  With Keep, keep (may be r) receives
// every v, written past the cache with stream_keep where keep is 64-byte aligned.  Without
// Sums, stats = {0, or NaN where a v is NaN or Inf; 0; 0} (see sign_block).
template <Input In, bool Keep = false, bool Sums = true>
void pack_signs_impl(const float* x, const float* r, float negative, float positive, float weight, float* keep,
                     int64_t n, uint8_t* out, double* stats, int threads, bool stream_keep = false) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<double> partial(3 * blocks);
  double* p = partial.data();
  const bool stream = Keep && stream_keep && (reinterpret_cast<uintptr_t>(keep) & 63) == 0;
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK;
      SideSums sums;
      const int64_t count = sign_block<In, Keep, Sums>(x, r, negative, positive, weight, keep, start,
                                                       std::min(BLOCK, n - start), out, sums, stream);
      p[3 * b] = SideSums::total(sums.above);
      p[3 * b + 1] = SideSums::total(sums.below);
      p[3 * b + 2] = static_cast<double>(count);
    }
    if (stream) stores_done();
  });
  stats[0] = stats[1] = stats[2] = 0;
  for (int64_t b = 0; b < blocks; ++b)
    for (int j = 0; j < 3; ++j) stats[j] += p[3 * b + j];
}

// dst[k] = src[k] * scale (Scaled) or src[k]; returns 1 when it is not finite (NaN or Inf).
template <bool Scaled>
inline uint32_t copy_one(const float* in, float scale, float* out, int64_t k) {
  const float v = Scaled ? in[k] * scale : in[k];
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  out[k] = v;
  return static_cast<uint32_t>((bits & 0x7f800000U) == 0x7f800000U);  // exponent all ones
}

// dst = src * scale (Scaled) or src; returns 1 when every element of dst is finite (no NaN or
// Inf), else 0.  With `stream`, whole 64-byte lines of dst are written by non-temporal stores.
template <bool Scaled>
int copy_finite_impl(const float* src, float scale, float* dst, int64_t n, bool stream, int threads) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<uint8_t> bad(blocks);
  uint8_t* flags = bad.data();
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, len = std::min(BLOCK, n - start);
      const float* in = src + start;
      float* out = dst + start;
      uint32_t any = 0;
      int64_t k = 0;
#if defined(__AVX512F__)
      if (stream) {
        for (; k < len && (reinterpret_cast<uintptr_t>(out + k) & 63) != 0; ++k) any |= copy_one<Scaled>(in, scale, out, k);
        const __m512i exponent = _mm512_set1_epi32(0x7f800000);
        const __m512 factor = _mm512_set1_ps(scale);
        __mmask16 nonfinite = 0;
        for (; k + 16 <= len; k += 16) {
          __m512 v = _mm512_loadu_ps(in + k);
          if (Scaled) v = _mm512_mul_ps(v, factor);
          nonfinite |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
          _mm512_stream_ps(out + k, v);
        }
        any |= static_cast<uint32_t>(nonfinite != 0);
      }
#endif
#pragma omp simd reduction(| : any)
      for (int64_t j = k; j < len; ++j) any |= copy_one<Scaled>(in, scale, out, j);
      flags[b] = static_cast<uint8_t>(any);
    }
    if (stream) stores_done();
  });
  return std::none_of(bad.begin(), bad.end(), [](uint8_t f) { return f != 0; }) ? 1 : 0;
}

// block[i - first] = (code[i] - shift) * steps[i / bucket] (Add: block[i - first] += that) for
// first <= i < stop: QSGD's decode of int8 levels (bits == 8, codes as int8) or of 4-bit codes
// packed two to a byte, low nibble first (bits == 4).
template <bool Add>
void scale_levels_range(const uint8_t* codes, int bits, float shift, const float* steps, int64_t bucket,
                        int64_t first, int64_t stop_all, float* block) {
  for (int64_t i = first; i < stop_all;) {
    const int64_t stop = std::min(stop_all, i + (bucket - i % bucket));
    const float s = steps[i / bucket];
    if (bits == 8) {
      const int8_t* levels = reinterpret_cast<const int8_t*>(codes);
#pragma omp simd
      for (int64_t k = i; k < stop; ++k) {
        const float v = (static_cast<float>(levels[k]) - shift) * s;
        block[k - first] = Add ? block[k - first] + v : v;
      }
    } else {
#pragma omp simd
      for (int64_t k = i; k < stop; ++k) {
        const float v = (static_cast<float>((codes[k >> 1] >> ((k & 1) << 2)) & 0xf) - shift) * s;
        block[k - first] = Add ? block[k - first] + v : v;
      }
    }
    i = stop;
  }
}

// Whether a division by `divisor` is a multiplication by its inverse, exactly: a power of two.
inline bool exact_inverse(float divisor) {
  int exponent;
  return std::frexp(divisor, &exponent) == 0.5f;
}

// out[i] /= divisor for first <= i < stop (nothing when divisor is 1): the mean of the sums
// below, divided as torch divides.  By a power of two it multiplies by the inverse instead,
// which is exact and gives the same floats (a division costs ~10 multiplications here).
void divide_range(float* out, int64_t first, int64_t stop, float divisor) {
  if (divisor == 1.0f) return;
  if (exact_inverse(divisor)) {
    const float inverse = 1.0f / divisor;
#pragma omp simd
    for (int64_t k = first; k < stop; ++k) out[k] *= inverse;
  } else {
#pragma omp simd
    for (int64_t k = first; k < stop; ++k) out[k] /= divisor;
  }
}

// mc_codes_sum over the blocks [first, last) of Block elements, Per codes a byte (tables: 256 x
// Per per rank): each block summed in out, or for an output of STREAM_MIN elements or more in a
// cache-resident buffer then streamed to out.
template <int Per, int64_t Block = BLOCK>
void codes_sum_blocks(const uint8_t* const* packed, const float* tables, int ranks, int64_t n, float divisor,
                      float* out, int64_t first, int64_t last) {
  const bool stream = n >= STREAM_MIN;
  std::vector<float> sums(stream ? Block : 0);
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * Block, len = std::min(Block, n - start), full = len / Per;
    float* dst = stream ? sums.data() : out + start;
    for (int r = 0; r < ranks; ++r) {
      const uint8_t* src = packed[r] + start / Per;
      const float* table = tables + r * 256 * Per;
      for (int64_t j = 0; j < full; ++j) {
        const float* row = table + Per * src[j];
        float* d = dst + Per * j;
        if (r == 0) {
          std::memcpy(d, row, Per * sizeof(float));
        } else {
#pragma omp simd
          for (int k = 0; k < Per; ++k) d[k] += row[k];
        }
      }
      if (len > Per * full) {  // the last, partial byte
        const float* row = table + Per * src[full];
        for (int64_t k = Per * full; k < len; ++k) dst[k] = (r == 0 ? 0.0f : dst[k]) + row[k - Per * full];
      }
    }
    divide_range(dst, 0, len, divisor);
    if (stream) stream_out(dst, out + start, len, true);
  }
  stores_done();
}

#if defined(__AVX512F__)
// codes_sum_blocks<8> (1-bit codes) 16 elements at a time: each rank's bits, as a lane mask, pick
// between its two values (values + 2 r: code 0, code 1), summed in rank order in a register and
// divided as divide_range divides, then stored (streamed for an output of STREAM_MIN elements or
// more, 64-byte aligned): the same sums bit for bit, without a table row per byte and rank.
// With `vote` (values -1 and +1 for every rank, divisor 1) the sign of each sum is stored
// instead: the majority vote, +1, -1 or 0 (the sums of at most 255 votes are exact in fp32).
void sign_sum_blocks(const uint8_t* const* packed, const float* values, int ranks, int64_t n, float divisor,
                     float* out, int64_t first, int64_t last, bool vote = false) {
  const bool stream = n >= STREAM_MIN && (reinterpret_cast<uintptr_t>(out) & 63) == 0;
  const bool scale = divisor != 1.0f, by_inverse = exact_inverse(divisor);
  const __m512 inverse = _mm512_set1_ps(1.0f / divisor), divide = _mm512_set1_ps(divisor);
  // the sum of 16 elements from element i, `live` of them (their bits: whole bytes from i / 8)
  const auto sum = [&](int64_t i, __mmask16 live) {
    const int64_t byte = i / 8;
    const auto bits = [&](int r) {
      uint16_t m = packed[r][byte];
      if (live > 0xff) m |= static_cast<uint16_t>(packed[r][byte + 1]) << 8;
      return static_cast<__mmask16>(m & live);
    };
    __m512 acc = _mm512_mask_blend_ps(bits(0), _mm512_set1_ps(values[0]), _mm512_set1_ps(values[1]));
    for (int r = 1; r < ranks; ++r)
      acc = _mm512_add_ps(acc, _mm512_mask_blend_ps(bits(r), _mm512_set1_ps(values[2 * r]),
                                                    _mm512_set1_ps(values[2 * r + 1])));
    if (scale) acc = by_inverse ? _mm512_mul_ps(acc, inverse) : _mm512_div_ps(acc, divide);
    if (vote) {
      const __m512 zero = _mm512_setzero_ps();
      acc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(acc, zero, _CMP_GT_OQ),
                                 _mm512_mask_blend_ps(_mm512_cmp_ps_mask(acc, zero, _CMP_LT_OQ), zero,
                                                      _mm512_set1_ps(-1.0f)),
                                 _mm512_set1_ps(1.0f));
    }
    return acc;
  };
  const int64_t stop = std::min(n, last * BLOCK);
  int64_t i = first * BLOCK;
  for (; i + 16 <= stop; i += 16) {
    const __m512 acc = sum(i, 0xffff);
    if (stream) {
      _mm512_stream_ps(out + i, acc);
    } else {
      _mm512_storeu_ps(out + i, acc);
    }
  }
  if (i < stop) {  // the last few elements
    const __mmask16 live = static_cast<__mmask16>((1u << (stop - i)) - 1);
    _mm512_mask_storeu_ps(out + i, live, sum(i, live));
  }
  if (stream) stores_done();
}
#endif

// Writes the `len` (< 32 - at % 8) low bits of `bits` as bits at .. at + len - 1 of the packed
// stream out (bit j in byte j / 8, bit j % 8), leaving its other bits as they are.
void merge_bits(uint8_t* out, int64_t at, int64_t len, uint64_t bits) {
  const int shift = static_cast<int>(at % 8);
  const uint64_t mask = ((uint64_t{1} << len) - 1) << shift;
  bits <<= shift;
  uint8_t* dst = out + at / 8;
  for (int j = 0; 8 * j < shift + len; ++j) {
    const uint8_t m = static_cast<uint8_t>(mask >> (8 * j));
    dst[j] = static_cast<uint8_t>((dst[j] & ~m) | (static_cast<uint8_t>(bits >> (8 * j)) & m));
  }
}

// The sign code of one part of a group, as the group's gradients arrive one by one: the part is
// the group's elements [at, at + n), its bits go to bits at .. at + n - 1 of the group's packed
// signs `out`, the bits of the bytes it shares with its neighbours are left as they are, and
// stats are the part's.  code(first, len, bits, stats, whole) codes the part's elements
// [first, first + len) into the packed `bits` and their `stats`; the elements up to the next
// multiple of 16 and the last ones are coded on their own (whole false: into two bytes, merged
// here), so the rest starts on a whole byte of bits (and, in a 64-byte aligned group, on a
// 64-byte line of whatever the code writes).  Returns whether the part's sums are finite (a NaN
// or Inf in what was coded makes them not).
template <typename Code>
int signs_part(int64_t at, int64_t n, uint8_t* out, double* stats, Code code) {
  const int64_t head = std::min(n, (16 - at % 16) % 16), body = (n - head) / 16 * 16;
  stats[0] = stats[1] = stats[2] = 0;
  double part[3];
  const auto add = [&] {
    for (int j = 0; j < 3; ++j) stats[j] += part[j];
  };
  const auto edge = [&](int64_t first, int64_t len) {  // fewer than 16 elements of the part
    if (len == 0) return;
    uint8_t bits[2] = {0, 0};
    code(first, len, bits, part, false);
    merge_bits(out, at + first, len, bits[0] | static_cast<uint64_t>(bits[1]) << 8);
    add();
  };
  edge(0, head);
  if (body > 0) {
    code(head, body, out + (at + head) / 8, part, true);
    add();
  }
  edge(head + body, n - head - body);
  return std::isfinite(stats[0]) && std::isfinite(stats[1]);
}

}  // namespace

// scan(start, len, hits) for each block of BLOCK elements, which appends the block's hits
// (ascending) to its own list; the blocks run in parallel and their lists come back in block
// order.
template <typename Hit, typename Scan>
std::vector<std::vector<Hit>> scanned_by_block(int64_t n, int threads, Scan scan) {
  std::vector<std::vector<Hit>> found((n + BLOCK - 1) / BLOCK);
  std::vector<Hit>* lists = found.data();
  // Captures by value: a worker reading the caller's stack would share its cache lines.
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) scan(b * BLOCK, std::min(BLOCK, n - b * BLOCK), lists[b]);
  });
  return found;
}

// take(i) for the elements i < n whose byte mark(start, len, m) sets in m[i - start] for their
// block of BLOCK elements (mark may write other outputs of the block; take runs right after it,
// while the block is in cache), collected one list per block, ascending; the blocks run in
// parallel.
template <typename Hit, typename Mark, typename Take>
std::vector<std::vector<Hit>> marked_by_block(int64_t n, int threads, Mark mark, Take take) {
  return scanned_by_block<Hit>(n, threads, [=](int64_t start, int64_t len, std::vector<Hit>& hits) {
    thread_local std::vector<uint8_t> mask(BLOCK + 8);
    uint8_t* m = mask.data();
    mark(start, len, m);
    std::fill(m + len, m + len + 8, 0);
    // Scan the 0/1 bytes a word at a time: most words are zero when few elements pass.
    for (int64_t w = 0; w < len; w += 8) {
      uint64_t word;
      std::memcpy(&word, m + w, 8);
      while (word) {
        hits.push_back(take(start + w + __builtin_ctzll(word) / 8));
        word &= word - 1;
      }
    }
  });
}

#if defined(__AVX2__)
// The elements i in [start, start + len) (len <= BLOCK) with |c| >= threshold, c = x[i] (r null)
// or x[i] + r[i]: hits gets take(i) for each, ascending, right after out[i] = c is written for
// every element (take may read and change it).  Returns the largest exponent field of the
// elements of x (all ones: one is NaN or Inf); with `cleared` (x itself) each element of x is
// zeroed once read.  Eight elements at a time, into a bit per element
// (marked_by_block's bytes cost twice the time: 970 K elements, 1.3 % passing, 0.4 against 1.0
// ms on an AMD EPYC); the loop calls nothing, so its vectors stay in registers.
template <typename Hit, typename Take>
uint32_t above_avx2(const float* x, const float* r, int64_t start, int64_t len, float threshold, float* out,
                    std::vector<Hit>& hits, Take take, float* cleared = nullptr) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 bound = _mm256_set1_ps(threshold);
  const __m256i exponent_field = _mm256_set1_epi32(0x7f800000);
  __m256i exponents = _mm256_setzero_si256();
  alignas(8) uint8_t passed[BLOCK / 8 + 8] = {};  // bit j of byte k: element start + 8 k + j
  const int64_t body = len / 8 * 8;
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 xs = _mm256_loadu_ps(x + start + k);
    const __m256 c = r ? _mm256_add_ps(xs, _mm256_loadu_ps(r + start + k)) : xs;
    exponents = _mm256_max_epu32(exponents, _mm256_and_si256(_mm256_castps_si256(xs), exponent_field));
    passed[k / 8] = static_cast<uint8_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(c, magnitude), bound, _CMP_GE_OQ)));
    if (out) _mm256_storeu_ps(out + start + k, c);
    if (cleared) _mm256_storeu_ps(cleared + start + k, _mm256_setzero_ps());
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), exponents);
  uint32_t exponent = *std::max_element(lanes, lanes + 8);
  for (int64_t k = body; k < len; ++k) {
    const float c = r ? x[start + k] + r[start + k] : x[start + k];
    uint32_t bits;
    std::memcpy(&bits, x + start + k, 4);
    exponent = std::max(exponent, bits & 0x7f800000u);
    passed[k / 8] |= static_cast<uint8_t>((std::fabs(c) >= threshold) << (k % 8));
    if (out) out[start + k] = c;
    if (cleared) cleared[start + k] = 0.0f;
  }
  int64_t count = 0;
  for (int64_t w = 0; w < len; w += 64) {
    uint64_t word;
    std::memcpy(&word, passed + w / 8, 8);
    count += __builtin_popcountll(word);
  }
  hits.reserve(hits.size() + count);
  for (int64_t w = 0; w < len; w += 64) {  // a word of 64 elements at a time: most are zero
    uint64_t word;
    std::memcpy(&word, passed + w / 8, 8);
    for (; word; word &= word - 1) hits.push_back(take(start + w + __builtin_ctzll(word)));
  }
  return exponent;
}
#endif

// What compensated_above_impl scans: c = x, c = x + r (the residual memory), or DGC's momentum
// correction u' = m * u + x (written to u_out, which may be u), c = r + u' (r: the velocity).
enum class Source { kPlain, kSum, kMomentum };

// A candidate of the scan: its index, compensated value and (DGC) corrected momentum.
struct Candidate {
  int64_t i;
  float c, u;
};

// Top-k's scan of the compensated gradient c (see Source) with its memory, in one pass:
// out[i] = c for every element, then for the first `capacity` elements with |c| >= threshold
// (ascending) idx[j] = i, val[j] = c and out[i] = 0; with momentum also uval[j] = u_out[i] and
// u_out[i] = 0 where c != 0 (DGC's momentum factor masking, undone by mc_keep_largest for the
// candidates not sent).  Returns how many elements passed (more than `capacity`: the rest keep
// out[i] = c and u_out[i]).  out may be r.  finite (null: not checked) gets 0 when an element of
// x is NaN or Inf and is left as it is otherwise; the scan's other outputs then mean nothing.
// cleared (x itself, or null) gets zeros in every element once the scan has read it: the
// zeroed output a sparse decode scatters into, written while x's lines are in cache.
template <Source S>
int64_t compensated_above_impl(const float* x, const float* r, const float* u, float momentum, float* u_out,
                               int64_t n, float threshold, float* out, int64_t* idx, float* val, float* uval,
                               int64_t capacity, int* finite, float* cleared, int threads) {
  std::atomic<int> all_finite{1};
  std::atomic<int>* const flag = &all_finite;  // captured by value, as the pointers below
  const bool check = finite != nullptr;
  std::vector<std::vector<Candidate>> found;
#if defined(__AVX2__)
  if constexpr (S != Source::kMomentum) {
    found = scanned_by_block<Candidate>(n, threads, [=](int64_t start, int64_t len, std::vector<Candidate>& hits) {
      const uint32_t exponent = above_avx2(x, S == Source::kSum ? r : nullptr, start, len, threshold, out, hits,
                                           [=](int64_t i) {
                                             const Candidate hit{i, out[i], 0.0f};
                                             out[i] = 0.0f;
                                             return hit;
                                           },
                                           cleared);
      if (check && exponent == 0x7f800000u) flag->store(0, std::memory_order_relaxed);
    });
  } else  // DGC's momentum: the marked scan
#endif
  found = marked_by_block<Candidate>(
      n, threads,
      [=](int64_t start, int64_t len, uint8_t* m) {
#pragma omp simd
        for (int64_t k = 0; k < len; ++k) {
          const int64_t i = start + k;
          float c = x[i];
          if (S == Source::kSum) c += r[i];
          if (S == Source::kMomentum) {
            const float corrected = momentum * u[i] + c;  // rounded twice: no contraction (-ffp-contract=off)
            u_out[i] = corrected;
            c = r[i] + corrected;
          }
          out[i] = c;
          m[k] = std::fabs(c) >= threshold;
        }
        if (check) {
          // the largest exponent field of the block's x (still in cache): all ones for NaN or Inf
          const uint32_t* const bits = reinterpret_cast<const uint32_t*>(x + start);
          uint32_t exponent = 0;
#pragma omp simd reduction(max : exponent)
          for (int64_t k = 0; k < len; ++k) exponent = std::max(exponent, bits[k] & 0x7f800000u);
          if (exponent == 0x7f800000u) flag->store(0, std::memory_order_relaxed);
        }
        if (cleared) std::fill(cleared + start, cleared + start + len, 0.0f);
      },
      [=](int64_t i) {
        const Candidate hit{i, out[i], S == Source::kMomentum ? u_out[i] : 0.0f};
        out[i] = 0.0f;
        if (S == Source::kMomentum && hit.c != 0.0f) u_out[i] = 0.0f;
        return hit;
      });
  int64_t count = 0;
  for (const auto& hits : found) {
    for (const Candidate& hit : hits) {
      if (count < capacity) {
        idx[count] = hit.i;
        val[count] = hit.c;
        if (S == Source::kMomentum) uval[count] = hit.u;
      } else {  // no room: as if it had not passed
        out[hit.i] = hit.c;
        if (S == Source::kMomentum) u_out[hit.i] = hit.u;
      }
      ++count;
    }
  }
  if (finite && !all_finite.load()) *finite = 0;
  return count;
}

// The rank-th smallest (0: the smallest) of `bits` (magnitudes' bit patterns, which order as the
// magnitudes do; NaN's above Inf's), by a radix select on digits of 11, 11 and 10 bits, the most
// significant first: a histogram of the digit finds the bucket holding that rank, and only that
// bucket's elements are kept (moved to the front of `bits`, which is scratch) for the next digit.
// The histogram fits in L1, so a call over a few elements costs little more than their count.
static uint32_t kth_bits(std::vector<uint32_t>& bits, int64_t rank) {
  std::array<int64_t, 1 << 11> histogram;
  int64_t live = static_cast<int64_t>(bits.size());
  uint32_t found = 0;
  for (const int shift : {21, 10, 0}) {
    const uint32_t mask = shift == 0 ? 0x3ffu : 0x7ffu;
    histogram.fill(0);
    for (int64_t j = 0; j < live; ++j) ++histogram[(bits[j] >> shift) & mask];
    uint32_t bucket = 0;
    while (rank >= histogram[bucket]) rank -= histogram[bucket++];
    found |= bucket << shift;
    if (shift == 0) break;
    int64_t kept = 0;
    for (int64_t j = 0; j < live; ++j) {  // without a branch: whether one is kept is not predictable
      const uint32_t b = bits[j];
      bits[kept] = b;
      kept += ((b >> shift) & mask) == bucket;
    }
    live = kept;
  }
  return found;
}

// The magnitude of rank `rank` (0: the smallest) among |val[0..count)| (kth_bits).
static float kth_magnitude(const float* val, int64_t count, int64_t rank) {
  std::vector<uint32_t> bits(count);
  for (int64_t j = 0; j < count; ++j) {
    std::memcpy(&bits[j], &val[j], 4);
    bits[j] &= 0x7fffffffu;
  }
  const uint32_t found = kth_bits(bits, rank);
  float kth;
  std::memcpy(&kth, &found, 4);
  return kth;
}

extern "C" {

// Runs the kernels' threads on an OpenMP runtime already in the process: its GOMP_parallel,
// omp_get_thread_num and omp_get_num_threads (all null: threads of our own).
// A child forked after the runtime's threads ran would wait for threads it does not have (so
// would torch's operators there): the kernels take threads of their own in a child.
void mc_use_openmp(void* parallel, void* thread_num, void* num_threads) {
  static const bool registered = pthread_atfork(nullptr, nullptr, [] { omp_parallel = nullptr; }) == 0;
  omp_parallel = registered ? reinterpret_cast<OmpParallel>(parallel) : nullptr;
  omp_thread = reinterpret_cast<OmpIndex>(thread_num);
  omp_threads = reinterpret_cast<OmpIndex>(num_threads);
}

int mc_abi_version() { return 36; }

// Stochastic rounding of scaled, clamped values to small integer codes:
//   code[i] = floor(clamp(x[i] * scales[i / bucket], lo, hi) + u_i) + shift
// with u_i = (r + 0.5) / 2**16, r a 16-bit draw from hash(seed, i / 2) (two draws per hash),
// so E[code] = clamp(...) + shift to within 2**-17.  bits == 8 writes int8 codes to `out`
// (n bytes); bits in {1, 2, 4} packs them (codes must lie in [0, 2**bits)).
void mc_stochastic_codes(const float* x, int64_t n, const float* scales, int64_t bucket,
                         float lo, float hi, float shift, uint64_t seed, int bits, uint8_t* out,
                         int threads) {
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    std::vector<uint32_t> draws;
    std::vector<uint8_t> codes(bits == 8 ? 0 : BLOCK);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, len = std::min(BLOCK, n - start);
      int8_t* dst = bits == 8 ? reinterpret_cast<int8_t*>(out + start)
                              : reinterpret_cast<int8_t*>(codes.data());
      round_range(x, start, len, scales, bucket, lo, hi, shift, seed, draws, dst);
      if (bits != 8) {
        const int64_t per = 8 / bits, padded = (len + per - 1) / per * per;
        std::fill(codes.begin() + len, codes.begin() + padded, 0);
        pack_codes(codes.data(), padded, bits, out + start / per);
      }
    }
  });
}

// mc_stochastic_codes' codes (in {0, 1, 2}: TernGrad's) packed five to a byte in base 3
// (c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4, ceil(n / 5) bytes), the same draws element by element.
void mc_stochastic_trits(const float* x, int64_t n, const float* scales, int64_t bucket, float lo, float hi,
                         float shift, uint64_t seed, uint8_t* out, int threads) {
  parallel_for((n + TRIT_BLOCK - 1) / TRIT_BLOCK, TRIT_BLOCK, threads, [=](int64_t first, int64_t last) {
    std::vector<uint32_t> draws;
    std::vector<uint8_t> codes(TRIT_BLOCK);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * TRIT_BLOCK, len = std::min(TRIT_BLOCK, n - start), bytes = (len + 4) / 5;
      round_range(x, start, len, scales, bucket, lo, hi, shift, seed, draws, reinterpret_cast<int8_t*>(codes.data()));
      std::fill(codes.begin() + len, codes.begin() + bytes * 5, 0);
      uint8_t* dst = out + start / 5;
      for (int64_t k = 0; k < bytes; ++k) {
        const uint8_t* c = codes.data() + 5 * k;
        dst[k] = static_cast<uint8_t>(c[0] + 3 * (c[1] + 3 * (c[2] + 3 * (c[3] + 3 * c[4]))));
      }
    }
  });
}

// QSGD's encode in one pass over memory: for each bucket of `bucket` elements (the last may be
// shorter), norms[b] = its L2 norm (summed in fp64, stored as fp32) and the level
//   l[i] = floor(levels * x[i] / norms[b] + u_i)   (0 where the norm is 0)
// with the draws of mc_stochastic_codes.  bits == 8 writes l as int8 (n bytes of `out`); bits
// == 4 (levels <= 7) packs l + levels two to a byte, low nibble first (ceil(n / 2) bytes).  A
// bucket is read twice, the second time from cache when it is small (QSGD's default 512).
void mc_qsgd_encode(const float* x, int64_t n, int64_t bucket, int levels, uint64_t seed, int bits,
                    uint8_t* out, float* norms, int threads) {
  const int64_t buckets = (n + bucket - 1) / bucket;
  int64_t per_unit = std::max<int64_t>(1, BLOCK / bucket);  // buckets per unit of work
  if (bits == 4 && per_unit * bucket % 2) per_unit *= 2;     // units start on whole bytes
  const float top = static_cast<float>(levels), shift = bits == 8 ? 0.0f : top;
  parallel_for((buckets + per_unit - 1) / per_unit, per_unit * bucket, threads,
               [=](int64_t first, int64_t last) {
    std::vector<uint32_t> draws;
    std::vector<uint8_t> codes(bits == 8 ? 0 : per_unit * bucket + 1);
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t b0 = unit * per_unit, b1 = std::min(buckets, b0 + per_unit);
      const int64_t unit_start = b0 * bucket, unit_len = std::min(n, b1 * bucket) - unit_start;
      int8_t* dst = reinterpret_cast<int8_t*>(bits == 8 ? out + unit_start : codes.data());
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * bucket, len = std::min(bucket, n - start);
        const float* src = x + start;
        double squares = 0;
#pragma omp simd reduction(+ : squares)
        for (int64_t k = 0; k < len; ++k) squares += static_cast<double>(src[k]) * src[k];
        const float norm = static_cast<float>(std::sqrt(squares));
        norms[b] = norm;
        round_run(src, draw16(start, len, seed, draws), len, norm > 0 ? top / norm : 0.0f, -top,
                  top, shift, dst + (start - unit_start));
      }
      if (bits == 4) {
        codes[unit_len] = 0;  // the padding nibble of an odd tail
        pack_codes(codes.data(), unit_len + unit_len % 2, 4, out + unit_start / 2);
      }
    }
  });
}

// out[i] = (sum over the ranks r of (codes_r[i] - shift) * steps_r[i / bucket]) / divisor:
// every rank's QSGD decode summed in rank order (rank r's steps at steps + r * per_rank), one
// pass over out (each block summed in place, or for an output of STREAM_MIN elements or more in a
// cache-resident buffer then streamed to out).  One rank with divisor 1 is QSGD's decode of one
// payload.
void mc_levels_sum(const uint8_t* const* codes, int ranks, int64_t n, int bits, float shift, const float* steps,
                   int64_t per_rank, int64_t bucket, float divisor, float* out, int threads) {
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    const bool stream = n >= STREAM_MIN;
    std::vector<float> sums(stream ? BLOCK : 0);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, stop = std::min(n, start + BLOCK);
      float* block = stream ? sums.data() : out + start;
      scale_levels_range<false>(codes[0], bits, shift, steps, bucket, start, stop, block);
      for (int r = 1; r < ranks; ++r)
        scale_levels_range<true>(codes[r], bits, shift, steps + r * per_rank, bucket, start, stop, block);
      divide_range(block, 0, stop - start, divisor);
      if (stream) stream_out(block, out + start, stop - start, true);
    }
    stores_done();
  });
}

// Packs the sign bits x[i] >= 0 (1 bit per element, as mergecomp.codecs.pack_signs) into
// out (ceil(n / 8) bytes) and writes stats = {sum of the x >= 0, sum of the x < 0, count of
// x >= 0}.
void mc_pack_signs(const float* x, int64_t n, uint8_t* out, double* stats, int threads) {
  pack_signs_impl<Input::kPlain>(x, nullptr, 0.0f, 0.0f, 0.0f, nullptr, n, out, stats, threads);
}

// pack_signs_impl of the compensated gradient (mc_compensated_signs) for each case of r and keep;
// with neither and not `sums`, only the bits and whether x is finite (signSGD's code).
void compensated_signs_impl(const float* x, const float* r, float negative, float positive, float* keep,
                            int64_t n, uint8_t* out, double* stats, bool stream_keep, int threads, bool sums = true) {
  if (r == nullptr && keep == nullptr && !sums) {
    pack_signs_impl<Input::kPlain, false, false>(x, r, 0.0f, 0.0f, 0.0f, keep, n, out, stats, threads);
  } else if (r == nullptr && keep == nullptr) {
    pack_signs_impl<Input::kPlain>(x, r, 0.0f, 0.0f, 0.0f, keep, n, out, stats, threads);
  } else if (r == nullptr) {
    pack_signs_impl<Input::kPlain, true>(x, r, 0.0f, 0.0f, 0.0f, keep, n, out, stats, threads, stream_keep);
  } else if (keep == nullptr) {
    pack_signs_impl<Input::kCarried>(x, r, negative, positive, 0.0f, keep, n, out, stats, threads);
  } else {
    pack_signs_impl<Input::kCarried, true>(x, r, negative, positive, 0.0f, keep, n, out, stats, threads,
                                           stream_keep);
  }
}

// mc_pack_signs of the compensated gradient v = x + (r - (r >= 0 ? positive : negative)), each
// difference and sum rounded to fp32 (r null: v = x): with negative = positive = 0, x plus the
// residual r; else r holds the step before's compensated gradient and its residual is r less
// its two-valued sign decode.  keep (may be null, may be r) receives v; a large one (read again
// only at the next step) is written past the cache.
void mc_compensated_signs(const float* x, const float* r, float negative, float positive, float* keep,
                          int64_t n, uint8_t* out, double* stats, int threads) {
  compensated_signs_impl(x, r, negative, positive, keep, n, out, stats, n >= STREAM_MIN, threads);
}

// mc_compensated_signs of one part of a group (signs_part; x, r and keep point at the part's
// first element).  stream_keep: keep is written past the cache.  Without `sums` (r and keep
// null: signSGD's code) the stats only tell whether x is finite (see sign_block).
int mc_compensated_signs_part(const float* x, const float* r, float negative, float positive, float* keep,
                              int64_t at, int64_t n, uint8_t* out, double* stats, int stream_keep, int sums,
                              int threads) {
  return signs_part(at, n, out, stats, [&](int64_t first, int64_t len, uint8_t* bits, double* part, bool whole) {
    compensated_signs_impl(x + first, r == nullptr ? nullptr : r + first, negative, positive,
                           keep == nullptr ? nullptr : keep + first, len, bits, part, whole && stream_keep != 0,
                           whole ? threads : 1, sums != 0);
  });
}

// Signum's step for one part of a group (signs_part; x, m and keep point at the part's first
// element): keep = m + weight * (x - m) (keep may be m: in place), and its sign bits; the stats
// only tell whether keep is finite (see sign_block).  stream_keep: keep is written past the
// cache.
int mc_momentum_signs_part(const float* x, const float* m, float weight, float* keep, int64_t at, int64_t n,
                           uint8_t* out, double* stats, int stream_keep, int threads) {
  return signs_part(at, n, out, stats, [&](int64_t first, int64_t len, uint8_t* bits, double* part, bool whole) {
    pack_signs_impl<Input::kMomentum, true, false>(x + first, m + first, 0.0f, 0.0f, weight, keep + first, len, bits,
                                                   part, whole ? threads : 1, whole && stream_keep != 0);
  });
}

// Signum's step: m = m + weight * (x - m) in place, then mc_pack_signs of m.
void mc_momentum_signs(const float* x, float* m, float weight, int64_t n, uint8_t* out,
                       double* stats, int threads) {
  pack_signs_impl<Input::kMomentum, true>(x, m, 0.0f, 0.0f, weight, m, n, out, stats, threads);
}

// The residual error feedback keeps after a two-valued sign code of v was sent (1-bit SGD,
// EF-SignSGD): out[i] = v[i] - (v[i] >= 0 ? positive : negative), v less its sign decode (the
// bits are not read).  out may be v (updated in place).
void mc_sign_residual(const float* v, int64_t n, float negative, float positive, float* out, int threads) {
  parallel_elements(n, threads, [=](int64_t i) { out[i] = v[i] - (v[i] >= 0.0f ? positive : negative); });
}

// The majority vote of `voters` (1..255) packed sign-bit streams of n elements each:
// out[i] = +1 if more than half voted +, -1 if fewer, 0 on a tie.  On AVX-512 the votes are
// added as -1 and +1 in registers (sign_sum_blocks); else counted in one byte per element,
// eight elements per 64-bit add.
void mc_majority_vote(const uint8_t* const* packed, int voters, int64_t n, float* out, int threads) {
#if defined(__AVX512F__)
  std::vector<float> votes(2 * static_cast<size_t>(voters));
  for (int v = 0; v < voters; ++v) votes[2 * v] = -1.0f, votes[2 * v + 1] = 1.0f;
  const float* values = votes.data();
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    sign_sum_blocks(packed, values, voters, n, 1.0f, out, first, last, true);
  });
#else
  const uint64_t* expand = EXPAND.data();
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    std::vector<uint64_t> counts(BLOCK / 8);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, len = std::min(BLOCK, n - start), bytes = (len + 7) / 8;
      uint64_t* c = counts.data();
      std::fill(c, c + bytes, 0);
      for (int v = 0; v < voters; ++v) {
        const uint8_t* src = packed[v] + start / 8;
        for (int64_t j = 0; j < bytes; ++j) c[j] += expand[src[j]];
      }
      const uint8_t* count = reinterpret_cast<const uint8_t*>(c);
      float* dst = out + start;
#pragma omp simd
      for (int64_t k = 0; k < len; ++k) {
        const int twice = 2 * count[k];
        dst[k] = static_cast<float>((twice > voters) - (twice < voters));
      }
    }
  });
#endif
}

// out[i] = (sum over the ranks r of values_r[code_r(i)]) / divisor: each rank's n packed
// `bits`-bit codes (1, 2 or 4) decoded through its own 2**bits values (values + r * 2**bits),
// summed in rank order, one pass over out (1-bit SGD's and EF-SignSGD's signs, TernGrad's
// codes).  Each rank's values are spread into a 256-row table of what a byte decodes to first;
// a block of out stays in cache while the ranks add up.  1-bit codes on AVX-512: sign_sum_blocks.
void mc_codes_sum(const uint8_t* const* packed, int bits, const float* values, int ranks, int64_t n,
                  float divisor, float* out, int threads) {
#if defined(__AVX512F__)
  if (bits == 1) {
    parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
      sign_sum_blocks(packed, values, ranks, n, divisor, out, first, last);
    });
    return;
  }
#endif
  const int per = 8 / bits;
  std::vector<float> tables(static_cast<size_t>(ranks) * 256 * per);
  for (int r = 0; r < ranks; ++r) spread_table(values + (r << bits), bits, tables.data() + r * 256 * per);
  const float* t = tables.data();
  if (bits == 1) {
    parallel_blocks(n, threads, [=](int64_t first, int64_t last) { codes_sum_blocks<8>(packed, t, ranks, n, divisor, out, first, last); });
  } else if (bits == 2) {
    parallel_blocks(n, threads, [=](int64_t first, int64_t last) { codes_sum_blocks<4>(packed, t, ranks, n, divisor, out, first, last); });
  } else {
    parallel_blocks(n, threads, [=](int64_t first, int64_t last) { codes_sum_blocks<2>(packed, t, ranks, n, divisor, out, first, last); });
  }
}

// n base-3 codes of each rank, five to a byte (c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4), decoded through
// its own 3 values (values + 3 r), summed in rank order and divided: one pass over out, as
// mc_codes_sum (TernGrad's packing="base3").
void mc_trits_sum(const uint8_t* const* packed, const float* values, int ranks, int64_t n, float divisor,
                  float* out, int threads) {
  std::vector<float> tables(static_cast<size_t>(ranks) * 256 * 5, 0.0f);  // bytes above 242: unused
  for (int r = 0; r < ranks; ++r)
    for (int byte = 0; byte < 243; ++byte)
      for (int j = 0, rest = byte; j < 5; ++j, rest /= 3) tables[(r * 256 + byte) * 5 + j] = values[3 * r + rest % 3];
  const float* t = tables.data();
  parallel_for((n + TRIT_BLOCK - 1) / TRIT_BLOCK, TRIT_BLOCK, threads, [=](int64_t first, int64_t last) {
    codes_sum_blocks<5, TRIT_BLOCK>(packed, t, ranks, n, divisor, out, first, last);
  });
}

// out[0, n) = 0, streamed above STREAM_MIN elements (stream_out): the dense output a sparse
// decode scatters into.
void mc_zero_fill(float* out, int64_t n, int threads) {
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    std::vector<float> zeros(BLOCK, 0.0f);
    for (int64_t b = first; b < last; ++b)
      stream_out(zeros.data(), out + b * BLOCK, std::min(BLOCK, n - b * BLOCK), n >= STREAM_MIN);
    stores_done();
  });
}

// Low-rank products written in one pass: out_b[i, j] = x_b[i, j] - sum_k p_b[i, k] * qt_b[k, j]
// (x null: the sum alone) for each of `count` matrices b of m x n elements, k < r, the products
// added in k order and each product, sum and difference rounded on its own (with r = 1, as
// torch's mm and sub round them).  p: count x m x r, qt: count x r x n (each Q transposed),
// both contiguous; x_b and out_b: row-major m x n fp32 matrices `stride` elements apart (the
// equally spaced matrices of one shape in a merged group); out may be x.  With `stream` (the
// caller's choice: the matrices are part of a group of STREAM_MIN elements or more, read only
// later) out is written by non-temporal stores (stream_out), so a decoded matrix costs its
// write and, with x, one read.
void mc_low_rank(const float* p, const float* qt, int64_t count, int64_t m, int64_t n, int r, const float* x,
                 float* out, int64_t stride, int stream, int threads) {
  constexpr int64_t kRun = 1024;  // elements of a row worked out in a cache-resident buffer
  parallel_for(count * m, n, threads, [=](int64_t first, int64_t last) {
    float run[kRun];
    for (int64_t row = first; row < last; ++row) {
      const int64_t b = row / m, i = row % m;
      const float* pi = p + row * r;
      const float* qb = qt + b * r * n;
      const int64_t at = b * stride + i * n;
      for (int64_t j0 = 0; j0 < n; j0 += kRun) {
        const int64_t len = std::min(kRun, n - j0);
        const float p0 = pi[0];
        const float* q0 = qb + j0;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) run[j] = p0 * q0[j];
        for (int k = 1; k < r; ++k) {
          const float pk = pi[k];
          const float* qk = qb + k * n + j0;
#pragma omp simd
          for (int64_t j = 0; j < len; ++j) run[j] += pk * qk[j];
        }
        if (x != nullptr) {
          const float* xi = x + at + j0;
#pragma omp simd
          for (int64_t j = 0; j < len; ++j) run[j] = xi[j] - run[j];
        }
        stream_out(run, out + at + j0, len, stream != 0);
      }
    }
    if (stream) stores_done();
  });
}

// The indices i (ascending) with |x[i]| >= threshold: writes the first `capacity` of them to
// out and returns how many there are (call again with a larger out if that is > capacity).
int64_t mc_indices_above(const float* x, int64_t n, float threshold, int64_t* out,
                         int64_t capacity, int threads) {
#if defined(__AVX2__)
  const auto found = scanned_by_block<int64_t>(n, threads, [=](int64_t start, int64_t len, std::vector<int64_t>& hits) {
    above_avx2(x, nullptr, start, len, threshold, nullptr, hits, [](int64_t i) { return i; });
  });
#else
  const auto found = marked_by_block<int64_t>(
      n, threads,
      [=](int64_t start, int64_t len, uint8_t* m) {
        const float* src = x + start;
#pragma omp simd
        for (int64_t k = 0; k < len; ++k) m[k] = std::fabs(src[k]) >= threshold;
      },
      [](int64_t i) { return i; });
#endif
  int64_t count = 0;
  for (const auto& hits : found) {
    const int64_t take = std::max<int64_t>(0, std::min<int64_t>(hits.size(), capacity - count));
    std::copy(hits.begin(), hits.begin() + take, out + count);
    count += hits.size();
  }
  return count;
}

// stats = {min x, max x, sum of (x - mean)^2} in one pass (n >= 1), in fp64.  Each block sums
// d = x - s and d^2, s its first element; its squared deviations are sum d^2 - (sum d)^2 / len,
// where (sum d)^2 / len = len (mean - s)^2 <= len * (the result): at most about 15 (log2 BLOCK)
// of the 53 bits cancel however large the mean (sum x^2 - (sum x)^2 / n can lose them all).
// The blocks are combined in block order with Chan et al.'s update.  With AVX-512 a block is
// summed in 4 x 8 fp64 lanes (a single sum would wait on the latency of each add).
void mc_moments(const float* x, int64_t n, double* stats, int threads) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<double> partial(4 * blocks);  // per block: min, max, mean, squared deviations
  double* p = partial.data();
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, len = std::min(BLOCK, n - start);
      const float* src = x + start;
      const double shift = src[0];
      float low = src[0], high = src[0];
      double sum = 0, squares = 0;
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 lows = _mm512_set1_ps(low), highs = lows;
      const __m512d origin = _mm512_set1_pd(shift);
      __m512d sums[4], squared[4];
      for (int j = 0; j < 4; ++j) sums[j] = squared[j] = _mm512_setzero_pd();
      for (; k + 32 <= len; k += 32) {
        for (int h = 0; h < 2; ++h) {
          const __m512 v = _mm512_loadu_ps(src + k + 16 * h);
          lows = _mm512_min_ps(v, lows);  // v < low ? v : low, as std::min(low, v)
          highs = _mm512_max_ps(v, highs);
          const __m512d d0 = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), origin);
          const __m512d d1 = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)), origin);
          sums[2 * h] = _mm512_add_pd(sums[2 * h], d0);
          sums[2 * h + 1] = _mm512_add_pd(sums[2 * h + 1], d1);
          squared[2 * h] = _mm512_add_pd(squared[2 * h], _mm512_mul_pd(d0, d0));
          squared[2 * h + 1] = _mm512_add_pd(squared[2 * h + 1], _mm512_mul_pd(d1, d1));
        }
      }
      low = _mm512_reduce_min_ps(lows);
      high = _mm512_reduce_max_ps(highs);
      for (int j = 0; j < 4; ++j) {
        sum += _mm512_reduce_add_pd(sums[j]);
        squares += _mm512_reduce_add_pd(squared[j]);
      }
#endif
#pragma omp simd reduction(min : low) reduction(max : high) reduction(+ : sum, squares)
      for (int64_t j = k; j < len; ++j) {
        const float v = src[j];
        low = std::min(low, v);
        high = std::max(high, v);
        const double d = static_cast<double>(v) - shift;
        sum += d;
        squares += d * d;
      }
      p[4 * b] = low;
      p[4 * b + 1] = high;
      p[4 * b + 2] = shift + sum / static_cast<double>(len);
      p[4 * b + 3] = std::max(0.0, squares - sum * sum / static_cast<double>(len));
    }
  });
  double count = 0, mean = 0, squares = 0;
  stats[0] = p[0]; stats[1] = p[1];
  for (int64_t b = 0; b < blocks; ++b) {
    stats[0] = std::min(stats[0], p[4 * b]);
    stats[1] = std::max(stats[1], p[4 * b + 1]);
    const double len = static_cast<double>(std::min(BLOCK, n - b * BLOCK)), total = count + len;
    const double delta = p[4 * b + 2] - mean;
    mean += delta * (len / total);
    squares += p[4 * b + 3] + delta * delta * (count * len / total);
    count = total;
  }
  stats[2] = squares;
}

// dst = src * scale (n floats; scale 1: a copy); returns 1 when every element of dst is finite
// (no NaN or Inf), else 0.  stream != 0: dst is written past the cache (non-temporal stores).
int mc_copy_finite(const float* src, float* dst, int64_t n, float scale, int stream, int threads) {
  if (scale == 1.0f) return copy_finite_impl<false>(src, scale, dst, n, stream != 0, threads);
  return copy_finite_impl<true>(src, scale, dst, n, stream != 0, threads);
}

// dst = src rounded to fp16 (to nearest, ties to even, as torch's cast; n elements); returns 1
// when every element of dst is finite, 0 when one is NaN or Inf (a finite src beyond fp16's
// range rounds to Inf), -1 when this build has no F16C conversion (nothing written).
int mc_cast_half_finite(const float* src, uint16_t* dst, int64_t n, int threads) {
#if defined(__F16C__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<uint8_t> bad(blocks);
  uint8_t* flags = bad.data();
  parallel_blocks(n, threads, [=](int64_t first, int64_t last) {
    const __m128i exponent = _mm_set1_epi16(0x7c00);
    for (int64_t b = first; b < last; ++b) {
      const int64_t start = b * BLOCK, len = std::min(BLOCK, n - start);
      const float* in = src + start;
      uint16_t* out = dst + start;
      __m128i nonfinite = _mm_setzero_si128();
      int64_t k = 0;
      for (; k + 8 <= len; k += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + k), kRound);
        nonfinite = _mm_or_si128(nonfinite, _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), h);
      }
      uint32_t any = _mm_movemask_epi8(nonfinite) != 0;
      for (; k < len; ++k) {
        const uint16_t h = _cvtss_sh(in[k], kRound);
        any |= (h & 0x7c00u) == 0x7c00u;
        out[k] = h;
      }
      flags[b] = static_cast<uint8_t>(any);
    }
  });
  return std::none_of(bad.begin(), bad.end(), [](uint8_t f) { return f != 0; }) ? 1 : 0;
#else
  (void)src, (void)dst, (void)n, (void)threads;
  return -1;
#endif
}

// The scan above of c = x (r and u null), x + r (u null) or, with u, DGC's r + (m * u + x)
// with u_out receiving m * u + x.
int64_t mc_compensated_above(const float* x, const float* r, const float* u, float momentum, float* u_out,
                             int64_t n, float threshold, float* out, int64_t* idx, float* val, float* uval,
                             int64_t capacity, int* finite, float* cleared, int threads) {
  if (u) {
    return compensated_above_impl<Source::kMomentum>(x, r, u, momentum, u_out, n, threshold, out, idx, val, uval,
                                                     capacity, finite, cleared, threads);
  }
  return r ? compensated_above_impl<Source::kSum>(x, r, u, momentum, u_out, n, threshold, out, idx, val, uval,
                                                  capacity, finite, cleared, threads)
           : compensated_above_impl<Source::kPlain>(x, r, u, momentum, u_out, n, threshold, out, idx, val, uval,
                                                    capacity, finite, cleared, threads);
}

// Of `count` candidates (idx ascending, val their values; 0 < k <= count), keeps the k largest
// |val| (of equal ones, the first) at the front of idx and val, in ascending order; each other
// one goes back where the scan above took it from: out[idx] = val, and with u_out,
// u_out[idx] = uval (its momentum, unmasked).  out null: nothing goes back.
void mc_keep_largest(int64_t* idx, float* val, const float* uval, int64_t count, int64_t k, float* out,
                     float* u_out) {
  const float kth = kth_magnitude(val, count, count - k);
  int64_t ties = k;
  for (int64_t j = 0; j < count; ++j) ties -= std::fabs(val[j]) > kth;
  // Without a branch (whether a candidate is kept is not predictable): each is written to the
  // front and, with its momentum, to the list of those going back, and only one list advances.
  const bool put_back = out != nullptr;
  std::vector<int64_t> back_idx(put_back ? count - k + 1 : 1);
  std::vector<float> back_val(back_idx.size()), back_uval(u_out ? back_idx.size() : 1);
  int64_t kept = 0, back = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t i = idx[j];
    const float v = val[j], a = std::fabs(v);
    const bool tie = a == kth && ties > 0;
    const bool take = a > kth || tie;
    ties -= tie;
    idx[kept] = i;
    val[kept] = v;
    kept += take;
    if (put_back) {
      back_idx[back] = i;
      back_val[back] = v;
      if (u_out) back_uval[back] = uval[j];
      back += !take;
    }
  }
  for (int64_t b = 0; b < back; ++b) {
    out[back_idx[b]] = back_val[b];
    if (u_out) u_out[back_idx[b]] = back_uval[b];
  }
}

// Top-k of a group with fewer than k nonzero elements, all of them among the `count` candidates
// (idx ascending, val their values; every other element of out is a zero, +0 or -0): the
// candidates and the first k - count other elements, in ascending order, into kept_idx and
// kept_val (k each), those others' values read from out and then zeroed there.
void mc_with_first_zeros(const int64_t* idx, const float* val, int64_t count, int64_t k, float* out,
                         int64_t* kept_idx, float* kept_val) {
  int64_t missing = k - count, p = 0, i = 0;
  for (int64_t w = 0; w < k; ++i) {
    if (p < count && idx[p] == i) {
      kept_idx[w] = i;
      kept_val[w++] = val[p++];
    } else if (missing > 0) {
      kept_idx[w] = i;
      kept_val[w++] = out[i];
      out[i] = 0.0f;
      --missing;
    } else {
      i = idx[p] - 1;  // no zeros left to take: on to the next candidate
    }
  }
}

// Top-k's sampled threshold: the rank-th largest (1: the largest) of |c| over the elements
// c = x[i] (+ r[i] where r is given) at i = 0, stride, 2 stride, ... < n, as torch's
// (r[::stride] + x[::stride]).abs().topk(rank).values.min() gives it (the same float: the sum
// rounded once; NaN where the sample holds one, which topk ranks first and min propagates).
// 1 <= rank <= the sample's size.
float mc_sampled_threshold(const float* x, const float* r, int64_t n, int64_t stride, int64_t rank) {
  const int64_t count = (n + stride - 1) / stride;
  std::vector<uint32_t> bits(count);
  uint32_t largest = 0;
  for (int64_t j = 0; j < count; ++j) {
    const float c = r ? r[j * stride] + x[j * stride] : x[j * stride];
    std::memcpy(&bits[j], &c, 4);
    bits[j] &= 0x7fffffffu;
    largest = std::max(largest, bits[j]);
  }
  if (largest > 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t found = kth_bits(bits, count - rank);
  float threshold;
  std::memcpy(&threshold, &found, 4);
  return threshold;
}

// The momentum exchange's elementwise steps (frameworks/torch/momentum_exchange.py): Adam with
// its variance v frozen between refreshes, the momentum sent divided by d = sqrt(v) + eps.  Each
// runs over a merged group at once, its tensors as segments (offsets as in parallel_segments)
// each with its own constants (a segment not active: a tensor without Adam state), in one pass
// where torch's operators make three to six per tensor; every product, quotient and sum is
// rounded on its own in torch's order (an fma where torch's add with alpha is one) and the
// square root correctly (torch's CPU square root is not: the paths agree to an ulp or so).

// In place over g = wire, m = momentum, v = variance: g = (((g * mix + m * weight) / (sqrt(v) +
// eps)) * c) with `divide`, else g = fma(m, weight, g * mix) * c (torch's g.mul_(mix).add_(m,
// alpha=weight).mul_(c)); zeros where not active.  A value beyond segment s's limit (+Inf: none)
// becomes the limit with its sign.  Returns whether every value, before the limit, is finite
// (no NaN or Inf).
int mc_momentum_to_wire_segments(float* wire, const float* momentum, const float* variance, const int64_t* offsets,
                                 int64_t segments, const float* mix, const float* weight, const float* eps,
                                 const float* c, const float* limit, const uint8_t* active, int divide,
                                 int threads) {
  std::atomic<int> finite{1};
  std::atomic<int>* const flag = &finite;  // captured by value: the loops keep their pointers in registers
  parallel_segments(offsets, segments, threads, [=](int64_t s, int64_t start, int64_t stop) {
    float* const g = wire;  // locals: the loops below keep the pointers in registers and vectorize
    const float* const m = momentum;
    const float* const v = variance;
    if (!active[s]) {
      std::fill(g + start, g + stop, 0.0f);
      return;
    }
    const float a = mix[s], b = weight[s], e = eps[s], k = c[s], l = limit[s];
    int unfinite = 0;  // set once a value is NaN or Inf
    if (divide) {
#pragma omp simd reduction(| : unfinite)
      for (int64_t i = start; i < stop; ++i) {
        const float mixed = g[i] * a + m[i] * b;
        const float x = (mixed / (std::sqrt(v[i]) + e)) * k;
        g[i] = std::fabs(x) > l ? std::copysign(l, x) : x;
        unfinite |= !(std::fabs(x) <= FLT_MAX);
      }
    } else {
#pragma omp simd reduction(| : unfinite)
      for (int64_t i = start; i < stop; ++i) {
        const float x = std::fma(m[i], b, g[i] * a) * k;
        g[i] = std::fabs(x) > l ? std::copysign(l, x) : x;
        unfinite |= !(std::fabs(x) <= FLT_MAX);
      }
    }
    if (unfinite) flag->store(0, std::memory_order_relaxed);
  });
  return finite.load();
}

// In place over x = wire, the average of what mc_momentum_to_wire_segments sent: x = (x / c) *
// (sqrt(v) + eps) with `divide` (x / c without, or where not active), then, where active and
// weight is not 0, x = fma(m, weight, x) (torch's x.add_(m, alpha=weight)).
void mc_momentum_from_wire_segments(float* wire, const float* momentum, const float* variance,
                                    const int64_t* offsets, int64_t segments, const float* c, const float* eps,
                                    const float* weight, const uint8_t* active, int divide, int threads) {
  parallel_segments(offsets, segments, threads, [=](int64_t s, int64_t start, int64_t stop) {
    float* const x = wire;  // locals, as in mc_momentum_to_wire_segments
    const float* const m = momentum;
    const float* const v = variance;
    const float k = c[s], e = eps[s], w = active[s] ? weight[s] : 0.0f;
    if (divide && active[s]) {
#pragma omp simd
      for (int64_t i = start; i < stop; ++i) x[i] = (x[i] / k) * (std::sqrt(v[i]) + e);
    } else if (k != 1.0f) {
#pragma omp simd
      for (int64_t i = start; i < stop; ++i) x[i] = x[i] / k;
    }
    if (w != 0.0f) {
#pragma omp simd
      for (int64_t i = start; i < stop; ++i) x[i] = std::fma(m[i], w, x[i]);
    }
  });
}

// mc_frozen_adam_update over the active segments, segment s's parameter at params[s] (its
// elements in the group's order): m = g; p = p * keep + step * (g / (sqrt(v) / k + eps)).
void mc_frozen_adam_segments(float* const* params, const float* grad, float* momentum, float* variance,
                             const int64_t* offsets, int64_t segments, const float* keep, const float* k,
                             const float* eps, const float* step, const float* inv_bound2, const uint8_t* active,
                             int threads) {
  parallel_segments(offsets, segments, threads, [=](int64_t s, int64_t start, int64_t stop) {
    const float* const g = grad;  // locals, as in mc_momentum_to_wire_segments
    float* const m = momentum;
    float* const v = variance;
    if (!active[s]) return;
    float* const p = params[s] + (start - offsets[s]);  // p[j]: element start + j
    const float kp = keep[s], kk = k[s], e = eps[s], st = step[s], ib = inv_bound2[s];
    const int64_t len = stop - start;
    const float* const gs = g + start;
    float* const ms = m + start;
    float* const vs = v + start;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float gi = gs[j];
      const float floor = gi * gi * ib;  // Adam's own bound: v >= (m / B)^2
      const float vi = vs[j] < floor ? floor : vs[j];
      ms[j] = gi;
      vs[j] = vi;
      p[j] = p[j] * kp + st * (gi / (std::sqrt(vi) / kk + e));
    }
  });
}

}  // extern "C"

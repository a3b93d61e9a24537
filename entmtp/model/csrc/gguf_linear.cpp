// Linear layers on GGUF's Q4_1 and Q8_0 blocks, repacked once at load, in two arithmetics.
//
// The packed layout (`gguf.pack` writes it; G = 16 output columns a group, B = K / 32 blocks):
//   Q4_1  q uint8 [groups, B, 4, 64]: byte 4c + i of chunk j holds column c's inputs 4j + i (low
//         nibble) and 16 + 4j + i (high nibble) of the block, so one 64-byte load gives, for 16
//         columns at once, 4 consecutive inputs each (and, shifted, the 4 that are 16 further on);
//         d, m fp16 [groups, B, 16]: the GGUF's own scales and minimums, per column.
//   Q8_0  q uint8 [groups, B, 8, 64]: byte 4c + i of chunk j holds column c's input 4j + i as
//         w + 128 (w ^ 0x80); d fp16 [groups, B, 16].
// Columns past the layer's last (a partial group) hold zero weights and scales.
//
// float32 (`linear_f32`, arithmetic kF32, or kQ8Small and a call of more than kQ8MaxRows rows): a
// weight row is dequantised (w = d * q + m for Q4_1, w = d * q for Q8_0; the multiply and the add
// rounded separately, as gguf-py's numpy dequantisation computes them, so exactly the values of
// the float32 model the loader made from the same file) into a buffer in L1, then dotted with
// every input row.
//
// Q8 inputs (`linear_q8`), llama.cpp's arithmetic: each input row is quantised in blocks of 32 to
// int8 with a scale (d = max|x| / 127, q = x / d rounded to nearest even, s = d * sum q). Block b
// of output c then contributes
//     acc = fma(float(isum), d_w * d_x, acc)            isum = sum of q_w * q_x, an exact int32
//     acc = fma(m_w, s_x, acc)                          (Q4_1 only: its minimum term)
// with the blocks in order from acc = 0: one fixed floating-point finish per output. The integer
// sums are exact whichever instructions form them (AVX2 maddubs/madd, AVX-512 VNNI vpdpbusd, the
// scalar reference), and the finish is the same IEEE operations in the same order in every path
// (built without contraction), so an output's bits depend neither on the number of rows in the call
// nor on the instruction set that ran. `isa` picks the path: 0 the scalar reference (std::fma, the
// tests' oracle), 1 AVX2, 2 AVX-512 VNNI; `isas()` says which this CPU can run.
//
// In both arithmetics each output is computed alone, whichever thread computes it, so a row's
// result never depends on the batch it is in: a tree verification of N tokens computes what N
// single-token steps would.
#include "gguf_linear.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGroup = 16;      // output columns a packed group
constexpr int64_t kQ8MaxRows = 64;  // kQ8Small: larger calls compute in float32
// Weights are streamed from memory once a call. While a tile computes, the groups kAheadGroups
// further on are fetched into L2 (the first row tile of a group only; later ones find its
// weights cached): on the 2-core AMD EPYC Zen 4 the model's 120 linears took 5.1 -> 4.5 ms for
// one row and 7.7 -> 6.6 ms for five. A prefetch reads nothing into any result.
constexpr int64_t kAheadGroups = 4;

inline float half_to_float(const at::Half* p) { return static_cast<float>(*p); }  // exact

// ---- the packed matrices ---------------------------------------------------------------------

struct Packed {
  const uint8_t* q;
  const at::Half *d, *m;  // m: nullptr for Q8_0
  int64_t N, K, blocks, groups;
  int64_t chunks;  // 64-byte chunks a (group, block): 4 for Q4_1, 8 for Q8_0
  inline const uint8_t* chunk(int64_t g, int64_t b, int64_t j) const { return q + ((g * blocks + b) * chunks + j) * 64; }
  inline const at::Half* scale(const at::Half* s, int64_t g, int64_t b) const { return s + (g * blocks + b) * kGroup; }
};

// Block b of group g's packed values and scales fetched into L2 (nothing past the last group).
inline void prefetch_block(const Packed& P, int64_t g, int64_t b) {
  if (g >= P.groups) return;
  for (int64_t j = 0; j < P.chunks; ++j) _mm_prefetch(reinterpret_cast<const char*>(P.chunk(g, b, j)), _MM_HINT_T1);
  if ((b & 1) == 0) {  // a block's 16 scales are 32 bytes: one line holds two blocks'
    _mm_prefetch(reinterpret_cast<const char*>(P.scale(P.d, g, b)), _MM_HINT_T1);
    if (P.m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(P.scale(P.m, g, b)), _MM_HINT_T1);
  }
}

// ---- float32 arithmetic (dequantised weights) ------------------------------------------------

// Q4_1 block: 16 bytes of nibbles; byte j holds element j (low nibble) and element j + 16 (high).
// Its 32 weights, w = d * q + m, as four 8-lane vectors.
inline void block_q4_1(__m128i bytes, float d, float m, __m256 w[4]) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
  __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  w[0] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))), vm);
  w[1] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))), vm);
  w[2] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))), vm);
  w[3] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))), vm);
}

// Q8_0 block: 32 signed bytes, w = d * q.
inline void block_q8_0(const int8_t* qs, float d, __m256 w[4]) {
  __m256 vd = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
    w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
}

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 4 input bytes broadcast to every 32-bit lane, straight from memory (vpbroadcastd m32).
inline __m256i bcast256(const uint8_t* p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
inline __m512i bcast512(const uint8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// Block b of output n, gathered back into the GGUF's own byte order from the packed layout.
struct Q41Blocks {
  Packed P;
  inline void block(int64_t n, int64_t b, __m256 w[4]) const {
    const int64_t g = n / kGroup, c = n % kGroup;
    const __m128i bytes = _mm_setr_epi32(load4(P.chunk(g, b, 0) + 4 * c), load4(P.chunk(g, b, 1) + 4 * c),
                                         load4(P.chunk(g, b, 2) + 4 * c), load4(P.chunk(g, b, 3) + 4 * c));
    block_q4_1(bytes, half_to_float(P.scale(P.d, g, b) + c), half_to_float(P.scale(P.m, g, b) + c), w);
  }
};

struct Q80Blocks {
  Packed P;
  inline void block(int64_t n, int64_t b, __m256 w[4]) const {
    const int64_t g = n / kGroup, c = n % kGroup;
    alignas(32) int8_t qs[kBlock];
    for (int j = 0; j < 8; ++j) {
      const int32_t v = load4(P.chunk(g, b, j) + 4 * c) ^ static_cast<int32_t>(0x80808080u);
      std::memcpy(qs + 4 * j, &v, 4);
    }
    block_q8_0(qs, half_to_float(P.scale(P.d, g, b) + c), w);
  }
};

// Row n dequantised into w (K floats).
template <typename Blocks>
inline void dequant(const Blocks& B, int64_t n, int64_t blocks, float* w) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4];
    B.block(n, b, v);
    for (int i = 0; i < 4; ++i) _mm256_store_ps(w + b * kBlock + 8 * i, v[i]);
  }
}

// y[r * N + c] = x[r] . w[c] for R input rows and C dequantised weight rows (w: C rows of K, stride K).
// One 8-lane accumulator per output, the K inputs in slices of 8 in order, then a fixed lane sum.
template <int R, int C>
inline void tile(const float* w, const float* x, int64_t K, float* y, int64_t N) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_load_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + c] = hsum(acc[r][c]);
}

// M input rows in groups of R, then the 1-3 left: tile(std::integral_constant<int, rows>, first row).
template <int R, typename Tile>
inline void row_groups(int64_t M, Tile&& tile) {
  int64_t r = 0;
  for (; r + R <= M; r += R) tile(std::integral_constant<int, R>{}, r);
  switch (M - r) {
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// M input rows in as few tiles of at most R as row_groups, the rows spread evenly over them (5
// rows: 3 + 2, not 4 + 1): a tile of one row keeps few integer sums in flight and waits on their
// latency, so an uneven tail cost nearly as much as a whole tile. A tile only regroups rows.
template <int R, typename Tile>
inline void even_rows(int64_t M, Tile&& tile) {
  static_assert(R == 4, "even_rows: tiles of up to 4 rows");
  const int64_t tiles = (M + R - 1) / R;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t left = tiles - t, rows = (M - r + left - 1) / left;
    switch (rows) {
      case 4: tile(std::integral_constant<int, 4>{}, r); break;
      case 3: tile(std::integral_constant<int, 3>{}, r); break;
      case 2: tile(std::integral_constant<int, 2>{}, r); break;
      default: tile(std::integral_constant<int, 1>{}, r); break;
    }
    r += rows;
  }
}

// R input rows against C weight rows at a time: R * C accumulators in flight hide the FMA latency
// (one 8-lane accumulator per output, so the tile shape never changes a result).
template <int C>
inline void panel(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  constexpr int R = C >= 8 ? 1 : C >= 4 ? 2 : 4;  // at most 12 accumulators plus C weight slices in registers
  row_groups<R>(M, [&](auto rows, int64_t r) { tile<decltype(rows)::value, C>(w, x + r * K, K, y + r * N, N); });
}

// Weight rows are dequantised a panel at a time (4 rows for one or two input rows, else 3) into a
// buffer that stays in L1, then every input row of a chunk is dotted with them. A prompt's rows go
// in chunks of about kChunkBytes, so the chunk stays in L2 while every panel passes over it. A
// chunk only regroups rows; each output's sum is unchanged.
constexpr int64_t kChunkBytes = 256 * 1024;

template <typename Blocks>
void linear_f32(const float* xp, int64_t M, int64_t N, int64_t K, const Blocks& B, float* yp) {
  const int64_t C = M <= 2 ? 4 : 3, panels = (N + C - 1) / C, blocks = K / kBlock;
  const int64_t chunk = std::max<int64_t>(16, kChunkBytes / (K * static_cast<int64_t>(sizeof(float))));
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t rows = std::min(chunk, M - r0);
    const float* xc = xp + r0 * K;
    float* yc = yp + r0 * N;
    at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
      alignas(64) float w[4 * kMaxIn];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * C, c = std::min(C, N - n);
        for (int64_t j = 0; j < c; ++j) dequant(B, n + j, blocks, w + j * K);
        switch (c) {
          case 4: panel<4>(w, xc, rows, K, yc + n, N); break;
          case 3: panel<3>(w, xc, rows, K, yc + n, N); break;
          case 2: panel<2>(w, xc, rows, K, yc + n, N); break;
          default: panel<1>(w, xc, rows, K, yc + n, N); break;
        }
      }
    });
  }
}

// ---- Q8 inputs -------------------------------------------------------------------------------

// Input rows as int8 blocks of 32: values q [M, K]; per block the scale d, s = d * sum(q), and
// sum(q) itself (the Q8_0 kernels' correction for their weights' +128 offset).
struct Q8Rows {
  at::Tensor storage, scales, sums;
  const int8_t* q;
  const float *d, *s;
  const int32_t* sum;
  int64_t blocks;
};

// One block of 32 inputs quantised: q (32 int8), its scale d; returns sum(q). The scalar code
// (the reference path's) and the vector code round alike: amax the same maximum, 127 / amax and
// x * that each rounded once, then to nearest-even (nearbyint in the default mode), the same bits.
inline int32_t block_scalar(const float* p, int8_t* q, float* d) {
  float amax = 0.f;
  for (int t = 0; t < kBlock; ++t) amax = std::max(amax, std::fabs(p[t]));
  const float inv = amax != 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int t = 0; t < kBlock; ++t) {
    q[t] = static_cast<int8_t>(std::nearbyint(p[t] * inv));
    sum += q[t];
  }
  *d = amax / 127.f;
  return sum;
}

inline int32_t block_avx2(const float* p, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], mx = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(p + 8 * j);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
  __m256i n[4];
  for (int j = 0; j < 4; ++j)
    n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = amax / 127.f;
  return _mm_cvtsi128_si32(s4);
}

// n blocks of 32 inputs from x (rows are contiguous, so block i of the whole input): values q, per
// block the scale d, s = d * sum(q) and sum(q).
inline void quantize_blocks(const float* x, int64_t n, bool vector, int8_t* q, float* d, float* s, int32_t* sum) {
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = vector ? block_avx2(x + i * kBlock, q + i * kBlock, d + i) : block_scalar(x + i * kBlock, q + i * kBlock, d + i);
    s[i] = d[i] * static_cast<float>(sum[i]);
  }
}

// Every block of M rows of K inputs (`vector`: 8 lanes at a time; the scalar reference keeps the
// scalar code, and the tests compare the two paths' outputs bit for bit).
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, const at::TensorOptions& options, bool vector) {
  const int64_t blocks = K / kBlock;
  auto storage = at::empty({M, K}, options.dtype(at::kChar));
  auto scales = at::empty({2, M, blocks}, options.dtype(at::kFloat));
  auto sums = at::empty({M, blocks}, options.dtype(at::kInt));
  int8_t* qp = storage.data_ptr<int8_t>();
  float* dp = scales.data_ptr<float>();
  float* sp = dp + M * blocks;
  int32_t* np = sums.data_ptr<int32_t>();
  quantize_blocks(x, M * blocks, vector, qp, dp, sp, np);
  return {storage, scales, sums, qp, dp, sp, np, blocks};
}

// The finish of one output over its blocks, given the exact integer block sums (scalar reference).
template <bool kMin>
inline float finish_scalar(const int32_t* isum, const Packed& P, int64_t n, const Q8Rows& A, int64_t r) {
  const int64_t g = n / kGroup, c = n % kGroup;
  float acc = 0.f;
  for (int64_t b = 0; b < P.blocks; ++b) {
    const int64_t ab = r * A.blocks + b;
    acc = std::fma(static_cast<float>(isum[b]), half_to_float(P.scale(P.d, g, b) + c) * A.d[ab], acc);
    if (kMin) acc = std::fma(half_to_float(P.scale(P.m, g, b) + c), A.s[ab], acc);
  }
  return acc;
}

// The scalar reference: every product and sum written out, from the packed bytes.
template <bool kQ41>
void q8_scalar(const Packed& P, const Q8Rows& A, int64_t M, float* y) {
  at::parallel_for(0, P.N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<int32_t> isum(P.blocks);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t g = n / kGroup, c = n % kGroup;
      for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < P.blocks; ++b) {
          const int8_t* x = A.q + (r * A.blocks + b) * kBlock;
          int32_t s = 0;
          for (int64_t j = 0; j < P.chunks; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = P.chunk(g, b, j)[4 * c + i];
              if (kQ41) {
                s += static_cast<int32_t>(byte & 0x0F) * x[4 * j + i];
                s += static_cast<int32_t>(byte >> 4) * x[16 + 4 * j + i];
              } else {
                s += (static_cast<int32_t>(byte) - 128) * x[4 * j + i];
              }
            }
          isum[b] = s;
        }
        y[r * P.N + n] = finish_scalar<kQ41>(isum.data(), P, n, A, r);
      }
    }
  });
}

// ---- AVX2: 16 columns as two 8-lane halves ---------------------------------------------------

// One group's outputs for R rows from r0: per block, per half h, an int32 sum per column, then the
// finish in lanes. Q4_1: maddubs of the nibbles (0..15) with the inputs (-127..127), whose int16
// pairs stay within 16 * 15 * 127 = 30480 over a whole block, so they add in int16 and one madd
// per block widens them. Q8_0: the weights' signs moved onto the inputs (|w| * sign(x, w), each
// int16 pair within 2 * 127 * 127), one madd per chunk.
template <int R, bool kQ41>
inline void group_avx2(const Packed& P, const Q8Rows& A, int64_t g, int64_t r0, float* y, bool prefetch) {
  const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < P.blocks; ++b) {
    if (prefetch) prefetch_block(P, g + kAheadGroups, b);
    __m256i isum[R][2];
    if (kQ41) {
      __m256i s16[R][2];
      for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const uint8_t* ch = P.chunk(g, b, j);
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32 * h));
          lo[h] = _mm256_and_si256(v, nib);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* x = A.q + ((r0 + r) * A.blocks + b) * kBlock;
          const __m256i xl = bcast256(reinterpret_cast<const uint8_t*>(x + 4 * j));
          const __m256i xh = bcast256(reinterpret_cast<const uint8_t*>(x + 16 + 4 * j));
          for (int h = 0; h < 2; ++h) {
            s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(lo[h], xl));
            s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(hi[h], xh));
            // Each sum made here, in this order: left free, GCC reassociates a block's 32 integer
            // adds, forms every product first and spills them (AVX2 has 16 registers); pinned, a
            // tile of 4 rows runs ~10% faster (AMD EPYC Zen 4). The sums are exact either way.
            asm("" : "+x"(s16[r][h]));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_madd_epi16(s16[r][h], ones);
    } else {
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const uint8_t* ch = P.chunk(g, b, j);
        __m256i w[2], aw[2];
        for (int h = 0; h < 2; ++h) {
          w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32 * h)), flip);
          aw[h] = _mm256_abs_epi8(w[h]);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* x = A.q + ((r0 + r) * A.blocks + b) * kBlock;
          const __m256i xv = bcast256(reinterpret_cast<const uint8_t*>(x + 4 * j));
          for (int h = 0; h < 2; ++h)
            isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xv, w[h])), ones));
        }
      }
    }
    const at::Half* dh = P.scale(P.d, g, b);
    __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh))),
                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dh + 8)))};
    __m256 mw[2];
    if (kQ41) {
      const at::Half* mh = P.scale(P.m, g, b);
      mw[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh)));
      mw[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mh + 8)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * A.blocks + b;
      const __m256 dx = _mm256_set1_ps(A.d[ab]);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(dw[h], dx), acc[r][h]);
        if (kQ41) acc[r][h] = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(A.s[ab]), acc[r][h]);
      }
    }
  }
  const int64_t cols = std::min(kGroup, P.N - g * kGroup);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kGroup];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::copy(out, out + cols, y + (r0 + r) * P.N + g * kGroup);
  }
}

template <bool kQ41>
void q8_avx2(const Packed& P, const Q8Rows& A, int64_t M, float* y) {
  at::parallel_for(0, P.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      even_rows<4>(M, [&](auto rows, int64_t r) { group_avx2<decltype(rows)::value, kQ41>(P, A, g, r, y, r == 0); });
  });
}

// ---- AVX-512 VNNI: 16 columns in one 16-lane vector ------------------------------------------

// Per block, vpdpbusd adds 4 products a lane: Q4_1 the nibbles (unsigned) with the inputs; Q8_0
// the weights + 128 (unsigned) with the inputs, less 128 * sum(q_x) after the block. Exact int32.
// A tile is V groups (16 columns each, one vector) by R rows: each input broadcast serves V
// vectors, each weight chunk R rows.
template <int R, int V, bool kQ41>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
inline void tile_vnni(const Packed& P, const Q8Rows& A, int64_t g, int64_t r0, float* y, bool prefetch) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t stride = A.blocks * kBlock;
  for (int64_t b = 0; b < P.blocks; ++b) {
    __m512i isum[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) isum[r][v] = _mm512_setzero_si512();
    const int8_t* x0 = A.q + (r0 * A.blocks + b) * kBlock;
    if (prefetch)
      for (int v = 0; v < V; ++v) prefetch_block(P, g + kAheadGroups + v, b);
    if (kQ41) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[V], hi[V];
        for (int v = 0; v < V; ++v) {
          const __m512i w = _mm512_loadu_si512(P.chunk(g + v, b, j));
          lo[v] = _mm512_and_si512(w, nib);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = reinterpret_cast<const uint8_t*>(x0 + r * stride);
          const __m512i xl = bcast512(x + 4 * j), xh = bcast512(x + 16 + 4 * j);
          for (int v = 0; v < V; ++v) {
            isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], lo[v], xl);
            isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], hi[v], xh);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i w[V];
        for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(P.chunk(g + v, b, j));
        for (int r = 0; r < R; ++r) {
          const __m512i xv = bcast512(reinterpret_cast<const uint8_t*>(x0 + r * stride + 4 * j));
          for (int v = 0; v < V; ++v) isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], w[v], xv);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i off = _mm512_set1_epi32(128 * A.sum[(r0 + r) * A.blocks + b]);
        for (int v = 0; v < V; ++v) isum[r][v] = _mm512_sub_epi32(isum[r][v], off);
      }
    }
    __m512 dw[V], mw[V];
    for (int v = 0; v < V; ++v) {
      dw[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.scale(P.d, g + v, b))));
      mw[v] = kQ41 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(P.scale(P.m, g + v, b)))) : _mm512_setzero_ps();
    }
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * A.blocks + b;
      const __m512 dx = _mm512_set1_ps(A.d[ab]), sx = _mm512_set1_ps(A.s[ab]);
      for (int v = 0; v < V; ++v) {
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), _mm512_mul_ps(dw[v], dx), acc[r][v]);
        if (kQ41) acc[r][v] = _mm512_fmadd_ps(mw[v], sx, acc[r][v]);
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t cols = std::min(kGroup, P.N - (g + v) * kGroup);
    const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * P.N + (g + v) * kGroup, keep, acc[r][v]);
  }
}

template <int V, bool kQ41>
inline void rows_vnni(const Packed& P, const Q8Rows& A, int64_t M, int64_t g, float* y) {
  even_rows<4>(M, [&](auto rows, int64_t r) { tile_vnni<decltype(rows)::value, V, kQ41>(P, A, g, r, y, r == 0); });
}

template <bool kQ41>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void q8_vnni(const Packed& P, const Q8Rows& A, int64_t M, float* y) {
  const int64_t pairs = (P.groups + 1) / 2;  // two groups a tile; an odd count ends with one
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (2 * p + 1 < P.groups)
        rows_vnni<2, kQ41>(P, A, M, 2 * p, y);
      else
        rows_vnni<1, kQ41>(P, A, M, 2 * p, y);
    }
  });
}

// ---- dispatch --------------------------------------------------------------------------------

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

bool can_run(int64_t isa) { return isa == kIsaScalar || (isa == kIsaAvx2 && cpu_has_avx2()) || (isa == kIsaVnni && cpu_has_vnni()); }

Packed packed(const at::Tensor& q, const at::Tensor& d, const c10::optional<at::Tensor>& m, int64_t N, int64_t chunks) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 4 && q.size(2) == chunks && q.size(3) == 64,
              "gguf linear: packed values must be uint8 [groups, blocks, ", chunks, ", 64]");
  const int64_t groups = q.size(0), blocks = q.size(1), K = blocks * kBlock;
  TORCH_CHECK(N > 0 && (N + kGroup - 1) / kGroup == groups, "gguf linear: ", N, " outputs do not fill ", groups, " groups of 16");
  auto check = [&](const at::Tensor& s, const char* what) {
    TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.numel() == groups * blocks * kGroup,
                "gguf linear: packed ", what, " must be float16 [groups, blocks, 16]");
  };
  check(d, "scales");
  if (m.has_value()) check(*m, "minimums");
  return {q.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.has_value() ? m->data_ptr<at::Half>() : nullptr, N, K, blocks, groups, chunks};
}

// M rows of Q8 inputs through P by instruction-set path `isa`.
void q8_products(const Packed& P, const Q8Rows& A, int64_t M, float* y, int64_t isa) {
  const bool q41 = P.m != nullptr;
  if (isa == kIsaVnni)
    q41 ? q8_vnni<true>(P, A, M, y) : q8_vnni<false>(P, A, M, y);
  else if (isa == kIsaAvx2)
    q41 ? q8_avx2<true>(P, A, M, y) : q8_avx2<false>(P, A, M, y);
  else
    q41 ? q8_scalar<true>(P, A, M, y) : q8_scalar<false>(P, A, M, y);
}

at::Tensor linear(const at::Tensor& x_in, const Packed& P, int64_t q8, int64_t isa) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "gguf linear: float32 input expected");
  TORCH_CHECK(x_in.size(-1) == P.K, "gguf linear: input has ", x_in.size(-1), " features, the weight ", P.K);
  TORCH_CHECK(can_run(isa), "gguf linear: this CPU cannot run instruction-set path ", isa);
  auto x = x_in.reshape({-1, P.K}).contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, P.N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool q41 = P.m != nullptr;
  TORCH_CHECK(q8 >= kF32 && q8 <= kQ8Always, "gguf linear: arithmetic ", q8, " is none of 0 (float32), 1 (Q8 up to ", kQ8MaxRows,
              " rows), 2 (Q8 always)");
  if (q8 == kF32 || (q8 == kQ8Small && M > kQ8MaxRows)) {  // float32
    TORCH_CHECK(P.K <= kMaxIn, "gguf linear: float32 arithmetic takes at most ", kMaxIn, " inputs");
    if (q41)
      linear_f32(xp, M, P.N, P.K, Q41Blocks{P}, yp);
    else
      linear_f32(xp, M, P.N, P.K, Q80Blocks{P}, yp);
  } else {
    q8_products(P, quantize_rows(xp, M, P.K, x.options(), isa != kIsaScalar), M, yp, isa);
  }
  auto shape = x_in.sizes().vec();
  shape.back() = P.N;
  return y.view(shape);
}

// ---- the arithmetic limit -----------------------------------------------------------------

// 8-bit multiply-adds a second this CPU's path reaches on all threads with no memory traffic: 12
// independent accumulators (so latency never waits), each instruction 4 products a lane.
template <typename Step>
double peak_loop(int64_t iters, int64_t macs_per_step, Step&& step) {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) sink += step(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<double>(iters) * macs_per_step * at::get_num_threads() / s + 0.0 * sink.load();
}

int32_t peak_avx2(int64_t iters) {
  __m256i acc[12];
  for (auto& a : acc) a = _mm256_setzero_si256();
  const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
  __m256i wv[12];
  for (auto& v : wv) v = w;
  for (int64_t i = 0; i < iters; ++i)
    for (int k = 0; k < 12; ++k) {
      asm volatile("" : "+x"(wv[k]));  // opaque weights each round: no product is shared or folded out of the loop
      acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[k], x), ones));
    }
  __m256i s = acc[0];
  for (int k = 1; k < 12; ++k) s = _mm256_add_epi32(s, acc[k]);
  return _mm256_extract_epi32(s, 0);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
int32_t peak_vnni(int64_t iters) {
  __m512i acc[12];
  for (auto& a : acc) a = _mm512_setzero_si512();
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-5);
  __m512i wv = w;
  for (int64_t i = 0; i < iters; ++i) {
    asm volatile("" : "+v"(wv));
    for (auto& a : acc) a = _mm512_dpbusd_epi32(a, wv, x);
  }
  __m512i s = acc[0];
  for (int k = 1; k < 12; ++k) s = _mm512_add_epi32(s, acc[k]);
  return _mm512_reduce_add_epi32(s);
}

}  // namespace


double int8_peak(int64_t isa, int64_t iters) {
  TORCH_CHECK(isa == kIsaAvx2 || (isa == kIsaVnni && cpu_has_vnni()), "int8_peak: path ", isa, " is not timed here");
  if (isa == kIsaVnni) return peak_loop(iters, 12 * 64, [](int64_t n) { return peak_vnni(n); });
  return peak_loop(iters, 12 * 32, [](int64_t n) { return peak_avx2(n); });
}

std::vector<std::string> isas() {
  std::vector<std::string> out = {"scalar"};
  if (cpu_has_avx2()) out.push_back("avx2");
  if (cpu_has_vnni()) out.push_back("avx512_vnni");
  return out;
}

at::Tensor q4_1_linear(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, int64_t N, int64_t q8, int64_t isa) {
  return linear(x, packed(q, d, m, N, 4), q8, isa);
}

at::Tensor q8_0_linear(at::Tensor x, at::Tensor q, at::Tensor d, int64_t N, int64_t q8, int64_t isa) {
  return linear(x, packed(q, d, c10::nullopt, N, 8), q8, isa);
}

RowWeights row_weights(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t N) {
  const bool q41 = m.defined() && m.numel() > 0;
  const Packed P = packed(q, d, q41 ? c10::optional<at::Tensor>(m) : c10::nullopt, N, q41 ? 4 : 8);
  return {P.q, P.d, P.m, P.N, P.K};
}

void linear_row(const RowWeights& W, const float* x, float* y, int64_t isa) {
  TORCH_CHECK(W.K <= kRowMaxIn && W.K % kBlock == 0, "linear_row: ", W.K, " inputs (at most ", kRowMaxIn, ", whole blocks of 32)");
  const int64_t blocks = W.K / kBlock;
  const Packed P{W.q, W.d, W.m, W.N, W.K, blocks, (W.N + kGroup - 1) / kGroup, W.m != nullptr ? 4 : 8};
  // quantize_rows's blocks, on the stack
  alignas(64) int8_t q[kRowMaxIn];
  float d[kRowMaxIn / kBlock], s[kRowMaxIn / kBlock];
  int32_t sum[kRowMaxIn / kBlock];
  quantize_blocks(x, blocks, isa != kIsaScalar, q, d, s, sum);
  q8_products(P, Q8Rows{at::Tensor(), at::Tensor(), at::Tensor(), q, d, s, sum, blocks}, 1, y, isa);
}

void refine_row(const float* xs, float* z, int64_t N, int64_t K, const int8_t* q8, const at::Half* d8, const float* bias, int64_t k) {
  k = std::min(k, N);
  if (k <= 0) return;
  // the k largest, best first, an equal value after the earlier ones (as `head_top` keeps them)
  float val[kMaxRefine];
  int64_t at[kMaxRefine], kept = 0;
  for (int64_t i = 0; i < N; ++i) {
    const float v = z[i];
    if (!(v == v) || (kept == k && !(v > val[k - 1]))) continue;
    int64_t j = kept < k ? kept++ : k - 1;
    for (; j > 0 && val[j - 1] < v; --j) val[j] = val[j - 1], at[j] = at[j - 1];
    val[j] = v, at[j] = i;
  }
  // the input in Q8 blocks, as every Q8 product quantises it (the scalar and vector code agree bit for bit)
  TORCH_CHECK(K <= kRowMaxIn, "refine_row: at most ", kRowMaxIn, " inputs");
  const int64_t blocks = K / kBlock;
  int8_t xq[kRowMaxIn];
  float dx[kRowMaxIn / kBlock];
  for (int64_t b = 0; b < blocks; ++b) block_scalar(xs + b * kBlock, xq + b * kBlock, dx + b);
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t n = at[j];
    const int8_t* w = q8 + n * K;
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {  // finish_scalar's order and rounding: the Q8_0 product's own bits
      int32_t isum = 0;
      for (int64_t i = 0; i < kBlock; ++i) isum += static_cast<int32_t>(w[b * kBlock + i]) * xq[b * kBlock + i];
      acc = std::fma(static_cast<float>(isum), half_to_float(d8 + n * blocks + b) * dx[b], acc);
    }
    z[n] = bias != nullptr ? acc + bias[n] : acc;
  }
}

void lm_refine(at::Tensor xs, at::Tensor z, at::Tensor q8, at::Tensor d8, at::Tensor bias, int64_t k) {
  TORCH_CHECK(xs.scalar_type() == at::kFloat && z.scalar_type() == at::kFloat && xs.is_contiguous() && z.is_contiguous() && xs.dim() == 2 &&
                  z.dim() == 2 && xs.size(0) == z.size(0),
              "lm_refine: float32 inputs [M, K] and logits [M, N], contiguous");
  const int64_t M = xs.size(0), K = xs.size(1), N = z.size(1);
  TORCH_CHECK(K % kBlock == 0 && q8.scalar_type() == at::kChar && q8.is_contiguous() && q8.dim() == 2 && q8.size(0) == N && q8.size(1) == K,
              "lm_refine: the Q8_0 rows must be int8 [", N, ", ", K, "]");
  TORCH_CHECK(d8.scalar_type() == at::kHalf && d8.is_contiguous() && d8.numel() == N * (K / kBlock), "lm_refine: the Q8_0 scales must be float16 [N, K/32]");
  TORCH_CHECK(!bias.defined() || bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N),
              "lm_refine: the bias must be float32 [N] or empty");
  TORCH_CHECK(k >= 0 && k <= kMaxRefine, "lm_refine: 0 to ", kMaxRefine, " rows refined");
  const float* bp = bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < M; ++r)
    refine_row(xs.data_ptr<float>() + r * K, z.data_ptr<float>() + r * N, N, K, q8.data_ptr<int8_t>(), d8.data_ptr<at::Half>(), bp, k);
}

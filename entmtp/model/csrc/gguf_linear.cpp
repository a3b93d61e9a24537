// Linear layers that read GGUF's Q4_1 and Q8_0 blocks directly (AVX2 + FMA), in two arithmetics.
//
// float32 (`q4_1_linear`, `q8_0_linear`): a weight row is dequantised (w = d * q + m for Q4_1,
// w = d * q for Q8_0; the multiply and the add rounded separately, as gguf-py's numpy dequantisation
// computes them, so these are exactly the values of the float32 model the loader made from the same
// file) into a buffer in L1, then dotted with every input row.
//
// Q8 activations (`q4_1_linear_q8`), llama.cpp's arithmetic for Q4_1: each input row is quantised
// in blocks of 32 to int8 with a scale (d = max|x| / 127, q = x / d rounded to nearest even,
// s = d * sum q), and a block contributes d_w * d_x * sum(q_w * q_x), its integer sum exact, plus
// m_w * s_x. That is faster here for a few rows (no weight becomes a float) and slower for many,
// so a call of more than kQ8MaxRows rows (a prompt, never a decode step: no tree is that big)
// computes in float32 instead; which arithmetic a row gets depends on its call's size only.
//
// In both, each output element is summed in the same order whatever the number of input rows and
// whichever thread computes it, so a row's result never depends on the batch it is in: a tree
// verification of N tokens computes what N single-token steps would.
#include "gguf_linear.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <immintrin.h>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ8MaxRows = 64;  // larger calls compute in float32 (q4_1_linear_q8)

// Q4_1 block: 16 bytes of nibbles; byte j holds element j (low nibble) and element j + 16 (high).
// Its 32 weights, w = d * q + m, as four 8-lane vectors.
inline void block_q4_1(const uint8_t* qs, float d, float m, __m256 w[4]) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
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

// A matrix of blocks: the weights of block b of row n, the same values however they are used.
struct Q41 {
  const uint8_t* q;
  const float *d, *m;
  int64_t K, blocks;
  inline void block(int64_t n, int64_t b, __m256 w[4]) const {
    block_q4_1(q + n * (K / 2) + b * 16, d[n * blocks + b], m[n * blocks + b], w);
  }
};

struct Q80 {
  const int8_t* q;
  const float* d;
  int64_t K, blocks;
  inline void block(int64_t n, int64_t b, __m256 w[4]) const { block_q8_0(q + n * K + b * kBlock, d[n * blocks + b], w); }
};

// Row n dequantised into w (K floats).
template <typename Blocks>
inline void dequant(const Blocks& B, int64_t n, float* w) {
  for (int64_t b = 0; b < B.blocks; ++b) {
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

// R input rows against C weight rows at a time: R * C accumulators in flight hide the FMA latency
// (one 8-lane accumulator per output, so the tile shape never changes a result).
template <int C>
inline void panel(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  constexpr int R = C >= 8 ? 1 : C >= 4 ? 2 : 4;  // at most 12 accumulators plus C weight slices in registers
  row_groups<R>(M, [&](auto rows, int64_t r) { tile<decltype(rows)::value, C>(w, x + r * K, K, y + r * N, N); });
}

// Weight rows are dequantised a panel at a time (4 rows for one or two input rows, else 3) into a
// buffer that stays in L1, then every input row of a chunk is dotted with them. (Dequantising in
// registers and dotting straight away, without the buffer, measured slower here for one input row.)
// A prompt's rows go in chunks of about kChunkBytes, so the chunk stays in L2 while every panel
// passes over it: streaming all of a long prompt's rows from memory once per panel made a
// 300-token prompt memory-bound. A chunk only regroups rows; each output's sum is unchanged.
constexpr int64_t kChunkBytes = 256 * 1024;

template <typename Blocks>
torch::Tensor run(const torch::Tensor& x_in, int64_t N, int64_t K, const Blocks& B) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32, "gguf linear: float32 input expected");
  TORCH_CHECK(x_in.size(-1) == K, "gguf linear: input has ", x_in.size(-1), " features, the weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t C = M <= 2 ? 4 : 3, panels = (N + C - 1) / C;
  const int64_t chunk = std::max<int64_t>(16, kChunkBytes / (K * static_cast<int64_t>(sizeof(float))));
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t rows = std::min(chunk, M - r0);
    const float* xc = xp + r0 * K;
    float* yc = yp + r0 * N;
    at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
      alignas(64) float w[4 * 2048];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * C, c = std::min(C, N - n);
        for (int64_t j = 0; j < c; ++j) dequant(B, n + j, w + j * K);
        switch (c) {
          case 4: panel<4>(w, xc, rows, K, yc + n, N); break;
          case 3: panel<3>(w, xc, rows, K, yc + n, N); break;
          case 2: panel<2>(w, xc, rows, K, yc + n, N); break;
          default: panel<1>(w, xc, rows, K, yc + n, N); break;
        }
      }
    });
  }
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

void check_blocks(const torch::Tensor& scale, int64_t N, int64_t K) {
  TORCH_CHECK(K % kBlock == 0 && K <= 2048, "gguf linear: in_features must be a multiple of 32, at most 2048");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == N * (K / kBlock),
              "gguf linear: scales must be float32 [out, in / 32]");
}

}  // namespace

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, blocks = K / kBlock;
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous(), "gguf linear: Q4_1 nibbles must be uint8 [out, in / 2]");
  check_blocks(d, N, K);
  check_blocks(m, N, K);
  return run(x, N, K, Q41{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K, blocks});
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  const int64_t N = qs.size(0), K = qs.size(1), blocks = K / kBlock;
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous(), "gguf linear: Q8_0 values must be int8 [out, in]");
  check_blocks(d, N, K);
  return run(x, N, K, Q80{qs.data_ptr<int8_t>(), d.data_ptr<float>(), K, blocks});
}

// ---- Q8 activations ------------------------------------------------------------------------

namespace {

// Input rows as int8 blocks of 32: values q [M, K], scales d and d * sum(q) s [M, K / 32] each.
struct Q8Rows {
  torch::Tensor storage, scales;
  const int8_t* q;
  const float *d, *s;
  int64_t blocks;
};

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, const torch::TensorOptions& options) {
  const int64_t blocks = K / kBlock;
  auto storage = torch::empty({M, K}, options.dtype(torch::kInt8));
  auto scales = torch::empty({2, M, blocks}, options.dtype(torch::kFloat32));
  int8_t* qp = storage.data_ptr<int8_t>();
  float* dp = scales.data_ptr<float>();
  float* sp = dp + M * blocks;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < M * blocks; ++i) {
    const float* p = x + i * kBlock;  // rows are contiguous, so block i of the whole input
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(p + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4), d = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    __m256i n[4];
    for (int j = 0; j < 4; ++j)
      n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i * kBlock), _mm256_permutevar8x32_epi32(bytes, order));
    dp[i] = d;
    sp[i] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
  return {storage, scales, qp, dp, sp, blocks};
}

// Q4_1 weight blocks as integers: `load` gives block b of row n as 32 unsigned bytes, `dot` the 8
// int32 partial sums (elements 4j..4j+3 in lane j) of its products with an activation block, exact.
struct Q41i {
  const uint8_t* q;
  const float *d, *m;
  int64_t K, blocks;
  inline __m256i load(int64_t n, int64_t b) const {  // the nibbles: elements 0-15 low, 16-31 high
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
  }
  static inline __m256i dot(__m256i w, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
  }
};

// sum_b m[b] * s[b] over a row's blocks, 8 at a time in lanes, then the rest in order.
inline float min_terms(const float* m, const float* s, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(s + b)));
  float out = hsum(acc);
  for (; b < blocks; ++b) out += m[b] * s[b];
  return out;
}

// y[r * N + n + c] for R input rows from r0 and C weight rows from n: per output one 8-lane float
// accumulator of d_w * d_x * (block dot), the blocks in order, then a fixed lane sum, plus the
// minimum terms m_w * s_x (`min_terms`).
template <int R, int C, typename W>
inline void tile_q8(const W& B, const Q8Rows& A, int64_t r0, int64_t n, float* y, int64_t N) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B.blocks; ++b) {
    __m256i w[C];
    for (int c = 0; c < C; ++c) w[c] = B.load(n + c, b);
    for (int r = 0; r < R; ++r) {
      const int64_t ab = (r0 + r) * A.blocks + b;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A.q + ab * kBlock));
      for (int c = 0; c < C; ++c) {
        const __m256 xy = _mm256_cvtepi32_ps(W::dot(w[c], a));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(B.d[(n + c) * B.blocks + b] * A.d[ab]), xy, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[(r0 + r) * N + n + c] = hsum(acc[r][c]) + min_terms(B.m + (n + c) * B.blocks, A.s + (r0 + r) * A.blocks, B.blocks);
}

template <int C, typename W>
inline void panel_q8(const W& B, const Q8Rows& A, int64_t M, int64_t n, float* y, int64_t N) {
  constexpr int R = C >= 4 ? 2 : 4;  // R * C accumulators, C weight blocks and one input block in registers
  row_groups<R>(M, [&](auto rows, int64_t r) { tile_q8<decltype(rows)::value, C>(B, A, r, n, y, N); });
}

template <typename W>
torch::Tensor run_q8(const torch::Tensor& x_in, int64_t N, int64_t K, const W& B) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32, "gguf linear: float32 input expected");
  TORCH_CHECK(x_in.size(-1) == K, "gguf linear: input has ", x_in.size(-1), " features, the weight ", K);
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  const Q8Rows A = quantize_rows(x.data_ptr<float>(), M, K, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t C = M <= 2 ? 4 : 2, panels = (N + C - 1) / C;  // 4 weight rows a tile for 1-2 inputs, else 2
  at::parallel_for(0, panels, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * C;
      switch (std::min(C, N - n)) {
        case 4: panel_q8<4>(B, A, M, n, yp, N); break;
        case 3: panel_q8<3>(B, A, M, n, yp, N); break;
        case 2: panel_q8<2>(B, A, M, n, yp, N); break;
        default: panel_q8<1>(B, A, M, n, yp, N); break;
      }
    }
  });
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace

int64_t q8_max_rows() { return kQ8MaxRows; }

torch::Tensor q4_1_linear_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, blocks = K / kBlock;
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous(), "gguf linear: Q4_1 nibbles must be uint8 [out, in / 2]");
  check_blocks(d, N, K);
  check_blocks(m, N, K);
  if (x.numel() / K > kQ8MaxRows)  // a prompt's block: float32, where the integer tiles are slower
    return run(x, N, K, Q41{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K, blocks});
  return run_q8(x, N, K, Q41i{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K, blocks});
}

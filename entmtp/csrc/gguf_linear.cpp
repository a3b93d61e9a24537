// Linear layers that read GGUF's Q4_1 and Q8_0 blocks directly (AVX2 + FMA, float32 arithmetic).
//
// A weight row is dequantised (w = d * q + m for Q4_1, w = d * q for Q8_0; the multiply and the
// add rounded separately, as gguf-py's numpy dequantisation computes them, so these are exactly the
// values of the float32 model the loader made from the same file) into a buffer in L1, then dotted
// with every input row. Each output element is summed in the same order whatever the
// number of input rows and whichever thread computes it, so a row's result never depends on the
// batch it is in: a tree verification of N tokens computes what N single-token steps would.
#include "gguf_linear.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 32;

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

// R input rows against C weight rows at a time: R * C accumulators in flight hide the FMA latency
// (one 8-lane accumulator per output, so the tile shape never changes a result).
template <int C>
inline void panel(const float* w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  constexpr int R = C >= 8 ? 1 : C >= 4 ? 2 : 4;  // at most 12 accumulators plus C weight slices in registers
  int64_t r = 0;
  for (; r + R <= M; r += R) tile<R, C>(w, x + r * K, K, y + r * N, N);
  switch (M - r) {
    case 3: tile<3, C>(w, x + r * K, K, y + r * N, N); break;
    case 2: tile<2, C>(w, x + r * K, K, y + r * N, N); break;
    case 1: tile<1, C>(w, x + r * K, K, y + r * N, N); break;
    default: break;
  }
}

// Weight rows are dequantised a panel at a time (4 rows for one or two input rows, else 3) into a
// buffer that stays in L1, then every input row is dotted with them. (Dequantising in registers
// and dotting straight away, without the buffer, measured slower here for one input row.)
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
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    alignas(64) float w[4 * 2048];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * C, c = std::min(C, N - n);
      for (int64_t j = 0; j < c; ++j) dequant(B, n + j, w + j * K);
      switch (c) {
        case 4: panel<4>(w, xp, M, K, yp + n, N); break;
        case 3: panel<3>(w, xp, M, K, yp + n, N); break;
        case 2: panel<2>(w, xp, M, K, yp + n, N); break;
        default: panel<1>(w, xp, M, K, yp + n, N); break;
      }
    }
  });
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

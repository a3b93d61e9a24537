// x @ W.T for W kept as GGUF blocks repacked at load (gguf_linear.cpp), with float32 or Q8
// activations; each output computed in one fixed order, whatever the rows and the instruction set.
#pragma once
#include <immintrin.h>
#include <ATen/core/Tensor.h>  // ATen's tensor alone: <torch/extension.h> would triple each source's build time

#include <string>
#include <vector>

constexpr int64_t kMaxIn = 2048;  // the float32 path's per-thread buffer holds 4 weight rows of at most this many inputs
constexpr int64_t kIsaScalar = 0, kIsaAvx2 = 1, kIsaVnni = 2;  // `isa` arguments: which path computes the Q8 products
// `q8` arguments, the arithmetic of a call: float32 inputs; Q8 inputs for calls of up to
// 64 rows (kQ8MaxRows), float32 beyond (the base model's until 2026-12-02, still timed by `kernels`);
// Q8 inputs whatever the rows (the served base model, prompts included, and the draft heads)
constexpr int64_t kF32 = 0, kQ8Small = 1, kQ8Always = 2;

// The 8 lanes summed in one fixed order.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

at::Tensor q4_1_linear(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, int64_t N, int64_t q8, int64_t isa);
// A packed Q4_1 (`m` set) or Q8_0 (`m` null) weight as raw pointers, checked once (`row_weights`).
struct RowWeights {
  const uint8_t* q = nullptr;
  const at::Half *d = nullptr, *m = nullptr;
  int64_t N = 0, K = 0;
};
constexpr int64_t kRowMaxIn = 8192;  // the inputs `linear_row` quantises on its stack
// The packed tensors of `q4_1_linear` (m defined) or `q8_0_linear` (m undefined or empty) as raw
// pointers, with the same checks those calls make.
RowWeights row_weights(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t N);
// One input row x [K] through W into y [N] with Q8 inputs: the bits `q4_1_linear` / `q8_0_linear`
// (q8 = kQ8Always) give that row, with no tensor made (the heads' chain, whose ATen calls after a
// base step each found the dispatcher's code cold).
void linear_row(const RowWeights& W, const float* x, float* y, int64_t isa);
at::Tensor q8_0_linear(at::Tensor x, at::Tensor q, at::Tensor d, int64_t N, int64_t q8, int64_t isa);
// A draft LM head served in Q4_1 (`z`, its logits over N rows) with its best `k` rows computed again
// from the same rows in Q8_0: `q8` int8 [N, K] and `d8` float16 [N, K/32] (row-major), `bias`
// float32 [N] or empty; `xs` the input already divided by the smoothing. Each of those outputs
// is the Q8_0 product's own bits (the finish of `q8_0_linear`), its bias added after. The k are
// the largest of z, an equal value after the earlier index (NaN never chosen); z is changed in place.
void refine_row(const float* xs, float* z, int64_t N, int64_t K, const int8_t* q8, const at::Half* d8, const float* bias, int64_t k);
// `refine_row` for each row of xs [M, K] and z [M, N] (float32, contiguous).
void lm_refine(at::Tensor xs, at::Tensor z, at::Tensor q8, at::Tensor d8, at::Tensor bias, int64_t k);
constexpr int64_t kMaxRefine = 64;
std::vector<std::string> isas();
double int8_peak(int64_t isa, int64_t iters);

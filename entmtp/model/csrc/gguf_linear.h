// x @ W.T for W kept as GGUF blocks (gguf_linear.cpp), with float32 or Q8 activations; each
// output summed in one fixed order.
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

// The 8 lanes summed in one fixed order.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
int64_t q8_max_rows();
torch::Tensor q4_1_linear_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);

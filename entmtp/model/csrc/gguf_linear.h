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
at::Tensor q8_0_linear(at::Tensor x, at::Tensor q, at::Tensor d, int64_t N, int64_t q8, int64_t isa);
std::vector<std::string> isas();
double int8_peak(int64_t isa, int64_t iters);

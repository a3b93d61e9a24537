// The rest of a Llama decoder layer for the model served from GGUF blocks: RMSNorm, SiLU times
// up, rotary embedding, attention over the KV cache, and the whole layer stack in one call.
//
// Every result is computed one row (one token, one head) at a time, in an order that depends on
// nothing but that row: a dot product runs over its inputs in slices of 8 into one accumulator;
// attention skips the keys a query may not see and takes the visible ones in cache order. So a
// token's result is the same whether it is verified alone or in a tree block with others, and the
// same in the module path (transformers' forward, which `generate` runs) as in `Stack::forward`
// (the engine's), which calls these very functions. Rotary embedding and residual additions are
// single IEEE multiplications and additions (built without contraction), the same bits as ATen's.
#include "gguf_linear.h"
#include "heads.h"
#include "phrasebook.h"

#include <ATen/Parallel.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/max.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // for the Python module at the end, the only source that needs it
#include <pybind11/functional.h>     // HeadChain::chain's `force`, a Python callable
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  return hsum(acc);
}

// exp on 8 lanes (Cephes' single-precision polynomial, inputs clamped to +-88.38): deterministic,
// within ~2 ulp of the true value.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, z), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps): LlamaRMSNorm's operations, one row of H.
inline void rms_row(const float* x, const float* w, int64_t H, float eps, float* y) {
  const float var = dot(x, x, H) / static_cast<float>(H);
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(var + eps));
  for (int64_t k = 0; k < H; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), r)));
}

// rms_row over `rows` rows of H; threads from 8 rows on.
inline void rms_rows(const float* x, const float* w, int64_t rows, int64_t H, float eps, float* y) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * H, w, H, eps, y + r * H);
  });
}

// silu(g) = g / (1 + exp(-g)) on 8 lanes, with exp8: the base model's MLP and the draft heads' SiLU.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// a = silu(g) * u, one row of I.
inline void silu_mul_row(const float* g, const float* u, int64_t I, float* a) {
  for (int64_t k = 0; k < I; k += 8)
    _mm256_storeu_ps(a + k, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + k)), _mm256_loadu_ps(u + k)));
}

// Which keys a query sees. No mask: causal, the queries being the last Q of L positions. A bool
// mask [B, heads, Q, Lm] (broadcast strides allowed): Lm == L covers every key; Lm < L covers the
// last Lm keys and every earlier key is visible (a tree block over a cache).
struct Visibility {
  const bool* mask = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0, Lm = 0;
  inline bool operator()(int64_t b, int64_t h, int64_t i, int64_t j, int64_t Q, int64_t L) const {
    if (mask == nullptr) return j <= L - Q + i;
    const int64_t jm = j - (L - Lm);
    return jm < 0 || mask[b * sb + h * sh + i * si + jm * sj];
  }
};

Visibility visibility(const c10::optional<at::Tensor>& mask, int64_t B, int64_t heads, int64_t Q) {
  Visibility v;
  if (!mask.has_value()) return v;
  const auto& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4, "attention: the mask must be a 4-D bool tensor");
  TORCH_CHECK((m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == heads) && m.size(2) == Q,
              "attention: the mask's shape does not match the queries");
  v.mask = m.data_ptr<bool>();
  v.sb = m.size(0) == 1 ? 0 : m.stride(0);
  v.sh = m.size(1) == 1 ? 0 : m.stride(1);
  v.si = m.stride(2);
  v.sj = m.stride(3);
  v.Lm = m.size(3);
  return v;
}

// Strided views of q [B, heads, Q, D], k/v [B, kv_heads, L, D] (last dimension contiguous).
struct View {
  const float* p;
  int64_t sb, sh, si;
  inline const float* at(int64_t b, int64_t h, int64_t i) const { return p + b * sb + h * sh + i * si; }
};

// acc[0..8V) += sum over keys r in [r0, r1), in order, of weight[r] * v[key(r)], in registers,
// and *total += the weights in the same order (the two chains run side by side). Resuming from
// acc and *total where the previous range stopped gives the bits of one pass over all keys.
template <int V, class Key>
inline void weigh(const float* weight, int64_t r0, int64_t r1, Key key, float* acc, float* total) {
  __m256 a[V];
  for (int d = 0; d < V; ++d) a[d] = _mm256_load_ps(acc + 8 * d);
  float sum = *total;
  for (int64_t r = r0; r < r1; ++r) {
    const __m256 e = _mm256_set1_ps(weight[r]);
    sum += weight[r];
    const float* vv = key(r);
    for (int d = 0; d < V; ++d) a[d] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vv + 8 * d), a[d]);
  }
  for (int d = 0; d < V; ++d) _mm256_store_ps(acc + 8 * d, a[d]);
  *total = sum;
}

// The same for any D (a multiple of 8, at most 256), the accumulator in memory.
template <class Key>
inline void weigh_any(const float* weight, int64_t r0, int64_t r1, Key key, int64_t D, float* acc, float* total) {
  float sum = *total;
  for (int64_t r = r0; r < r1; ++r) {
    const __m256 e = _mm256_set1_ps(weight[r]);
    sum += weight[r];
    const float* vv = key(r);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_store_ps(acc + d, _mm256_fmadd_ps(e, _mm256_loadu_ps(vv + d), _mm256_load_ps(acc + d)));
  }
  *total = sum;
}

// hsum of each of a[0..8), as one vector [hsum(a[0]), ..., hsum(a[7])]: the same additions as
// `hsum` (lane i + lane i+4, then pairs 0+2 and 1+3, then the two halves), eight at a time.
inline __m256 hsum8(const __m256* a) {
  const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
  const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
  const __m256 t45 = _mm256_add_ps(_mm256_permute2f128_ps(a[4], a[5], 0x20), _mm256_permute2f128_ps(a[4], a[5], 0x31));
  const __m256 t67 = _mm256_add_ps(_mm256_permute2f128_ps(a[6], a[7], 0x20), _mm256_permute2f128_ps(a[6], a[7], 0x31));
  // per 128-bit half: [t0 + t2, t1 + t3] of each of two accumulators
  const __m256 u0213 = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u4657 = _mm256_add_ps(_mm256_shuffle_ps(t45, t67, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(t45, t67, _MM_SHUFFLE(3, 2, 3, 2)));
  // [r0, r2, r4, r6 | r1, r3, r5, r7]
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u0213, u4657, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(u0213, u4657, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// score[r] = (q . k[key(r)]) * scale for r in [r0, r1): each an 8-lane accumulator over D in
// order then `hsum`, eight keys at a time (eight independent accumulators hide the FMA latency;
// `hsum8` adds as `hsum` does), so a score does not depend on its neighbours.
template <class Key>
inline void scores(const float* qv, int64_t r0, int64_t r1, Key key, int64_t D, float scale, float* score) {
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t u = r0;
  for (; u + 8 <= r1; u += 8) {
    const float* kr[8];
    for (int c = 0; c < 8; ++c) kr[c] = key(u + c);
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(qv + d);
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr[c] + d), a[c]);
    }
    _mm256_storeu_ps(score + u, _mm256_mul_ps(hsum8(a), sc));
  }
  for (; u < r1; ++u) score[u] = dot(qv, key(u), D) * scale;
}

// out [B, Q, heads, D]: softmax(q . k * scale) v over the visible keys, each (b, h, i) alone.
//
// Each query's arithmetic is that of a query computed alone: its visible keys in cache order, a
// score per key (`scores`), the largest score, exp of each score minus it, then one pass in key
// order summing the weights and the weighted values (`weigh`), and the division. What is shared
// is memory traffic: a task is a (batch, key/value head, block of up to R rows), and the keys
// every query of the task sees (the cache before the block, for a tree or a causal block) are
// walked in chunks of CHUNK keys, each chunk's keys and values read from L2 once and used by
// every query of the task (the `groups` query heads of that key/value head times the rows) while
// they sit in L1. Keys only some queries see (the block's own) follow, query by query.
void attend(View q, View k, View v, int64_t B, int64_t heads, int64_t kv_heads, int64_t Q, int64_t L, int64_t D,
            float scale, const Visibility& vis, float* out) {
  constexpr int64_t CHUNK = 32;  // 32 keys of D = 64: 8 KB of keys, 8 KB of values
  const int64_t groups = heads / kv_heads;
  const int64_t R = Q < 4 ? 1 : Q < 16 ? 2 : 4;  // rows a task: enough tasks for the threads
  const int64_t blocks = (Q + R - 1) / R, total = B * kv_heads * blocks;
  const int64_t M = R * groups;  // queries a task
  at::parallel_for(0, total, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(M * (L + 8));
    std::vector<int64_t> extra(M * L);  // per query: its visible keys after the shared ones
    std::vector<int64_t> n_all(M);
    std::vector<const float*> qp(M);
    std::vector<float> sum(M);
    std::vector<__m256> acc_store(M * 32);  // per query D <= 256 floats, 32-byte aligned
    float* acc = reinterpret_cast<float*>(acc_store.data());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (kv_heads * blocks), g = t / blocks % kv_heads, i0 = t % blocks * R, i1 = std::min(Q, i0 + R);
      const int64_t m_n = (i1 - i0) * groups;
      // keys every query of the task sees: before the mask's columns (all visible), or, causal,
      // up to the first row's own position
      const int64_t shared = vis.mask == nullptr ? L - Q + i0 + 1 : std::max<int64_t>(0, L - vis.Lm);
      for (int64_t m = 0; m < m_n; ++m) {
        const int64_t i = i0 + m / groups, h = g * groups + m % groups;
        qp[m] = q.at(b, h, i);
        int64_t e = 0;
        int64_t* ex = extra.data() + m * L;
        if (vis.mask == nullptr) {
          for (int64_t j = shared; j < L - Q + i + 1; ++j) ex[e++] = j;
        } else {
          for (int64_t j = shared; j < L; ++j)
            if (vis(b, h, i, j, Q, L)) ex[e++] = j;
        }
        n_all[m] = shared + e;
      }
      const float* kg = k.at(b, g, 0);
      const float* vg = v.at(b, g, 0);
      const int64_t ks = k.si, vs = v.si;
      auto key_at = [kg, ks](int64_t j) { return kg + j * ks; };
      auto value_at = [vg, vs](int64_t j) { return vg + j * vs; };
      auto weigh_range = [D, acc, &sum, &score, L](int64_t m, int64_t r0, int64_t r1, auto value) {
        const float* sm = score.data() + m * (L + 8);
        if (D == 64) weigh<8>(sm, r0, r1, value, acc + m * 256, &sum[m]);
        else weigh_any(sm, r0, r1, value, D, acc + m * 256, &sum[m]);
      };
      for (int64_t c0 = 0; c0 < shared; c0 += CHUNK) {
        const int64_t c1 = std::min(shared, c0 + CHUNK);
        for (int64_t m = 0; m < m_n; ++m) scores(qp[m], c0, c1, key_at, D, scale, score.data() + m * (L + 8));
      }
      for (int64_t m = 0; m < m_n; ++m) {
        const int64_t* ex = extra.data() + m * L;
        float* sm = score.data() + m * (L + 8);
        scores(qp[m], shared, n_all[m], [ex, kg, ks, shared](int64_t r) { return kg + ex[r - shared] * ks; }, D, scale, sm);
        const int64_t n = n_all[m];
        // the largest score, 8 lanes at a time (a maximum is exact: any order gives the same value)
        __m256 tv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t u = 0;
        for (; u + 8 <= n; u += 8) tv = _mm256_max_ps(tv, _mm256_loadu_ps(sm + u));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, tv);
        float mx = lanes[0];
        for (int l = 1; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
        for (; u < n; ++u) mx = sm[u] > mx ? sm[u] : mx;
        for (int64_t r = n; r < n + 8; ++r) sm[r] = mx;
        const __m256 mv = _mm256_set1_ps(mx);
        for (int64_t r = 0; r < n; r += 8) _mm256_storeu_ps(sm + r, exp8(_mm256_sub_ps(_mm256_loadu_ps(sm + r), mv)));
        sum[m] = 0.0f;
        std::fill(acc + m * 256, acc + m * 256 + D, 0.0f);
      }
      for (int64_t c0 = 0; c0 < shared; c0 += CHUNK) {
        const int64_t c1 = std::min(shared, c0 + CHUNK);
        for (int64_t m = 0; m < m_n; ++m) weigh_range(m, c0, c1, value_at);
      }
      for (int64_t m = 0; m < m_n; ++m) {
        const int64_t i = i0 + m / groups, h = g * groups + m % groups;
        const int64_t* ex = extra.data() + m * L;
        weigh_range(m, shared, n_all[m], [ex, vg, vs, shared](int64_t r) { return vg + ex[r - shared] * vs; });
        float* o = out + ((b * Q + i) * heads + h) * D;
        if (n_all[m] == 0) {  // a query that sees nothing (padding): zeros
          std::fill(o, o + D, 0.0f);
          continue;
        }
        const __m256 sv = _mm256_set1_ps(sum[m]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_load_ps(acc + m * 256 + d), sv));
      }
    }
  });
}

// dst = src * cos + rotate_half(src) * sin for one head of D (rotate_half: [-x2, x1]).
inline void rope_row(const float* src, const float* c, const float* s, int64_t D, float* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -src[d + half] : src[d - half];
    const float a = src[d] * c[d], b = rot * s[d];
    dst[d] = a + b;
  }
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), what, ": float32 CPU tensor expected");
  TORCH_CHECK(t.size(-1) % 8 == 0 && t.stride(-1) == 1, what, ": the last dimension must be contiguous, a multiple of 8");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.numel() == H && w.is_contiguous() && w.scalar_type() == at::kFloat, "rms_norm: weight must be float32 [H]");
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  rms_rows(xc.data_ptr<float>(), w.data_ptr<float>(), xc.numel() / H, H, static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

at::Tensor silu_mul(at::Tensor g, at::Tensor u) {
  check_rows(g, "silu_mul");
  check_rows(u, "silu_mul");
  TORCH_CHECK(g.sizes() == u.sizes(), "silu_mul: gate and up differ in shape");
  const int64_t I = g.size(-1);
  auto g2 = g.dim() == 2 ? g : g.reshape({-1, I});
  auto u2 = u.dim() == 2 ? u : u.reshape({-1, I});
  const int64_t rows = g2.size(0);
  auto a = at::empty({rows, I}, g.options());
  const float *gp = g2.data_ptr<float>(), *up = u2.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  const int64_t gs = g2.stride(0), us = u2.stride(0), slice = 256;  // elements are independent: slices of rows in parallel
  const int64_t per_row = (I + slice - 1) / slice;
  // under 4 rows on the calling thread: a hand-off to the other thread cost more than the work
  // (~10 us a layer of a one-token step on the 2-core AMD EPYC)
  at::parallel_for(0, rows * per_row, rows < 4 ? rows * per_row : 4, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t r = s / per_row, k = s % per_row * slice;
      silu_mul_row(gp + r * gs + k, up + r * us + k, std::min(slice, I - k), ap + r * I + k);
    }
  });
  return a.view(g.sizes());
}

// q [B, heads, Q, D], k/v [B, kv_heads, L, D], mask None (causal) or bool -> out [B, Q, heads, D].
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask, double scale) {
  check_rows(q, "attention");
  check_rows(k, "attention");
  check_rows(v, "attention");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "attention: 4-D q, k, v expected");
  const int64_t B = q.size(0), heads = q.size(1), Q = q.size(2), D = q.size(3), kv_heads = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && heads % kv_heads == 0 && D <= 256 && L >= Q, "attention: shapes do not fit");
  auto out = at::empty({B, Q, heads, D}, q.options());
  auto vis = visibility(mask, B, heads, Q);
  attend({q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2)}, {k.data_ptr<float>(), k.stride(0), k.stride(1), k.stride(2)},
         {v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2)}, B, heads, kv_heads, Q, L, D, static_cast<float>(scale), vis,
         out.data_ptr<float>());
  return out;
}

// The layer stack of a Llama model whose projections are packed Q4_1 blocks, for one sequence
// (batch 1). Per layer, 14 tensors: input norm weight; q/k/v fused (q, d, m); o (q, d, m);
// post-attention norm weight; gate/up fused (q, d, m); down (q, d, m). `q8`: the projections take
// Q8 activations, computed by instruction-set path `isa` (gguf_linear.cpp).
struct Stack {
  // a row's fixed work in forward_rows' attention split (its rotary and cache entry), in keys' worth
  static constexpr int64_t kRowWork = 16;
  std::vector<at::Tensor> w;
  int64_t heads, kv_heads, dim;
  double eps, scale;
  bool q8;
  int64_t isa;

  Stack(std::vector<at::Tensor> weights, int64_t heads, int64_t kv_heads, int64_t dim, double eps, double scale, bool q8, int64_t isa)
      : w(std::move(weights)), heads(heads), kv_heads(kv_heads), dim(dim), eps(eps), scale(scale), q8(q8), isa(isa) {
    TORCH_CHECK(w.size() % 14 == 0, "Stack: 14 tensors per layer expected");
    TORCH_CHECK(dim % 8 == 0 && dim <= 256 && heads % kv_heads == 0, "Stack: unsupported head layout");
  }

  at::Tensor linear(const at::Tensor& x, const at::Tensor* t, int64_t N) const {
    return q4_1_linear(x, t[0], t[1], t[2], N, q8 ? kQ8Always : kF32, isa);  // Q8: a prompt's rows too, each alone
  }

  // x [Q, H] (embedded tokens), cos/sin [Q, D], the layers' key/value buffers [1, kv_heads, capacity,
  // D] holding `past` entries, an optional bool block mask [Q, Q] among the new tokens (else causal):
  // writes the new keys and values at past..past+Q-1, returns the last layer's output [Q, H].
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, int64_t past, c10::optional<at::Tensor> block) {
    const int64_t layers = static_cast<int64_t>(w.size() / 14), Q = x.size(0), D = dim, L = past + Q;
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "Stack: x must be float32 [Q, H]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == Q * D && sin.numel() == Q * D, "Stack: cos/sin must be [Q, D]");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers, "Stack: one cache per layer");
    c10::optional<at::Tensor> mask;
    if (block.has_value()) {
      TORCH_CHECK(block->scalar_type() == at::kBool && block->size(0) == Q && block->size(1) == Q, "Stack: block mask must be bool [Q, Q]");
      mask = block->contiguous().view({1, 1, Q, Q});
    }
    const auto vis = visibility(mask, 1, heads, Q);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t qw = heads * D, kw = kv_heads * D, H = x.size(1);
    // the layers' small operations write into buffers made once a call, and the residual adds in
    // place: the same arithmetic (each element rounded once, as ATen's add and the extension's own
    // rms_norm and silu_mul compute it), without an allocation or a thread hand-off per operation
    // (~0.4 ms of a one-token step on the 2-core AMD EPYC)
    TORCH_CHECK(H % 8 == 0, "Stack: the hidden size must be a multiple of 8");
    x = x.clone();
    auto h = at::empty({Q, H}, x.options());
    auto qr = at::empty({heads, Q, D}, x.options());
    auto att = at::empty({Q, heads * D}, x.options());
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* t = w.data() + 14 * l;
      auto& kb = keys[l];
      auto& vb = values[l];
      TORCH_CHECK(kb.is_contiguous() && vb.is_contiguous() && kb.size(1) == kv_heads && kb.size(2) >= L && kb.size(3) == D &&
                      vb.sizes() == kb.sizes(), "Stack: a key/value buffer is too small or misshapen");
      const int64_t cap = kb.size(2);
      norm_into(t[0], x, h);
      auto qkv = linear(h, t + 1, qw + 2 * kw);
      {
        const float* src = qkv.data_ptr<float>();
        float* qp = qr.data_ptr<float>();
        float* kp = kb.data_ptr<float>();
        float* vp = vb.data_ptr<float>();
        const int64_t row = qw + 2 * kw;
        for (int64_t i = 0; i < Q; ++i) {
          const float* r = src + i * row;
          for (int64_t hh = 0; hh < heads; ++hh) rope_row(r + hh * D, cp + i * D, sp + i * D, D, qp + (hh * Q + i) * D);
          for (int64_t g = 0; g < kv_heads; ++g) {
            rope_row(r + qw + g * D, cp + i * D, sp + i * D, D, kp + (g * cap + past + i) * D);
            std::copy(r + qw + kw + g * D, r + qw + kw + (g + 1) * D, vp + (g * cap + past + i) * D);
          }
        }
      }
      attend({qr.data_ptr<float>(), 0, Q * D, D}, {kb.data_ptr<float>(), 0, cap * D, D}, {vb.data_ptr<float>(), 0, cap * D, D}, 1,
             heads, kv_heads, Q, L, D, static_cast<float>(scale), vis, att.data_ptr<float>());
      finish_layer(t, att, x, h);
    }
    return x;
  }

  // One new token for each of B independent sequences (batched decoding, `model/batch.py`): x [B, H]
  // (row b embedded at position pasts[b]), cos/sin [B, D], and the batch's key and value pools
  // [slots, layers, kv_heads, capacity, D]: row b's sequence lives in slot slots[b] and holds pasts[b]
  // entries. Writes row b's key and value at pasts[b], returns the last layer's output [B, H]. The
  // projections take all rows at once (each output of each row computed alone, so a row's bits do
  // not depend on the others); each row attends its own sequence alone, causally, as `forward` with
  // Q = 1 attends it: row b's result is, bit for bit, that sequence's one-token step.
  at::Tensor forward_rows(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values, std::vector<int64_t> slots,
                          std::vector<int64_t> pasts) {
    const int64_t layers = static_cast<int64_t>(w.size() / 14), B = x.size(0), D = dim;
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "Stack: x must be float32 [B, H]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D, "Stack: cos/sin must be [B, D]");
    TORCH_CHECK(static_cast<int64_t>(pasts.size()) == B && static_cast<int64_t>(slots.size()) == B, "Stack: one slot and one past a row");
    TORCH_CHECK(keys.dim() == 5 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                    keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat && keys.size(1) == layers &&
                    keys.size(2) == kv_heads && keys.size(4) == D,
                "Stack: the key/value pools must be float32 [slots, layers, kv_heads, capacity, D]");
    const int64_t cap = keys.size(3);
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(slots[b] >= 0 && slots[b] < keys.size(0) && pasts[b] >= 0 && pasts[b] < cap, "Stack: a row's slot or past is out of the pools");
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t qw = heads * D, kw = kv_heads * D, H = x.size(1);
    TORCH_CHECK(H % 8 == 0, "Stack: the hidden size must be a multiple of 8");
    const Visibility causal;  // Q = 1 over the row's own entries: it sees them all
    // the rows split among the threads by their work, not their count: a row's attention reads its
    // whole cache, and the caches of a batch differ tenfold in length (prompts of 30 to 500 tokens);
    // equal counts left one thread idle for much of each layer. Each row is still computed alone.
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
    std::vector<int64_t> cut(parts + 1, B);
    {
      int64_t total = 0;
      for (int64_t b = 0; b < B; ++b) total += pasts[b] + 1 + kRowWork;
      cut[0] = 0;
      int64_t done = 0, part = 1;
      for (int64_t b = 0; b < B && part < parts; ++b) {
        done += pasts[b] + 1 + kRowWork;
        while (part < parts && done * parts >= total * part) cut[part++] = b + 1;
      }
    }
    x = x.clone();
    auto h = at::empty({B, H}, x.options());
    auto qr = at::empty({B, heads, D}, x.options());
    auto att = at::empty({B, heads * D}, x.options());
    float* kpool = keys.data_ptr<float>();
    float* vpool = values.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* t = w.data() + 14 * l;
      norm_into(t[0], x, h);
      auto qkv = linear(h, t + 1, qw + 2 * kw);
      const float* src = qkv.data_ptr<float>();
      const int64_t row = qw + 2 * kw;
      float* qp = qr.data_ptr<float>();
      float* ap = att.data_ptr<float>();
      // rows in parallel: a row's rotary, its cache entry and its attention, each computed alone
      // (the attention's own split runs inline within a parallel region: the same order as alone)
      at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t b = cut[p0]; b < cut[p1]; ++b) {
          const int64_t past = pasts[b], at = (slots[b] * layers + l) * kv_heads * cap * D;
          const float* r = src + b * row;
          float* kp = kpool + at;
          float* vp = vpool + at;
          for (int64_t hh = 0; hh < heads; ++hh) rope_row(r + hh * D, cp + b * D, sp + b * D, D, qp + (b * heads + hh) * D);
          for (int64_t g = 0; g < kv_heads; ++g) {
            rope_row(r + qw + g * D, cp + b * D, sp + b * D, D, kp + (g * cap + past) * D);
            std::copy(r + qw + kw + g * D, r + qw + kw + (g + 1) * D, vp + (g * cap + past) * D);
          }
          attend({qp + b * heads * D, 0, D, D}, {kp, 0, cap * D, D}, {vp, 0, cap * D, D}, 1, heads, kv_heads, 1, past + 1, D,
                 static_cast<float>(scale), causal, ap + b * heads * D);
        }
      });
      finish_layer(t, att, x, h);
    }
    return x;
  }

 private:
  // x += y, as x.add(y) rounds it (8 lanes at a time; a row is a multiple of 8)
  static void add_into(at::Tensor& x, const at::Tensor& y) {
    float* xp = x.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t k = 0, n = x.numel(); k < n; k += 8) _mm256_storeu_ps(xp + k, _mm256_add_ps(_mm256_loadu_ps(xp + k), _mm256_loadu_ps(yp + k)));
  }

  // h = the rows of x normed by weight `wt`
  void norm_into(const at::Tensor& wt, const at::Tensor& x, at::Tensor& h) const {
    rms_rows(x.data_ptr<float>(), wt.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps), h.data_ptr<float>());
  }

  // A layer after its attention `att` [rows, heads * D]: x += o(att), then x += down(silu(gate) * up)
  // of x normed (`h` the buffer for the norm), in place, each element rounded once as ATen rounds it.
  void finish_layer(const at::Tensor* t, const at::Tensor& att, at::Tensor& x, at::Tensor& h) const {
    const int64_t H = x.size(1);
    add_into(x, linear(att, t + 4, H));
    norm_into(t[7], x, h);
    auto gu = linear(h, t + 8, 2 * t[11].size(1) * 32);
    const int64_t I = gu.size(1) / 2;
    auto a = silu_mul(gu.narrow(1, 0, I), gu.narrow(1, I, I));
    add_into(x, linear(a, t + 11, H));
  }
};

// The accepted tree entries kept in place (`kv.commit`): in every buffer [B, H, capacity, D]
// (contiguous, one per layer's keys and values), entry past + accepted[i] moves to past + i, for
// i in order. The accepted nodes are a root-first path, so their ids only grow and a move never
// overwrites an entry still to be read. One call instead of four tensor operations a layer.
void keep_entries(std::vector<at::Tensor> buffers, int64_t past, std::vector<int64_t> accepted) {
  const int64_t n = static_cast<int64_t>(accepted.size());
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(accepted[i] >= i && (i == 0 || accepted[i] > accepted[i - 1]), "keep_entries: accepted ids must grow, from 0 on");
  for (const auto& buf : buffers) {
    TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous() && buf.dim() == 4, "keep_entries: contiguous CPU buffers [B, H, capacity, D]");
    const int64_t cap = buf.size(2), row = buf.size(3) * static_cast<int64_t>(buf.element_size());
    TORCH_CHECK(past >= 0 && (n == 0 || past + accepted[n - 1] < cap), "keep_entries: an entry past the buffer's capacity");
    auto* base = static_cast<char*>(buf.data_ptr());
    for (int64_t s = 0; s < buf.size(0) * buf.size(1); ++s) {
      char* seq = base + s * cap * row;
      for (int64_t i = 0; i < n; ++i)
        if (accepted[i] != i) std::memcpy(seq + (past + i) * row, seq + (past + accepted[i]) * row, row);
    }
  }
}

// The maximum of n floats in one vector pass (8 lanes, then the tail), and whether any is NaN.
static float max_row(const float* p, int64_t n, bool& has_nan) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    mx = _mm256_max_ps(mx, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
  has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(p[j])) has_nan = true;
    else if (p[j] > best) best = p[j];
  }
  return best;
}

// The index of the first of n floats equal to `best` (their maximum, no NaN among them), by vectors.
static int64_t first_equal(const float* p, int64_t n, float best) {
  const __m256 b = _mm256_set1_ps(best);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), b, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
  for (int64_t j = i; j < n; ++j)
    if (p[j] == best) return j;
  return 0;  // every element -inf: the first
}

// torch.argmax of n floats: the index of the first maximal one (also torch.max(dim)'s index, so
// its value is the maximum's bits), in two vector passes: the maximum, then the first element
// equal to it. A NaN anywhere goes to at::argmax (whose NaN is the maximum).
int64_t argmax_row(const float* p, int64_t n) {
  bool has_nan = false;
  const float best = max_row(p, n, has_nan);
  if (has_nan) return at::argmax(at::from_blob(const_cast<float*>(p), {n}, at::kFloat)).item<int64_t>();
  return first_equal(p, n, best);
}

// torch.argmax(x, -1) for a float32 [rows, n] tensor, the same indices (ATen's reduction took
// ~0.2 ms for a 5-row tree's logits on the 2-core AMD EPYC, this ~0.05).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0, "argmax_rows: float32 [rows, n] on the CPU");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) op[r] = argmax_row(x.data_ptr<float>() + r * n, n);
  return out;
}

// policy.confidence natively: (p0, entropy) of softmax(z) for float32 logits z [n], in two vector
// passes and no allocation (ATen's log_softmax, exp, max, product and sum took ~0.07 ms warm, more
// after a base step, half of a plain step's scheduling). With m = max z, x_i = max(z_i - m, -88.38),
// e_i = exp(x_i) (Cephes' polynomial with fused multiply-adds), S = sum e_i and T = sum x_i e_i:
// p0 = 1 / S, the largest probability, and entropy = log S - T / S. The sums run 64 inputs at a
// time in float32 (8 lanes, a fixed order), each run's total added in float64. One code path on
// every CPU of the extension's floor (AVX2 + FMA), so the same bits everywhere; within ~1e-5 of
// ATen's. An input of -inf adds nothing; a NaN makes both NaN (as ATen's softmax does).
namespace {

inline __m256 exp8_fma(__m256 x) {  // x in [-88.38, 0]
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline __m256d widen_sum(__m256 v) {  // the 8 lanes as 4 doubles: lanes l and l + 4 added
  return _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

}  // namespace

// S = sum e_i and T = sum x_i e_i over n floats p less their maximum m (x_i = max(p_i - m, -88.38),
// e_i = exp(x_i)), 64 inputs a run in float32, each run's total added in float64: one order of
// operations on every CPU of the extension's floor.
static void exp_sums(const float* p, int64_t n, float m, double& s, double& t) {
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-88.3762626647949f);
  __m256d S = _mm256_setzero_pd(), T = _mm256_setzero_pd();
  alignas(32) float tail[8];
  for (int64_t i = 0; i < n; i += 64) {  // a run of 64 inputs (8 vectors), the last padded
    __m256 se = _mm256_setzero_ps(), te = _mm256_setzero_ps();
    for (int64_t k = i; k < std::min(i + 64, n); k += 8) {
      __m256 x, keep = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      if (k + 8 <= n) {
        x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + k), mv), lo);
      } else {  // padding lanes add nothing
        for (int l = 0; l < 8; ++l) tail[l] = k + l < n ? p[k + l] - m : 0.0f;
        alignas(32) int32_t on[8];
        for (int l = 0; l < 8; ++l) on[l] = k + l < n ? -1 : 0;
        x = _mm256_max_ps(_mm256_load_ps(tail), lo);
        keep = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(on)));
      }
      const __m256 e = _mm256_and_ps(exp8_fma(x), keep);
      se = _mm256_add_ps(se, e);
      te = _mm256_fmadd_ps(_mm256_and_ps(x, keep), e, te);
    }
    S = _mm256_add_pd(S, widen_sum(se));
    T = _mm256_add_pd(T, widen_sum(te));
  }
  alignas(32) double s4[4], t4[4];
  _mm256_store_pd(s4, S);
  _mm256_store_pd(t4, T);
  s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  t = (t4[0] + t4[1]) + (t4[2] + t4[3]);
}

std::tuple<double, double> confidence(at::Tensor z) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.device().is_cpu() && z.numel() > 0, "confidence: float32 logits on the CPU");
  z = z.contiguous();
  const float* p = z.data_ptr<float>();
  const int64_t n = z.numel();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  bool has_nan = false;
  const float m = max_row(p, n, has_nan);
  if (has_nan || std::isinf(m)) return {nan, nan};  // a NaN, +inf, or every input -inf: ATen's softmax is NaN
  double s, t;
  exp_sums(p, n, m, s, t);
  const double entropy = std::log(s) - t / s;
  return {1.0 / s, entropy > 0.0 ? entropy : 0.0};
}

bool head_top_row(const float* z, int64_t n, int64_t k, float* lp, int64_t* idx) {
  bool has_nan = false;
  const float m = n > 0 ? max_row(z, n, has_nan) : 0.0f;
  if (n <= 0 || has_nan || std::isinf(m)) return false;
  k = std::min(k, n);
  if (k <= 0) return true;
  // the k largest, best first, an equal value after the earlier ones: one pass that keeps them
  // sorted, 8 inputs at a time tested against the k-th kept once k are kept
  float val[kMaxTop];
  int64_t at[kMaxTop], kept = 0;
  auto offer = [&](int64_t i) {
    const float v = z[i];
    if (kept == k && !(v > val[k - 1])) return;
    int64_t j = kept < k ? kept++ : k - 1;
    for (; j > 0 && val[j - 1] < v; --j) val[j] = val[j - 1], at[j] = at[j - 1];
    val[j] = v, at[j] = i;
  };
  int64_t i = 0;
  for (; i < n && kept < k; ++i) offer(i);
  for (; i + 8 <= n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + i), _mm256_set1_ps(val[k - 1]), _CMP_GT_OQ));
    for (; mask; mask &= mask - 1) offer(i + __builtin_ctz(mask));
  }
  for (; i < n; ++i) offer(i);
  double s, t;
  exp_sums(z, n, m, s, t);
  const double lse = std::log(s);
  for (int64_t j = 0; j < k; ++j) {
    lp[j] = static_cast<float>((static_cast<double>(val[j]) - static_cast<double>(m)) - lse);
    idx[j] = at[j];
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> head_top(at::Tensor z, int64_t k) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.device().is_cpu() && z.dim() == 1 && z.numel() > 0, "head_top: float32 logits [n] on the CPU");
  TORCH_CHECK(k > 0 && k <= kMaxTop, "head_top: 1 to ", kMaxTop, " candidates");
  z = z.contiguous();
  const int64_t n = z.numel(), kk = std::min(k, n);
  auto lp = at::empty({kk}, z.options());
  auto idx = at::empty({kk}, z.options().dtype(at::kLong));
  if (!head_top_row(z.data_ptr<float>(), n, kk, lp.data_ptr<float>(), idx.data_ptr<int64_t>()))
    TORCH_CHECK(false, "head_top: the logits hold a NaN or an infinity");
  return {lp, idx};
}

// The draft heads' own SiLU and top-1 probability where they are served on blocks: the chain's
// and the modules' alike, so that a bank's traces and the engine's drafts are the same bits on
// every CPU. ATen's SiLU and softmax follow its vector width (AVX2 or AVX-512 kernels, chosen by
// the CPU): the traces recorded on an AVX-512 Xeon and on an AVX2-only AMD EPYC differed in the
// chain's probabilities by up to 0.7% (one SiLU ulp moves an input's Q8 rounding).

// y = silu8(x), as silu_mul_row computes silu(g); the tail padded to a vector, so an element's bits
// do not depend on where it lies.
void silu_row(const float* x, int64_t n, float* y) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(y + k, silu8(_mm256_loadu_ps(x + k)));
  if (k < n) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, x + k, (n - k) * sizeof(float));
    _mm256_store_ps(t, silu8(_mm256_load_ps(t)));
    std::memcpy(y + k, t, (n - k) * sizeof(float));
  }
}

at::Tensor heads_silu(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "silu: float32 on the CPU");
  x = x.contiguous();
  auto y = at::empty_like(x);
  silu_row(x.data_ptr<float>(), x.numel(), y.data_ptr<float>());
  return y;
}

// softmax(z).max() of n float32 logits: the index of the first maximal logit, and its probability
// 1 / S with S = sum exp(z_i - max) as `confidence` sums it (within ~1e-6 of ATen's). A NaN or an
// infinity goes to ATen's softmax, as `confidence` would give NaN.
float top1_row(const float* z, int64_t n, int64_t& idx) {
  bool has_nan = false;
  const float m = max_row(z, n, has_nan);
  if (has_nan || std::isinf(m)) {
    const auto best = at::softmax(at::from_blob(const_cast<float*>(z), {n}, at::kFloat), -1).max(0);
    idx = std::get<1>(best).item<int64_t>();
    return std::get<0>(best).item<float>();
  }
  idx = first_equal(z, n, m);  // the maximum is known: argmax_row's second pass
  double s, t;
  exp_sums(z, n, m, s, t);
  return static_cast<float>(1.0 / s);
}

std::tuple<at::Tensor, at::Tensor> top1_rows(at::Tensor z) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.device().is_cpu() && z.dim() >= 1 && z.size(-1) > 0, "top1_rows: float32 logits [..., n] on the CPU");
  z = z.contiguous();
  const int64_t n = z.size(-1), rows = z.numel() / n;
  auto shape = z.sizes().vec();
  shape.pop_back();
  auto p = at::empty(shape, z.options());
  auto idx = at::empty(shape, z.options().dtype(at::kLong));
  for (int64_t r = 0; r < rows; ++r) p.data_ptr<float>()[r] = top1_row(z.data_ptr<float>() + r * n, n, idx.data_ptr<int64_t>()[r]);
  return {p, idx};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_1_linear", &q4_1_linear, "x @ W.T with W in packed GGUF Q4_1 blocks (x, q, d, m, out_features, q8, isa)");
  mod.def("q8_0_linear", &q8_0_linear, "x @ W.T with W in packed GGUF Q8_0 blocks (x, q, d, out_features, q8, isa)");
  mod.def("isas", &isas, "the instruction-set paths this CPU can run: scalar, avx2, avx512_vnni");
  mod.def("int8_peak", &int8_peak, "8-bit multiply-adds a second of a path on all threads, from registers (isa, iterations)");
  mod.def("rms_norm", &rms_norm, "LlamaRMSNorm, one row at a time");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up");
  mod.def("attention", &attention, "attention over visible keys, each query and head alone");
  mod.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a float32 [rows, n] tensor, the same indices");
  mod.def("confidence", &confidence, "policy.confidence of float32 logits: (p0, entropy) of their softmax");
  mod.def("silu", &heads_silu, "x / (1 + exp(-x)) in one order on every CPU (the heads' SiLU on blocks)");
  mod.def("top1_rows", &top1_rows, "softmax(z).max(-1) of float32 logits [..., n]: (probabilities, first maximal indices), one order on every CPU");
  mod.def("head_top", &head_top, "phrasebook.head_top of float32 logits: the k best log-softmax values and their indices");
  mod.def("lm_refine", &lm_refine, "a Q4_1 LM head's best k logits of each row computed again in Q8_0, in place (xs, z, q8, d8, bias, k)");
  mod.def("keep_entries", &keep_entries, "a tree step's accepted KV entries moved in place (buffers, past, accepted)");
  pybind11::class_<Stack>(mod, "Stack")
      .def(pybind11::init<std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double, bool, int64_t>())
      .def("forward", &Stack::forward)
      .def("forward_rows", &Stack::forward_rows, "one new token for each of B sequences, each in its own slot of the key/value pools")
      .def_readwrite("isa", &Stack::isa);
  pybind11::class_<HeadChain>(mod, "HeadChain")
      .def(pybind11::init<std::vector<std::vector<std::vector<at::Tensor>>>, std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor,
                          int64_t, int64_t, int64_t>())
      .def("chain", &HeadChain::chain, "a draft head's top-1 chain from a path on to a depth: (rows (K,) each, probabilities, tokens) as lists",
           pybind11::arg("feature"), pybind11::arg("path"), pybind11::arg("depth"), pybind11::arg("force") = pybind11::none(),
           pybind11::arg("p0") = -1.0, pybind11::arg("settle") = 0.0, pybind11::arg("strict") = false,
           pybind11::arg("settled_depth") = -1, pybind11::arg("unsettled_depth") = -1, pybind11::arg("ranked") = false)
      .def(
          "chain_native",
          [](const HeadChain& c, at::Tensor feature, std::vector<int64_t> path, int64_t depth, const PhraseForcer& forcer, double p0,
             double settle, bool strict, int64_t settled_depth, int64_t unsettled_depth) {
            return c.chain(feature, std::move(path), depth,
                           HeadChain::Force([&forcer](const std::vector<int64_t>& p, double head_p, const at::Tensor& row) {
                             return forcer.force(p, head_p, row);
                           }),
                           p0, settle, strict, settled_depth, unsettled_depth, !forcer.layers.empty());
          },
          "`chain` with a native phrasebook forcer: no call back into Python at a node",
          pybind11::arg("feature"), pybind11::arg("path"), pybind11::arg("depth"), pybind11::arg("forcer"), pybind11::arg("p0") = -1.0,
          pybind11::arg("settle") = 0.0, pybind11::arg("strict") = false, pybind11::arg("settled_depth") = -1,
          pybind11::arg("unsettled_depth") = -1)
      .def("kept", &HeadChain::kept, "the token parts kept: (entries, hits, misses)")
      .def("clear_kept", &HeadChain::clear_kept, "forget the token parts kept")
      .def("set_refine", &HeadChain::set_refine, "each LM head's best k rows computed again in Q8_0 (rows per head, k)");
  pybind11::class_<PhraseBook, std::shared_ptr<PhraseBook>>(mod, "PhraseBook")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, int64_t>());
  pybind11::class_<PhraseForcer>(mod, "PhraseForcer")
      .def(pybind11::init<std::shared_ptr<PhraseBook>, at::Tensor, std::vector<std::pair<at::Tensor, at::Tensor>>, int64_t, int64_t, double,
                          double>())
      .def_readwrite("depths", &PhraseForcer::depths)
      .def("extend", &PhraseForcer::extend)
      .def("force", &PhraseForcer::force)
      .def("scores", &PhraseForcer::scores);
}

// A draft head's top-1 chain in one call: for Hydra or Medusa heads whose linears are GGUF blocks
// (`gguf.BlockLinear`, Q4_1 or Q8_0), depth after depth, the head's ResBlocks, its LM head over the draft
// vocabulary, the top-1 token and its probability, the token appended to the path the next head
// reads.
//
// Every elementwise step is the operation the Python modules run (ATen's input smoothing, bias and
// residual; the extension's SiLU and softmax maximum, `heads_silu` and `top1_row`, which the modules
// on blocks call too) and every product the same block kernel,
// so the chain computes the very bits `drafting.top1_logits` computes through the modules, and a
// bank's traces (the modules over hundreds of positions at once: each row alone in the kernel)
// stay exact. What goes is the Python between the operations: a few hundred microseconds a step.
#include "heads.h"

#include "gguf_linear.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>

#include <algorithm>
#include <cstring>
#include <tuple>

namespace {

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

}  // namespace

// A chain's activations are one contiguous float32 row: its elementwise products and sums are
// written as loops here (one IEEE operation an element, as ATen's mul and add round them: the
// same bits) instead of an ATen call each, whose dispatch and allocation cost more than the
// arithmetic at 576 elements.
// Two tensors stacked along the first dimension (empty where the first is).
static at::Tensor cat2(const at::Tensor& a, const at::Tensor& c) { return present(a) ? at::cat({a, c}, 0).contiguous() : a; }

static bool one_row(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == 1; }

at::Tensor HeadChain::Linear::smoothed(const at::Tensor& x) const {
  if (!present(inv_smooth)) return x;
  if (!one_row(x)) return at::mul(x, inv_smooth);
  auto xs = at::empty_like(x);
  const float *a = x.data_ptr<float>(), *s = inv_smooth.data_ptr<float>();
  float* o = xs.data_ptr<float>();
  for (int64_t k = 0, n = x.numel(); k < n; ++k) o[k] = a[k] * s[k];
  return xs;
}

at::Tensor HeadChain::Linear::operator()(const at::Tensor& x, int64_t isa) const {
  // BlockLinear.forward: x * (1 / smooth), the product on Q8 inputs, + bias
  const bool row = one_row(x);
  const at::Tensor xs = smoothed(x);
  auto y = present(m) ? q4_1_linear(xs, qs, d, m, out, kQ8Always, isa) : q8_0_linear(xs, qs, d, out, kQ8Always, isa);
  if (!present(bias)) return y;
  if (!row || !one_row(y)) return at::add(y, bias);
  float* yp = y.data_ptr<float>();  // a fresh output: the sum in place
  const float* b = bias.data_ptr<float>();
  for (int64_t k = 0; k < out; ++k) yp[k] = yp[k] + b[k];
  return y;
}

// r + s elementwise (at::add's sums) into a new row.
static at::Tensor add_rows(const at::Tensor& r, const at::Tensor& s) {
  if (!one_row(r) || !one_row(s)) return at::add(r, s);
  auto o = at::empty_like(r);
  const float *a = r.data_ptr<float>(), *b = s.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for (int64_t k = 0, n = r.numel(); k < n; ++k) op[k] = a[k] + b[k];
  return o;
}

// Whether a ResBlock's linear and residual linear read their input alike (the same smoothing, the
// same block kind, a bias on both or neither) in whole groups of 16 outputs, so that their packed
// blocks stack along the first dimension.
static bool alike(const HeadChain::Linear& l, const HeadChain::Linear& r, int64_t hidden) {
  return present(r.qs) && present(l.m) == present(r.m) && present(l.bias) == present(r.bias) &&
         present(l.inv_smooth) == present(r.inv_smooth) && (!present(l.inv_smooth) || at::equal(l.inv_smooth, r.inv_smooth)) &&
         l.qs.size(0) * 16 == hidden;
}

// `l` and `r` (alike) as one linear: l's outputs, then r's; the bias as given.
static HeadChain::Linear side_by_side(const HeadChain::Linear& l, const HeadChain::Linear& r, at::Tensor bias, int64_t hidden) {
  return {cat2(l.qs, r.qs), cat2(l.d, r.d), cat2(l.m, r.m), l.inv_smooth, std::move(bias), 2 * hidden};
}

HeadChain::Linear HeadChain::linear_of(const std::vector<at::Tensor>& t, int64_t at_, int64_t out) {
  TORCH_CHECK(static_cast<int64_t>(t.size()) >= at_ + 5, "HeadChain: a linear is (qs, d, m, 1/smooth, bias)");
  return {t[at_], t[at_ + 1], t[at_ + 2], t[at_ + 3], t[at_ + 4], out};
}

HeadChain::HeadChain(std::vector<std::vector<std::vector<at::Tensor>>> heads, std::vector<std::vector<at::Tensor>> lm_heads,
                     at::Tensor embed, at::Tensor draft_vocab, int64_t hidden, int64_t lm_rows, int64_t isa)
    : embed(std::move(embed)), draft_vocab(std::move(draft_vocab)), hidden(hidden), isa(isa) {
  TORCH_CHECK(!heads.empty() && heads.size() == lm_heads.size(), "HeadChain: one LM head per head");
  TORCH_CHECK(!present(this->embed) || (this->embed.scalar_type() == at::kFloat && this->embed.is_contiguous() &&
                                        this->embed.dim() == 2 && this->embed.size(1) == hidden),
              "HeadChain: the embedding must be float32 [vocab, hidden]");
  TORCH_CHECK(!present(this->draft_vocab) || (this->draft_vocab.scalar_type() == at::kLong && this->draft_vocab.numel() == lm_rows),
              "HeadChain: the draft vocabulary must be int64 [LM head rows]");
  for (size_t i = 0; i < heads.size(); ++i) {
    std::vector<Block> blocks;
    for (const auto& b : heads[i]) {
      TORCH_CHECK(!b.empty() && b.size() % 10 == 0, "HeadChain: a ResBlock is its linear and its residual linear, 5 tensors each (a part)");
      if (b.size() > 10) {  // parted: each part's linear and residual side by side, the biases after the sum
        TORCH_CHECK(present(this->embed) && blocks.empty() && static_cast<int64_t>(b.size()) == 10 * static_cast<int64_t>(i + 2),
                    "HeadChain: head ", i, "'s first ResBlock has ", i + 2, " parts: [h ; E(root) ; ...]");
        Block block;
        for (size_t j = 0; j < b.size(); j += 10) {
          const auto l = linear_of(b, j, hidden), r = linear_of(b, j + 5, hidden);
          TORCH_CHECK(alike(l, r, hidden) && (j == 0 || !present(l.bias)),
                      "HeadChain: a part's two linears read their input alike, the biases with part 0");
          block.parts.push_back(side_by_side(l, r, at::Tensor(), hidden));
          if (j == 0) block.part_bias = cat2(l.bias, r.bias);
        }
        blocks.push_back(std::move(block));
        continue;
      }
      Block block{linear_of(b, 0, hidden), linear_of(b, 5, hidden), {}, false};
      const auto& l = block.lin;
      const auto& r = block.res;
      if (alike(l, r, hidden)) {
        block.both = side_by_side(l, r, cat2(l.bias, r.bias), hidden);
        block.fused = true;
      }
      blocks.push_back(std::move(block));
    }
    TORCH_CHECK(!blocks.empty(), "HeadChain: a head has at least one ResBlock");
    this->heads.push_back(std::move(blocks));
    lm.push_back(linear_of(lm_heads[i], 0, lm_rows));
  }
}

at::Tensor HeadChain::res_silu(const at::Tensor& y) const {
  return add_rows(y.narrow(1, hidden, hidden), heads_silu(y.narrow(1, 0, hidden)));
}

at::Tensor HeadChain::hidden_of(int64_t i, at::Tensor x, size_t from) const {
  for (size_t k = from; k < heads[i].size(); ++k) {
    const auto& b = heads[i][k];
    // ResBlock.forward: res_connection(x) + silu(linear(x)), the residual the identity where absent
    if (b.fused) {
      x = res_silu(b.both(x, isa));  // (1, 2 hidden): linear's outputs, then the residual's
      continue;
    }
    auto r = present(b.res.qs) ? b.res(x, isa) : x;
    x = add_rows(r, heads_silu(b.lin(x, isa)));
  }
  return x;
}

const float* HeadChain::token_part(int64_t i, int64_t j, int64_t token) const {
  const uint64_t key = (static_cast<uint64_t>(i) << 56) | (static_cast<uint64_t>(j) << 48) | static_cast<uint64_t>(token);
  {
    std::lock_guard<std::mutex> hold(kept_lock);
    auto it = kept_parts.find(key);
    if (it != kept_parts.end()) {
      ++kept_hits;
      return it->second.data();
    }
  }
  TORCH_CHECK(token >= 0 && token < embed.size(0), "HeadChain: token ", token, " is outside the embedding");
  const auto e = embed.narrow(0, token, 1);  // (1, hidden): PartedLinear's slice of [h ; E(t_0) ; ...]
  const auto y = heads[i][0].parts[j](e, isa).contiguous();
  std::vector<float> row(y.data_ptr<float>(), y.data_ptr<float>() + y.numel());
  std::lock_guard<std::mutex> hold(kept_lock);
  ++kept_misses;
  if ((static_cast<int64_t>(kept_parts.size()) + 1) * 2 * hidden * static_cast<int64_t>(sizeof(float)) > kKeptBytes) kept_parts.clear();
  auto [it, added] = kept_parts.emplace(key, std::move(row));  // a race's other decode may have kept it meanwhile: the same bits
  return it->second.data();
}

void HeadChain::set_refine(std::vector<std::pair<at::Tensor, at::Tensor>> rows, int64_t k) {
  TORCH_CHECK(rows.empty() || rows.size() == lm.size(), "HeadChain: Q8_0 rows for every LM head or none");
  TORCH_CHECK(k >= 0 && k <= kMaxRefine, "HeadChain: 0 to ", kMaxRefine, " rows refined");
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& [q, d] = rows[i];
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2 && q.size(0) == lm[i].out && q.size(1) == hidden &&
                    d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == lm[i].out * (hidden / 32),
                "HeadChain: LM head ", i, "'s Q8_0 rows must be int8 [", lm[i].out, ", ", hidden, "] with float16 scales [", lm[i].out, ", ",
                hidden / 32, "]");
  }
  refine_rows = std::move(rows);
  refine_k = refine_rows.empty() ? 0 : k;
}

std::tuple<int64_t, int64_t, int64_t> HeadChain::kept() const {
  std::lock_guard<std::mutex> hold(kept_lock);
  return {static_cast<int64_t>(kept_parts.size()), kept_hits, kept_misses};
}

void HeadChain::clear_kept() const {
  std::lock_guard<std::mutex> hold(kept_lock);
  kept_parts.clear();
  kept_hits = kept_misses = 0;
}

at::Tensor HeadChain::parted_hidden_of(int64_t i, const at::Tensor& f, const std::vector<int64_t>& path) const {
  // PartedLinear.forward for the linear and its residual side by side: part 0 on h, + each token's
  // part in order (float32 sums, as `y = y + part` rounds them), + the biases; then the block's
  // res + silu(lin) and the head's further blocks
  const Block& b = heads[i][0];
  auto y = b.parts[0](f, isa).contiguous();  // (1, 2 hidden)
  float* yp = y.data_ptr<float>();
  const int64_t n = 2 * hidden;
  for (int64_t j = 1; j < static_cast<int64_t>(b.parts.size()); ++j) {
    const float* t = token_part(i, j, path[j - 1]);
    for (int64_t k = 0; k < n; ++k) yp[k] = yp[k] + t[k];
  }
  if (present(b.part_bias)) {
    const float* bp = b.part_bias.data_ptr<float>();
    for (int64_t k = 0; k < n; ++k) yp[k] = yp[k] + bp[k];
  }
  return hidden_of(i, res_silu(y), 1);
}

HeadChain::Rows HeadChain::chain(at::Tensor feature, std::vector<int64_t> path, int64_t depth, c10::optional<Force> force,
                                 double p0, double settle, bool strict, int64_t settled_depth, int64_t unsettled_depth,
                                 bool ranked) const {
  TORCH_CHECK(feature.scalar_type() == at::kFloat && feature.numel() == hidden, "HeadChain: the feature must be float32 [hidden]");
  const bool reading = p0 >= 0;  // the policy's value is read (and may stop or extend the chain)
  const int64_t deepest = reading ? std::max({depth, settled_depth, unsettled_depth}) : depth;
  TORCH_CHECK(!path.empty() && deepest <= static_cast<int64_t>(heads.size()), "HeadChain: a path from the root, at most one head a depth");
  const bool grounded = present(embed);
  const int64_t first = static_cast<int64_t>(path.size()) - 1, n = std::max<int64_t>(0, deepest - first);
  const auto f = feature.reshape({1, hidden}).contiguous();
  std::vector<at::Tensor> rows;
  std::vector<float> probs(n);  // each node's probability, float32 as the modules' softmax gives it
  std::vector<int64_t> tokens;
  double g = p0;
  bool open = reading;  // the value still read: not settled, the feature's depth not reached
  int64_t target = depth;
  for (int64_t d = first; d < target; ++d) {
    at::Tensor h;
    if (grounded && !heads[d][0].parts.empty()) {  // the first block on parts: the token parts kept
      h = parted_hidden_of(d, f, path);
    } else {
      at::Tensor x = f;
      if (grounded) {  // HydraHeads.head_hidden: [h ; E(root) ; ... ; E(path[d])]
        x = at::empty({1, (d + 2) * hidden}, feature.options());
        float* xp = x.data_ptr<float>();
        std::memcpy(xp, f.data_ptr<float>(), hidden * sizeof(float));
        for (int64_t j = 0; j <= d; ++j) {
          TORCH_CHECK(path[j] >= 0 && path[j] < embed.size(0), "HeadChain: token ", path[j], " is outside the embedding");
          std::memcpy(xp + (j + 1) * hidden, embed.data_ptr<float>() + path[j] * hidden, hidden * sizeof(float));
        }
      }
      h = hidden_of(d, x);
    }
    auto z = lm[d](h, isa);  // (1, K)
    if (refine_k > 0) {  // DraftHeads.lm_logits: its best rows again in Q8_0, on the input the LM head read
      const Linear& l = lm[d];
      const at::Tensor xs = l.smoothed(h).contiguous();
      z = z.contiguous();
      refine_row(xs.data_ptr<float>(), z.data_ptr<float>(), l.out, hidden, refine_rows[d].first.data_ptr<int8_t>(),
                 refine_rows[d].second.data_ptr<at::Half>(), present(l.bias) ? l.bias.data_ptr<float>() : nullptr, refine_k);
    }
    // drafting.top1_logits: DraftHeads.top1 on blocks, the first maximal logit and its probability
    auto top1 = [&]() -> int64_t {
      z = z.contiguous();
      int64_t i = 0;
      probs[d - first] = top1_row(z.data_ptr<float>(), z.numel(), i);
      return i;
    };
    const bool own = ranked && force.has_value();  // the forcer's ranking and probability: no softmax
    int64_t idx = own ? -1 : top1();
    const auto asked = force.has_value() ? (*force)(path, own ? -1.0 : static_cast<double>(probs[d - first]), z.view({-1}))
                                         : std::pair<std::vector<int64_t>, double>{{}, -1.0};
    const auto& forced = asked.first;
    if (own && forced.empty()) idx = top1();
    if (asked.second >= 0) probs[d - first] = static_cast<float>(asked.second);
    if (!forced.empty()) {  // phrasebook.force_row: the row's maximum + m - j at the j-th of m (float32, as ATen adds)
      z = z.contiguous();
      float* zp = z.data_ptr<float>();
      float mx = zp[0];
      for (int64_t k = 1; k < z.numel(); ++k) mx = zp[k] > mx ? zp[k] : mx;
      // a first outside the draft vocabulary (-1 - token, phrasebook.spine_first) has no entry: the rest keep their order
      const int64_t skip = forced[0] < 0 ? 1 : 0, m = static_cast<int64_t>(forced.size()) - skip;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t at = forced[skip + j];
        TORCH_CHECK(at >= 0 && at < z.numel(), "HeadChain: a forced draft index ", at, " is outside the ", z.numel(), " rows");
        zp[at] = mx + static_cast<float>(m - j);
      }
      idx = forced[0];
    }
    const int64_t token = idx < 0 ? -1 - idx : present(draft_vocab) ? draft_vocab.data_ptr<int64_t>()[idx] : idx;
    rows.push_back(z.view({-1}));  // (K,)
    path.push_back(token);
    tokens.push_back(token);
    if (open) {  // policy.path_value: g = p0, then g *= p_d (each float32 probability widened exactly)
      g *= static_cast<double>(probs[d - first]);
      if (strict ? g < settle : g <= settle) {
        open = false;
        target = std::max(d + 1, settled_depth);
      } else if (d + 1 >= depth) {
        open = false;
        target = std::max(depth, unsettled_depth);
      }
    }
  }
  probs.resize(rows.size());
  return {std::move(rows), std::vector<double>(probs.begin(), probs.end()), std::move(tokens)};  // each float32 widened exactly
}

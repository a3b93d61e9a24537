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

#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cstring>
#include <tuple>

namespace {

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

}  // namespace

// A chain's activations are rows of float32 in buffers made once a call: each elementwise product
// and sum is a loop here (one IEEE operation an element, as ATen's mul and add round them: the
// same bits) and each product `linear_row`, with no ATen call at a node (after a base step each
// found the dispatcher's code cold), but the new tensor that holds each node's logits.
// Two tensors stacked along the first dimension (empty where the first is).
static at::Tensor cat2(const at::Tensor& a, const at::Tensor& c) { return present(a) ? at::cat({a, c}, 0).contiguous() : a; }

void HeadChain::Linear::bind() {
  w = row_weights(qs, d, m, out);
  TORCH_CHECK(!present(inv_smooth) || (inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous() && inv_smooth.numel() == w.K),
              "HeadChain: a linear's 1/smooth must be float32 [", w.K, "]");
  TORCH_CHECK(!present(bias) || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == out),
              "HeadChain: a linear's bias must be float32 [", out, "]");
  inv = present(inv_smooth) ? inv_smooth.data_ptr<float>() : nullptr;
  b = present(bias) ? bias.data_ptr<float>() : nullptr;
}

const float* HeadChain::Linear::row(const float* x, float* y, float* xs, int64_t isa) const {
  // BlockLinear.forward: x * (1 / smooth), the product on Q8 inputs, + bias
  const float* in = x;
  if (inv != nullptr) {
    for (int64_t k = 0; k < w.K; ++k) xs[k] = x[k] * inv[k];
    in = xs;
  }
  linear_row(w, in, y, isa);
  if (b != nullptr)
    for (int64_t k = 0; k < out; ++k) y[k] = y[k] + b[k];
  return in;
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
  // every linear's raw pointers, checked once
  auto bind = [&](Linear& l) {
    if (!present(l.qs)) return;
    l.bind();
    max_in = std::max(max_in, l.w.K);
  };
  for (auto& blocks : this->heads)
    for (auto& b : blocks) {
      bind(b.lin), bind(b.res), bind(b.both);
      for (auto& p : b.parts) bind(p);
      TORCH_CHECK(!present(b.part_bias) || (b.part_bias.scalar_type() == at::kFloat && b.part_bias.is_contiguous() && b.part_bias.numel() == 2 * hidden),
                  "HeadChain: a parted block's biases must be float32 [2 hidden]");
      b.part_b = present(b.part_bias) ? b.part_bias.data_ptr<float>() : nullptr;
    }
  for (auto& l : lm) {
    bind(l);
    TORCH_CHECK(l.w.K == hidden, "HeadChain: an LM head reads the head's hidden state (", hidden, " inputs)");
  }
  max_in = std::max(max_in, 2 * hidden);
  embed_rows = present(this->embed) ? this->embed.data_ptr<float>() : nullptr;
  draft_ids = present(this->draft_vocab) ? this->draft_vocab.data_ptr<int64_t>() : nullptr;
}

HeadChain::Scratch HeadChain::scratch(int64_t depth) const {
  // the widest activation: a grounded head's input [h ; E(t_0) ; ... ; E(t_d)] where it is not parted
  const int64_t wide = std::max(max_in, (depth + 2) * hidden);
  return {std::vector<float>(wide), std::vector<float>(wide), std::vector<float>(2 * hidden), std::vector<float>(hidden),
          std::vector<float>(wide)};
}

void HeadChain::res_silu(const float* y2, float* act, float* out) const {
  // ResBlock.forward's res(x) + silu(lin(x)), the linear's outputs first in y2, the residual's after
  silu_row(y2, hidden, act);
  for (int64_t k = 0; k < hidden; ++k) out[k] = y2[hidden + k] + act[k];
}

const float* HeadChain::hidden_of(int64_t i, const float* x, Scratch& s, size_t from) const {
  for (size_t k = from; k < heads[i].size(); ++k) {
    const auto& b = heads[i][k];
    float* out = x == s.a.data() ? s.b.data() : s.a.data();
    // ResBlock.forward: res_connection(x) + silu(linear(x)), the residual the identity where absent
    if (b.fused) {
      b.both.row(x, s.y2.data(), s.xs.data(), isa);  // 2 hidden: linear's outputs, then the residual's
      res_silu(s.y2.data(), s.act.data(), out);
    } else {
      const float* r = x;
      if (present(b.res.qs)) {
        b.res.row(x, s.y2.data() + hidden, s.xs.data(), isa);
        r = s.y2.data() + hidden;
      }
      b.lin.row(x, s.y2.data(), s.xs.data(), isa);
      silu_row(s.y2.data(), hidden, s.act.data());
      for (int64_t c = 0; c < hidden; ++c) out[c] = r[c] + s.act[c];
    }
    x = out;
  }
  return x;
}

void HeadChain::add_token_part(int64_t i, int64_t j, int64_t token, float* y) const {
  // y + the part, summed while the lock is held: a race's other decode may forget every part kept
  // (past kKeptBytes) while this one reads
  const uint64_t key = (static_cast<uint64_t>(i) << 56) | (static_cast<uint64_t>(j) << 48) | static_cast<uint64_t>(token);
  const int64_t n = 2 * hidden;
  auto add = [&](const std::vector<float>& t) {
    for (int64_t k = 0; k < n; ++k) y[k] = y[k] + t[k];
  };
  {
    std::lock_guard<std::mutex> hold(kept_lock);
    auto it = kept_parts.find(key);
    if (it != kept_parts.end()) {
      ++kept_hits;
      add(it->second);
      return;
    }
  }
  TORCH_CHECK(token >= 0 && token < embed.size(0), "HeadChain: token ", token, " is outside the embedding");
  const Linear& part = heads[i][0].parts[j];
  std::vector<float> row(part.out), xs(part.w.K);
  part.row(embed_rows + token * hidden, row.data(), xs.data(), isa);  // PartedLinear's slice of [h ; E(t_0) ; ...]
  add(row);
  std::lock_guard<std::mutex> hold(kept_lock);
  ++kept_misses;
  if ((static_cast<int64_t>(kept_parts.size()) + 1) * n * static_cast<int64_t>(sizeof(float)) > kKeptBytes) kept_parts.clear();
  kept_parts.emplace(key, std::move(row));  // a race's other decode may have kept it meanwhile: the same bits
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
  refine_q.clear(), refine_d.clear();
  for (const auto& [q, d] : refine_rows) refine_q.push_back(q.data_ptr<int8_t>()), refine_d.push_back(d.data_ptr<at::Half>());
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

const float* HeadChain::parted_hidden_of(int64_t i, const float* f, const std::vector<int64_t>& path, Scratch& s) const {
  // PartedLinear.forward for the linear and its residual side by side: part 0 on h, + each token's
  // part in order (float32 sums, as `y = y + part` rounds them), + the biases; then the block's
  // res + silu(lin) and the head's further blocks
  const Block& b = heads[i][0];
  float* yp = s.y2.data();
  b.parts[0].row(f, yp, s.xs.data(), isa);  // 2 hidden
  const int64_t n = 2 * hidden;
  for (int64_t j = 1; j < static_cast<int64_t>(b.parts.size()); ++j) add_token_part(i, j, path[j - 1], yp);
  if (b.part_b != nullptr)
    for (int64_t k = 0; k < n; ++k) yp[k] = yp[k] + b.part_b[k];
  res_silu(yp, s.act.data(), s.a.data());
  return hidden_of(i, s.a.data(), s, 1);
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
  const auto fc = feature.is_contiguous() ? feature : feature.contiguous();
  const float* f = fc.data_ptr<float>();
  Scratch s = scratch(deepest);
  std::vector<at::Tensor> rows;
  std::vector<float> probs(n);  // each node's probability, float32 as the modules' softmax gives it
  std::vector<int64_t> tokens;
  double g = p0;
  bool open = reading;  // the value still read: not settled, the feature's depth not reached
  int64_t target = depth;
  for (int64_t d = first; d < target; ++d) {
    const float* h;
    if (grounded && !heads[d][0].parts.empty()) {  // the first block on parts: the token parts kept
      h = parted_hidden_of(d, f, path, s);
    } else {
      const float* x = f;
      if (grounded) {  // HydraHeads.head_hidden: [h ; E(root) ; ... ; E(path[d])]
        float* xp = s.b.data();
        std::memcpy(xp, f, hidden * sizeof(float));
        for (int64_t j = 0; j <= d; ++j) {
          TORCH_CHECK(path[j] >= 0 && path[j] < embed.size(0), "HeadChain: token ", path[j], " is outside the embedding");
          std::memcpy(xp + (j + 1) * hidden, embed_rows + path[j] * hidden, hidden * sizeof(float));
        }
        x = xp;
      }
      h = hidden_of(d, x, s);
    }
    const Linear& l = lm[d];
    at::Tensor z = at::detail::empty_cpu({l.out}, at::kFloat);  // the node's logits [K], handed to Python
    float* zp = z.data_ptr<float>();
    const float* xs = l.row(h, zp, s.xs.data(), isa);
    if (refine_k > 0)  // DraftHeads.lm_logits: its best rows again in Q8_0, on the input the LM head read
      refine_row(xs, zp, l.out, hidden, refine_q[d], refine_d[d], l.b, refine_k);
    // drafting.top1_logits: DraftHeads.top1 on blocks, the first maximal logit and its probability
    auto top1 = [&]() -> int64_t {
      int64_t i = 0;
      probs[d - first] = top1_row(zp, l.out, i);
      return i;
    };
    const bool own = ranked && force.has_value();  // the forcer's ranking and probability: no softmax
    int64_t idx = own ? -1 : top1();
    const auto asked = force.has_value() ? (*force)(path, own ? -1.0 : static_cast<double>(probs[d - first]), z)
                                         : std::pair<std::vector<int64_t>, double>{{}, -1.0};
    const auto& forced = asked.first;
    if (own && forced.empty()) idx = top1();
    if (asked.second >= 0) probs[d - first] = static_cast<float>(asked.second);
    if (!forced.empty()) {  // phrasebook.force_row: the row's maximum + m - j at the j-th of m (float32, as ATen adds)
      float mx = zp[0];
      for (int64_t k = 1; k < l.out; ++k) mx = zp[k] > mx ? zp[k] : mx;
      // a first outside the draft vocabulary (-1 - token, phrasebook.spine_first) has no entry: the rest keep their order
      const int64_t skip = forced[0] < 0 ? 1 : 0, m = static_cast<int64_t>(forced.size()) - skip;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t at = forced[skip + j];
        TORCH_CHECK(at >= 0 && at < l.out, "HeadChain: a forced draft index ", at, " is outside the ", l.out, " rows");
        zp[at] = mx + static_cast<float>(m - j);
      }
      idx = forced[0];
    }
    const int64_t token = idx < 0 ? -1 - idx : draft_ids != nullptr ? draft_ids[idx] : idx;
    rows.push_back(std::move(z));  // (K,)
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

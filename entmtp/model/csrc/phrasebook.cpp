// The phrasebook's drafting rule, natively: step for step what spec/phrasebook.py computes
// (`Context.matches`, `Context.propose`, `candidate_features`, `Reranker.rank`, `forcer`), so the
// same tokens go first. The reranker's float64 arithmetic runs in its own order (products summed
// input by input, no contraction): its probabilities agree with numpy's to ~1e-15, and the bank's
// traces, recorded through this same code where the extension serves, read the very bits the
// engine drafts with.
#include "phrasebook.h"

#include <ATen/ops/log_softmax.h>
#include <ATen/ops/topk.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>
#include <numeric>

namespace {

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL;  // phrasebook._MUL
constexpr int64_t kHeadCandidates = 16;           // phrasebook.HEAD_CANDIDATES
constexpr int64_t kFeatures = 14;                 // phrasebook.N_FEATURES

inline uint64_t mix(uint64_t h, int64_t t) { return (h ^ static_cast<uint64_t>(t + 1)) * kMul; }

}  // namespace

PhraseBook::PhraseBook(std::vector<std::vector<at::Tensor>> t, int64_t max_n) : max_n(max_n) {
  TORCH_CHECK(static_cast<int64_t>(t.size()) == max_n, "PhraseBook: one table per n-gram length");
  for (auto& parts : t) {
    TORCH_CHECK(parts.size() == 4, "PhraseBook: a table is (keys, token, count, total)");
    for (auto& p : parts) TORCH_CHECK(p.scalar_type() == at::kLong && p.is_contiguous() && p.dim() == 1, "PhraseBook: int64 vectors");
    TORCH_CHECK(parts[1].numel() == parts[0].numel() && parts[2].numel() == parts[0].numel() && parts[3].numel() == parts[0].numel(),
                "PhraseBook: a table's vectors have one length");
    Table t{parts[0], parts[1], parts[2], parts[3]};
    const int64_t size = t.keys.numel();
    TORCH_CHECK(size < (int64_t(1) << 31), "PhraseBook: a table of at most 2^31 keys");
    while (t.bits < 30 && (int64_t(1) << (t.bits + 1)) <= size) ++t.bits;
    const auto* keys = reinterpret_cast<const uint64_t*>(t.keys.data_ptr<int64_t>());
    t.start.assign((size_t(1) << t.bits) + 1, static_cast<int32_t>(size));
    for (int64_t i = size - 1; i >= 0; --i) t.start[t.bits ? keys[i] >> (64 - t.bits) : 0] = static_cast<int32_t>(i);
    for (int64_t bkt = static_cast<int64_t>(t.start.size()) - 2; bkt >= 0; --bkt)  // an empty bucket starts where the next does
      t.start[bkt] = std::min(t.start[bkt], t.start[bkt + 1]);
    tables.push_back(std::move(t));
  }
}

bool PhraseBook::get(int64_t n, uint64_t h, std::array<int64_t, 3>& out) const {
  const Table& t = tables[n - 1];
  const auto* keys = reinterpret_cast<const uint64_t*>(t.keys.data_ptr<int64_t>());
  const size_t bkt = t.bits ? h >> (64 - t.bits) : 0;
  const auto* end = keys + t.start[bkt + 1];
  const auto* at_ = std::lower_bound(keys + t.start[bkt], end, h);  // numpy.searchsorted within the hash's bucket
  if (at_ == end || *at_ != h) return false;
  const int64_t i = at_ - keys;
  out = {t.token.data_ptr<int64_t>()[i], t.count.data_ptr<int64_t>()[i], t.total.data_ptr<int64_t>()[i]};
  return true;
}

size_t PhraseForcer::KeyHash::operator()(const Key& k) const {
  uint64_t h = 0;
  for (auto it = k.gram.rbegin(); it != k.gram.rend(); ++it) h = mix(h, *it);
  return static_cast<size_t>(h);
}

PhraseForcer::PhraseForcer(std::shared_ptr<PhraseBook> book, at::Tensor draft_vocab, std::vector<std::pair<at::Tensor, at::Tensor>> ls,
                           int64_t first, int64_t min_n, double max_head_p, double min_share)
    : book(std::move(book)), first(first), min_n(min_n), max_head_p(max_head_p), min_share(min_share) {
  if (draft_vocab.defined() && draft_vocab.numel() > 0) {
    auto dv = draft_vocab.to(at::kLong).contiguous();
    ids.assign(dv.data_ptr<int64_t>(), dv.data_ptr<int64_t>() + dv.numel());
    index.assign(*std::max_element(ids.begin(), ids.end()) + 1, -1);
    for (size_t i = 0; i < ids.size(); ++i) index[ids[i]] = static_cast<int64_t>(i);
  }
  int64_t in = kFeatures;
  for (auto& [w, b] : ls) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == in && b.numel() == w.size(1), "PhraseForcer: layer shapes (", in, ", out), (out,)");
    auto wc = w.to(at::kDouble).contiguous(), bc = b.to(at::kDouble).contiguous();
    layers.push_back({std::vector<double>(wc.data_ptr<double>(), wc.data_ptr<double>() + wc.numel()),
                      std::vector<double>(bc.data_ptr<double>(), bc.data_ptr<double>() + bc.numel())});
    in = w.size(1);
    widths.push_back(in);
  }
  TORCH_CHECK(layers.empty() || in == 1, "PhraseForcer: a reranker gives one score");
}

void PhraseForcer::extend(const std::vector<int64_t>& more) {
  for (int64_t t : more) {  // Context.extend
    const int64_t k = static_cast<int64_t>(tokens.size());
    for (int64_t n = 1; n <= std::min(book->max_n, k); ++n) {
      Followers& f = seen[Key{std::vector<int64_t>(tokens.end() - n, tokens.end())}];
      auto it = std::find_if(f.begin(), f.end(), [t](const auto& e) { return e.first == t; });
      if (it == f.end())
        f.push_back({t, 1});
      else
        ++it->second;
    }
    tokens.push_back(t);
  }
}

std::vector<PhraseForcer::Match> PhraseForcer::matches(const std::vector<int64_t>& extra) const {
  // Context.matches: every suffix of the text and `extra` seen in the text or the book, longest first
  std::vector<int64_t> seq(tokens.end() - std::min<int64_t>(book->max_n, tokens.size()), tokens.end());
  seq.insert(seq.end(), extra.begin(), extra.end());
  const int64_t top = std::min<int64_t>(book->max_n, seq.size());
  std::vector<Match> out;
  uint64_t h = 0;
  Key key;
  for (int64_t n = 1; n <= top; ++n) {
    const int64_t t = seq[seq.size() - n];
    h = mix(h, t);
    key.gram.insert(key.gram.begin(), t);
    Match m{n, nullptr, false, {0, 0, 0}};
    auto it = seen.find(key);
    if (it != seen.end() && !it->second.empty()) m.local = &it->second;
    m.hit = book->get(n, h, m.book);
    if (!m.local && !m.hit) break;
    out.push_back(m);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

// tanh x = sign(x) (1 - 2 / (e^{2|x|} + 1)), e^y by Cody-Waite reduction (y = k ln 2 + r, |r| <=
// ln 2 / 2) and r's Taylor series to r^13 (a relative remainder under 1e-17), scaled by 2^k through
// the exponent bits: within a few 1e-16 of libm's tanh, in IEEE operations each exact to its
// rounding (the build contracts none into FMAs), four lanes at once with AVX2 (a tail padded to
// four), so the same bits on every CPU. The reranker's hidden
// layers called ATen's tanh before, whose kernel follows the CPU's vector width and whose dispatch,
// after a base step had evicted its code, cost tens of microseconds a call.
namespace {
constexpr double kLog2e = 1.44269504088896340736, kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
constexpr double kInvFact[14] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                 1.0 / 40320.0,      1.0 / 5040.0,      1.0 / 720.0,      1.0 / 120.0,     1.0 / 24.0,
                                 1.0 / 6.0,          0.5,               1.0,              1.0};  // 1/13! .. 1/0!

// Four lanes of tanh (see above) in place.
void tanh4(double* v) {
  const __m256d sign = _mm256_set1_pd(-0.0), one = _mm256_set1_pd(1.0), two = _mm256_set1_pd(2.0);
  const __m256d x = _mm256_loadu_pd(v);
  const __m256d y = _mm256_min_pd(_mm256_set1_pd(700.0), _mm256_mul_pd(two, _mm256_andnot_pd(sign, x)));  // a NaN stays
  const __m256d k = _mm256_floor_pd(_mm256_add_pd(_mm256_mul_pd(y, _mm256_set1_pd(kLog2e)), _mm256_set1_pd(0.5)));
  const __m256d r = _mm256_sub_pd(_mm256_sub_pd(y, _mm256_mul_pd(k, _mm256_set1_pd(kLn2Hi))), _mm256_mul_pd(k, _mm256_set1_pd(kLn2Lo)));
  __m256d p = _mm256_set1_pd(kInvFact[0]);
  for (int j = 1; j < 14; ++j) p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(kInvFact[j]));
  const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k)), _mm256_set1_epi64x(1023)), 52);
  const __m256d t = _mm256_sub_pd(one, _mm256_div_pd(two, _mm256_add_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(e)), one)));
  _mm256_storeu_pd(v, _mm256_or_pd(t, _mm256_and_pd(sign, x)));  // tanh is odd: x's sign on t (t >= 0)
}

void tanh_inplace(double* v, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) tanh4(v + i);
  if (i < n) {  // the tail through the same lanes, padded with zeros
    double pad[4] = {0.0, 0.0, 0.0, 0.0};
    std::copy(v + i, v + n, pad);
    tanh4(pad);
    std::copy(pad, pad + (n - i), v + i);
  }
}
}  // namespace

std::vector<double> PhraseForcer::scores(const std::vector<std::array<double, 14>>& x) const {
  // every candidate's layer at once: each output summed input by input (vectorised across outputs),
  // + the bias, then `tanh_inplace` over the whole layer
  const int64_t rows = static_cast<int64_t>(x.size());
  std::vector<double> a(rows * kFeatures);
  for (int64_t r = 0; r < rows; ++r) std::copy(x[r].begin(), x[r].end(), a.begin() + r * kFeatures);
  int64_t in = kFeatures;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& [w, b] = layers[l];
    const int64_t width = widths[l];
    std::vector<double> y(rows * width, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      double* yr = y.data() + r * width;
      const double* ar = a.data() + r * in;
      for (int64_t k = 0; k < in; ++k)
        for (int64_t j = 0; j < width; ++j) yr[j] += ar[k] * w[k * width + j];
      for (int64_t j = 0; j < width; ++j) yr[j] = yr[j] + b[j];
    }
    if (l + 1 < layers.size()) tanh_inplace(y.data(), static_cast<int64_t>(y.size()));
    a = std::move(y);
    in = width;
  }
  std::vector<double> out(rows);
  for (int64_t r = 0; r < rows; ++r) out[r] = a[r * in];
  return out;
}

std::pair<std::vector<int64_t>, double> PhraseForcer::draftable(const std::vector<int64_t>& toks, const std::vector<double>& probs) const {
  std::vector<int64_t> kept;
  double p = -1.0;
  for (size_t i = 0; i < toks.size(); ++i) {
    int64_t j = toks[i];
    if (!ids.empty()) j = toks[i] >= 0 && toks[i] < static_cast<int64_t>(index.size()) ? index[toks[i]] : -1;
    if (j < 0) {  // outside the draft vocabulary: the first goes first on the spine as -1 - token, later ones are passed over
      if (!kept.empty()) continue;
      j = -1 - toks[i];
    }
    if (kept.empty()) p = probs[i];
    kept.push_back(j);
  }
  return {kept, p};
}

std::pair<std::vector<int64_t>, double> PhraseForcer::force(const std::vector<int64_t>& path, double head_p, const at::Tensor& row) const {
  if (layers.empty()) {  // the share rule: the phrasebook's guess where the head is unsure, its probability standing
    if (head_p >= max_head_p) return {{}, -1.0};
    for (const auto& m : matches(path)) {  // Context.propose(path, min_n)
      if (m.n < min_n) break;
      int64_t token;
      double share;
      if (m.local) {
        const auto* best = &(*m.local)[0];
        int64_t total = 0;
        for (const auto& e : *m.local) {
          total += e.second;
          if (e.second > best->second) best = &e;  // the first seen of the largest count
        }
        token = best->first;
        share = static_cast<double>(best->second) / static_cast<double>(total);
      } else {
        token = m.book[0];
        share = static_cast<double>(m.book[1]) / static_cast<double>(m.book[2]);
      }
      if (share < min_share) return {{}, -1.0};
      return draftable({token}, {-1.0});
    }
    return {{}, -1.0};
  }
  if (depths > 0 && static_cast<int64_t>(path.size()) - 1 >= depths) return {{}, -1.0};  // Reranker.depths: the head's own here
  // head_top: the head's best draft indices and their log-probabilities (`head_top_row`, which
  // phrasebook.head_top calls too; ATen's where the row holds a NaN or an infinity, as there)
  // a float32 contiguous row (every node of a chain on blocks) is read in place: no ATen call
  const bool direct = row.scalar_type() == at::kFloat && row.is_contiguous();
  const auto r = direct ? row : row.to(at::kFloat).reshape({-1}).contiguous();
  float lp[kHeadCandidates];
  int64_t ix[kHeadCandidates];
  const int64_t h = std::min<int64_t>(kHeadCandidates, r.numel());
  if (!head_top_row(r.data_ptr<float>(), r.numel(), h, lp, ix)) {
    const auto [top, idx] = at::topk(at::log_softmax(r, -1), h);
    const auto topc = top.contiguous();
    const auto idxc = idx.contiguous();
    std::copy(topc.data_ptr<float>(), topc.data_ptr<float>() + h, lp);
    std::copy(idxc.data_ptr<int64_t>(), idxc.data_ptr<int64_t>() + h, ix);
  }
  // candidate_features: the candidates, first named first; found by a linear search while they are
  // a few dozen (most nodes), through a hash map once more (a long text's many followers of a token)
  std::vector<int64_t> cands;
  std::vector<std::array<double, kFeatures>> feats;
  std::unordered_map<int64_t, size_t> where;
  constexpr size_t kScan = 64;
  cands.reserve(kScan);
  feats.reserve(kScan);
  auto slot = [&](int64_t t) -> std::array<double, kFeatures>& {
    if (cands.size() <= kScan) {
      for (size_t i = 0; i < cands.size(); ++i)
        if (cands[i] == t) return feats[i];
    } else {
      if (where.empty())
        for (size_t i = 0; i < cands.size(); ++i) where.emplace(cands[i], i);
      const auto it = where.find(t);
      if (it != where.end()) return feats[it->second];
      where.emplace(t, cands.size());
    }
    cands.push_back(t);
    feats.push_back({});
    return feats.back();
  };
  for (int64_t k = 0; k < h; ++k) {
    auto& f = slot(ids.empty() ? ix[k] : ids[ix[k]]);
    f[0] = std::max(static_cast<double>(lp[k]), -20.0) / 10;
    f[1] = k == 0 ? 1.0 : 0.0;
    f[2] = 1.0;
  }
  const auto ms = matches(path);
  bool has_proposed = false;
  int64_t proposed = 0;
  for (const auto& m : ms) {
    if (m.local) {
      int64_t total = 0;
      const std::pair<int64_t, int64_t>* best = &(*m.local)[0];
      for (const auto& e : *m.local) {
        total += e.second;
        if (e.second > best->second) best = &e;
      }
      for (const auto& e : *m.local) {
        auto& f = slot(e.first);
        if (f[3] == 0) {
          f[3] = static_cast<double>(m.n) / 8;
          f[4] = static_cast<double>(e.second) / static_cast<double>(total);
          f[5] = std::log1p(static_cast<double>(e.second)) / 3;
          f[6] = e.first == best->first ? 1.0 : 0.0;
        }
      }
      if (!has_proposed) proposed = best->first, has_proposed = true;
    }
    if (m.hit) {
      auto& f = slot(m.book[0]);
      if (f[7] == 0) {
        f[7] = static_cast<double>(m.n) / 8;
        f[8] = static_cast<double>(m.book[1]) / static_cast<double>(m.book[2]);
        f[9] = std::log1p(static_cast<double>(m.book[2])) / 5;
      }
      if (!has_proposed) proposed = m.book[0], has_proposed = true;
    }
  }
  const double longest = ms.empty() ? 0.0 : static_cast<double>(ms[0].n) / 8;
  const double p1 = h ? std::exp(static_cast<double>(lp[0])) : 0.0;
  const double depth = static_cast<double>(path.size()) - 1;
  for (size_t i = 0; i < cands.size(); ++i) {
    auto& f = feats[i];
    if (f[2] == 0) f[0] = -2.0;
    f[10] = has_proposed && cands[i] == proposed ? 1.0 : 0.0;
    f[11] = longest;
    f[12] = depth;
    f[13] = p1;
  }
  // Reranker.rank: the `first` best (the first candidate on a tie), their softmax probabilities
  const auto s = scores(feats);
  const double mx = *std::max_element(s.begin(), s.end());
  std::vector<double> e(s.size());
  double sum = 0.0;
  for (size_t i = 0; i < s.size(); ++i) sum += (e[i] = std::exp(s[i] - mx));
  std::vector<size_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> key(s.size());  // phrasebook.tie_key: the score on a grid of 1e-9
  for (size_t i = 0; i < s.size(); ++i) key[i] = std::nearbyint(s[i] * 1e9);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key[a] > key[b]; });
  std::vector<int64_t> toks;
  std::vector<double> probs;
  for (size_t i = 0; i < order.size() && static_cast<int64_t>(i) < first; ++i) {
    toks.push_back(cands[order[i]]);
    probs.push_back(e[order[i]] / sum);
  }
  return draftable(toks, probs);
}

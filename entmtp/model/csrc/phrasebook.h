// The phrasebook's drafting rule at a node of the drafted spine, natively (phrasebook.cpp): what
// `spec/phrasebook.py`'s `forcer` computes in Python, for HeadChain::chain to call without leaving
// C++ (the Python callable cost ~0.35 ms a node on the 2-core AMD EPYC, about a tenth of a step).
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

// The most candidates `head_top_row` keeps.
constexpr int64_t kMaxTop = 64;
// phrasebook.head_top natively (layers.cpp): the k (at most kMaxTop) largest of n float32 logits z,
// best first (an equal value after the earlier ones), into idx, and their log-softmax into lp:
// (z_i - m) - log S in float64, rounded once to float32, with the maximum m and S = sum exp(z_j - m)
// summed as `confidence` sums them (the same bits on every CPU of the extension's floor). false,
// nothing written, where z holds a NaN or an infinity.
bool head_top_row(const float* z, int64_t n, int64_t k, float* lp, int64_t* idx);

// The stored answers' n-gram tables (`phrasebook.Table` for n = 1..max_n): sorted 64-bit hashes
// (as int64 tensors holding the uint64 bits), each one's most frequent follower, its count and
// the hash's count. The tensors are held, not copied.
struct PhraseBook {
  struct Table {
    at::Tensor keys, token, count, total;
    // where each bucket of hashes (their top `bits` bits) starts among the sorted keys: a lookup
    // searches one bucket (~1 key), not the whole table (~20 cache misses cold)
    int bits = 0;
    std::vector<int32_t> start;
  };
  std::vector<Table> tables;  // tables[n - 1]
  int64_t max_n;

  PhraseBook(std::vector<std::vector<at::Tensor>> tables, int64_t max_n);
  // (follower, its count, the suffix's count) of the n-gram hashed `h`, or false
  bool get(int64_t n, uint64_t h, std::array<int64_t, 3>& out) const;
};

// One request's text over a book and the rule that drafts with it: `phrasebook.Context` (the text
// so far and its own n-grams) and `phrasebook.forcer` (a `Reranker`'s, else the share rule's).
struct PhraseForcer {
  using Followers = std::vector<std::pair<int64_t, int64_t>>;  // (token, count), first seen first
  struct Match {
    int64_t n;
    const Followers* local;  // null: not seen in the text
    bool hit;
    std::array<int64_t, 3> book;
  };

  std::shared_ptr<PhraseBook> book;
  std::vector<int64_t> ids;     // draft index -> token id (empty: the whole vocabulary)
  std::vector<int64_t> index;   // token id -> draft index, -1 outside
  std::vector<std::pair<std::vector<double>, std::vector<double>>> layers;  // (W [in * out], b [out])
  std::vector<int64_t> widths;  // each layer's out
  int64_t first, min_n;
  double max_head_p, min_share;
  int64_t depths = 0;  // a reranker's nodes: depth < depths only, the deeper ones the head's own (0: every depth)
  std::vector<int64_t> tokens;

  // `layers` empty: the share rule (min_n, max_head_p, min_share); else a reranker's (W (in, out),
  // b (out,)) float64 layers and how many of its best go first.
  PhraseForcer(std::shared_ptr<PhraseBook> book, at::Tensor draft_vocab, std::vector<std::pair<at::Tensor, at::Tensor>> layers,
               int64_t first, int64_t min_n, double max_head_p, double min_share);

  void extend(const std::vector<int64_t>& more);
  // `phrasebook.forcer`'s callable: (the path from the root, the head's top-1 probability, its
  // logits [K]) -> (the draft indices to put first, the probability for the first or -1)
  std::pair<std::vector<int64_t>, double> force(const std::vector<int64_t>& path, double head_p, const at::Tensor& row) const;
  // `Reranker.scores` of (C, 14) float64 features: for the tests
  std::vector<double> scores(const std::vector<std::array<double, 14>>& x) const;

 private:
  struct Key {
    std::vector<int64_t> gram;
    bool operator==(const Key& o) const { return gram == o.gram; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  std::unordered_map<Key, Followers, KeyHash> seen;

  std::vector<Match> matches(const std::vector<int64_t>& extra) const;
  std::pair<std::vector<int64_t>, double> draftable(const std::vector<int64_t>& toks, const std::vector<double>& probs) const;
};

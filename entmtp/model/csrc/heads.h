// Draft heads on GGUF blocks (Q4_1 or Q8_0): a Hydra or Medusa head's top-1 chain in one call (heads.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include "gguf_linear.h"

#include <functional>
#include <mutex>
#include <unordered_map>
#include <tuple>
#include <vector>

// The index of the first maximal of n floats, torch.argmax's (layers.cpp).
int64_t argmax_row(const float* p, int64_t n);
// The heads' SiLU (into a new tensor, or of n floats into y) and softmax maximum on blocks
// (layers.cpp): one order of operations on every CPU.
at::Tensor heads_silu(at::Tensor x);
void silu_row(const float* x, int64_t n, float* y);
float top1_row(const float* z, int64_t n, int64_t& idx);

struct HeadChain {
  // One `gguf.BlockLinear`: packed values and scales, the Q4_1 minimums (empty: Q8_0 blocks), the
  // inverse smoothing (empty: none), the bias (empty: none), `out` outputs.
  struct Linear {
    at::Tensor qs, d, m, inv_smooth, bias;
    int64_t out;
    // the same as raw pointers (`bind`): the chain runs on them, with no ATen call at a node
    RowWeights w;
    const float *inv = nullptr, *b = nullptr;
    void bind();
    // BlockLinear.forward on one row: x * (1 / smooth) into `xs` (w.K floats), the product on Q8
    // inputs into y (out floats), + bias. Returns the input the product read (x, or xs smoothed).
    const float* row(const float* x, float* y, float* xs, int64_t isa) const;
  };
  // A ResBlock: res(x) + silu(lin(x)); `res.qs` empty for the identity. Where both linears read
  // the input alike (the same smoothing, the same block kind), `both` holds their blocks side by
  // side (lin's outputs, then res's) and runs them as one product: each output computed alone, the
  // same bits as two calls.
  // A widened first ResBlock on parts (`gguf.PartedLinear`): `parts[j]` holds part j of both
  // linears side by side (no bias), over inputs [j hidden, (j + 1) hidden) of [h ; E(t_0) ; ...];
  // their outputs are summed in order, then `part_bias` (lin's, then res's).
  struct Block {
    Linear lin, res, both;
    bool fused = false;
    std::vector<Linear> parts;
    at::Tensor part_bias;
    const float* part_b = nullptr;  // part_bias's values (null where empty)
  };

  std::vector<std::vector<Block>> heads;
  std::vector<Linear> lm;
  at::Tensor embed;        // the base model's input embedding, float32 [vocab, hidden]; empty: heads read the feature alone (Medusa)
  at::Tensor draft_vocab;  // int64 [K]: draft index -> token id; empty: the LM head covers the whole vocabulary
  int64_t hidden, isa;
  const float* embed_rows = nullptr;        // embed's values (null where empty)
  const int64_t* draft_ids = nullptr;       // draft_vocab's (null where empty)
  int64_t max_in = 0;                       // the widest input of any head linear

  // heads[i]: head i's ResBlocks, each 10 tensors (its linear's qs, d, m, 1/smooth, bias, then its
  // residual's, empty tensors where absent), or 10 a part for a parted block (the biases with part
  // 0, empty after); lm_heads[i]: head i's LM head (qs, d, m, 1/smooth, bias).
  HeadChain(std::vector<std::vector<std::vector<at::Tensor>>> heads, std::vector<std::vector<at::Tensor>> lm_heads, at::Tensor embed,
            at::Tensor draft_vocab, int64_t hidden, int64_t lm_rows, int64_t isa);

  // (the path from the root, the head's top-1 probability, its logits [K]) -> (the draft indices
  // to put first, best first (none: the head's own ranking); the probability recorded for the
  // node, or < 0: the head's top-1 probability stands)
  using Force = std::function<std::pair<std::vector<int64_t>, double>(const std::vector<int64_t>&, double, const at::Tensor&)>;

  // From `path` (the root and the chain's first tokens) on to `depth`: per head, its draft
  // logits [K], top-1 probability and the token the path goes on through. `force` (a phrasebook's, spec/phrasebook.py) may
  // name m draft indices at each node: the j-th's entry becomes the row's maximum + m - j (so
  // they rank first, as `phrasebook.force_row` makes them), the path goes on through the first,
  // and the node's probability is the one it gives where it gives one.
  // With `p0` >= 0 the chain stops early, after the first head whose path value g = p0 * p_1 * ...
  // (summed in double, as `policy.path_value` multiplies) has settled the policy's choice: g <=
  // `settle` (g < `settle` where `strict`): what the engine's head-by-head reading would stop at.
  // Once the value settles, the chain goes on (without reading it) to `settled_depth` where that is
  // deeper; where it reaches `depth` unsettled, on to `unsettled_depth`: the depths of the trees
  // the policy then picks (`Chooser.outcomes`), so the tree's own chain is in the same call.
  // `ranked`: `force` names the draft indices and gives the probability at every node whatever the
  // head's top-1 probability (a reranker's): the row's softmax is then computed only where it
  // names none (it is given -1 for that probability).
  // The rows come one tensor each [K], the probabilities (float32 values, widened) and the tokens
  // as plain lists: the engine reads them with no ATen call after the chain (the first after a
  // step's memory traffic finds the dispatcher's code cold: 0.1-0.3 ms on the AMD EPYC Zen 3).
  using Rows = std::tuple<std::vector<at::Tensor>, std::vector<double>, std::vector<int64_t>>;
  Rows chain(at::Tensor feature, std::vector<int64_t> path, int64_t depth, c10::optional<Force> force = c10::nullopt,
             double p0 = -1.0, double settle = 0.0, bool strict = false, int64_t settled_depth = -1,
             int64_t unsettled_depth = -1, bool ranked = false) const;

  // Each LM head served in Q4_1 with its best `k` rows computed again in Q8_0 (`gguf_linear.h`,
  // `refine_row`): per head, its rows in Q8_0 (int8 [K, hidden], float16 [K, hidden / 32]), as
  // `DraftHeads.lm_logits` refines them. Empty (the default): the LM heads' logits as they come.
  void set_refine(std::vector<std::pair<at::Tensor, at::Tensor>> rows, int64_t k);

  // The token parts kept so far: (entries, hits, misses); `clear_kept` forgets them.
  std::tuple<int64_t, int64_t, int64_t> kept() const;
  void clear_kept() const;

 private:
  static Linear linear_of(const std::vector<at::Tensor>& t, int64_t at, int64_t out);
  // A chain's row buffers, made once a call: the ResBlocks' two activations, their products side by
  // side, the SiLU, a smoothed input.
  struct Scratch {
    std::vector<float> a, b, y2, act, xs;
  };
  Scratch scratch(int64_t depth) const;
  // head i's ResBlocks from block `from` on, on x (its first block's inputs, or hidden): the
  // result (hidden floats) in s.a or s.b
  const float* hidden_of(int64_t i, const float* x, Scratch& s, size_t from = 0) const;
  // a ResBlock's end from its linear's and residual's outputs side by side (2 hidden): res + silu(lin) into out
  void res_silu(const float* y2, float* act, float* out) const;
  // head i on the feature and the path: its first ResBlock's parts (the token parts kept), then the rest
  const float* parted_hidden_of(int64_t i, const float* f, const std::vector<int64_t>& path, Scratch& s) const;
  // y (2 hidden) + part j (>= 1) of head i's first block on E(token), the part computed once a token
  void add_token_part(int64_t i, int64_t j, int64_t token, float* y) const;

  // `set_refine`'s rows per LM head and k (0: none refined)
  std::vector<std::pair<at::Tensor, at::Tensor>> refine_rows;
  std::vector<const int8_t*> refine_q;  // their values and scales
  std::vector<const at::Half*> refine_d;
  int64_t refine_k = 0;

  // Each token part as computed: a function of (head, part, token) alone, so keeping it changes
  // no bit. Bounded: past kKeptBytes all are forgotten at once. Two decodes (the app's race) share
  // the heads, so the map is locked.
  static constexpr int64_t kKeptBytes = int64_t(256) << 20;
  mutable std::mutex kept_lock;
  mutable std::unordered_map<uint64_t, std::vector<float>> kept_parts;
  mutable int64_t kept_hits = 0, kept_misses = 0;
};

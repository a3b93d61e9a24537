"""The base model's own answers as a draft source: a phrasebook.

A small model answers in set phrases ("Here are some tips", "def ", "= $"), and it repeats its
prompt and itself. So the token that most often followed the longest suffix of the context (up to
`MAX_N` tokens) in the model's stored training answers, or in the context itself (the prompt and
the text so far), is often the one it decodes next: on the evaluation continuations it is right
more often than the first Hydra head, at no cost in weights read (docs/heads.md, *A phrasebook*).

`Phrasebook` indexes the stored answers once (per n-gram length: a sorted array of 64-bit hashes
and the most frequent next token of each); `Context` adds the running text (exact n-grams, in a
dict) and answers `propose`. Both are deterministic functions of the token sequences they saw, so
a bank's traces and the engine see the same proposals.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from entmtp.config import ROOT, PhrasebookRule
from entmtp.model import ext

MAX_N = 8  # the longest suffix looked up
_MUL = 0x9E3779B97F4A7C15  # the hash's multiplier (odd, 64-bit)
_MASK = (1 << 64) - 1


def _mix(h: int, t: int) -> int:
    """One step of the tables' hash: ((h ^ (t + 1)) * _MUL) mod 2^64."""
    return ((h ^ (t + 1)) * _MUL) & _MASK


def ngram_hash(tokens: Sequence[int]) -> int:
    """`_mix` over the tokens from the last to the first (the tables' hash, one n-gram): every
    suffix's hash is a step of the next longer one's."""
    h = 0
    for t in reversed(tokens):
        h = _mix(h, int(t))
    return h


@dataclass(frozen=True)
class Table:
    """One n-gram length: sorted hashes, each one's most frequent next token (the smallest id on a
    tie), that token's count and the hash's count."""

    keys: np.ndarray  # (U,) uint64, sorted
    token: np.ndarray  # (U,) int64
    count: np.ndarray  # (U,) int64
    total: np.ndarray  # (U,) int64

    def get(self, h: int) -> tuple[int, int, int] | None:
        i = int(np.searchsorted(self.keys, np.uint64(h)))
        if i < len(self.keys) and int(self.keys[i]) == h:
            return int(self.token[i]), int(self.count[i]), int(self.total[i])
        return None


def _table(tokens: np.ndarray, offset: np.ndarray, n: int, packed: bool = True) -> Table:
    """The n-gram table of the concatenated sequences `tokens`; `offset[i]` = i's place in its sequence.

    Both orderings it needs ((hash, next) to count pairs, then per hash the largest count and the
    smallest token) sort one int64 key of the hash's rank among the distinct hashes, the count and
    the token packed together, where they fit in 63 bits (the default model: always); else, or with
    `packed` False, `np.lexsort` on the separate columns, the same order (tests compare the two).
    On the 2-core AMD EPYC Zen 3 the eight tables of the stored answers took 1.4 s instead of 3.0."""
    at = np.nonzero(offset >= n)[0]  # positions whose n tokens before lie in the same sequence
    h = np.zeros(len(at), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(1, n + 1):  # the last token first, as `ngram_hash`
            h = (h ^ (tokens[at - j].astype(np.uint64) + np.uint64(1))) * np.uint64(_MUL)
    nxt = tokens[at]
    if not len(at):
        return Table(h, nxt.astype(np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    # the hashes' ranks: equal hashes one rank, ranks in hash order
    hs, rank = np.unique(h, return_inverse=True)
    tb, rb, cb = int(nxt.max()).bit_length(), (len(hs) - 1).bit_length(), len(at).bit_length()
    packed = packed and nxt.min() >= 0 and rb + cb + tb <= 63
    # runs of equal (hash, next): their counts
    if packed:
        pair = np.unique((rank.astype(np.int64) << tb) | nxt, return_counts=True)
        pair_r, pair_t, pair_count = pair[0] >> tb, pair[0] & ((1 << tb) - 1), pair[1]
    else:
        order = np.lexsort((nxt, rank))
        r, t = rank[order], nxt[order]
        new_pair = np.ones(len(r), dtype=bool)
        new_pair[1:] = (r[1:] != r[:-1]) | (t[1:] != t[:-1])
        starts = np.nonzero(new_pair)[0]
        pair_count = np.diff(np.append(starts, len(r)))
        pair_r, pair_t = r[starts], t[starts]
    # per hash: the pair of the largest count, the smallest token on a tie
    if packed:
        order = np.argsort((pair_r.astype(np.int64) << (cb + tb)) | ((len(at) - pair_count) << tb) | pair_t)
    else:
        order = np.lexsort((pair_t, -pair_count, pair_r))
    pair_r, pair_t, pair_count = pair_r[order], pair_t[order], pair_count[order]
    first = np.ones(len(pair_r), dtype=bool)
    first[1:] = pair_r[1:] != pair_r[:-1]
    group = np.cumsum(first) - 1
    total = np.bincount(group, weights=pair_count).astype(np.int64)
    return Table(hs, pair_t[first].astype(np.int64), pair_count[first].astype(np.int64), total)


class Phrasebook:
    """The stored answers' n-gram tables, n = 1..max_n."""

    def __init__(self, sequences: Iterable[Sequence[int]], max_n: int = MAX_N):
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences if len(s)]
        self.max_n = max_n
        tokens = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
        self.n_tokens = len(tokens)
        offset = np.concatenate([np.arange(len(s)) for s in seqs]) if seqs else np.zeros(0, dtype=np.int64)
        self.tables = {n: _table(tokens, offset, n) for n in range(1, max_n + 1)}
        self._native = None

    def native(self, kernels):
        """The extension's view of the tables (`kernels.PhraseBook`, sharing their memory), made once."""
        if self._native is None:
            parts = [[torch.from_numpy(np.ascontiguousarray(a)) for a in (t.keys.view(np.int64), t.token, t.count, t.total)]
                     for t in (self.tables[n] for n in range(1, self.max_n + 1))]
            self._native = kernels.PhraseBook(parts, self.max_n)
        return self._native

    def context(self, tokens: Sequence[int] = ()) -> "Context":
        """A running context (the prompt, then each step's accepted tokens) over this book."""
        ctx = Context(self)
        ctx.extend(tokens)
        return ctx


@dataclass
class Proposal:
    token: int
    n: int  # the suffix length matched
    share: float  # the token's share of what followed that suffix
    local: bool  # found in the context itself (else in the stored answers)


@dataclass
class Context:
    """The text so far and its own n-grams: `propose` looks there first, then in the book."""

    book: Phrasebook
    tokens: list[int] = field(default_factory=list)
    _seen: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)  # n-gram -> {next: count}
    _indexed: int = 0  # tokens whose n-grams are in _seen: indexed when first asked (the extension's forcer keeps its own)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def _index(self) -> None:
        """_seen brought up to the text: each token counted after every suffix (up to max_n) before it."""
        for k in range(self._indexed, len(self.tokens)):
            t = self.tokens[k]
            for n in range(1, min(self.book.max_n, k) + 1):
                nexts = self._seen.setdefault(tuple(self.tokens[k - n : k]), {})
                nexts[t] = nexts.get(t, 0) + 1
        self._indexed = len(self.tokens)

    def matches(self, extra: Sequence[int] = ()) -> list[tuple[int, dict[int, int] | None, tuple[int, int, int] | None]]:
        """Every suffix of the text so far followed by `extra` that was seen, longest first: (n, its
        followers in the text itself {token: count} or None, the book's (most frequent follower,
        its count, the suffix's count) or None)."""
        self._index()
        seq = self.tokens[-self.book.max_n :] + [int(t) for t in extra]
        top = min(self.book.max_n, len(seq))
        hashes, h = [0], 0  # hashes[n]: the last n tokens' (`ngram_hash`), one pass
        for t in reversed(seq[-top:]):
            h = _mix(h, t)
            hashes.append(h)
        out = []
        for n in range(1, top + 1):  # a suffix seen in neither place has no longer one seen there: stop at it
            local, hit = self._seen.get(tuple(seq[-n:])), self.book.tables[n].get(hashes[n])
            if not local and hit is None:
                break
            out.append((n, local or None, hit))
        return out[::-1]

    def propose(self, extra: Sequence[int] = (), min_n: int = 1) -> Proposal | None:
        """The next token after the text so far followed by `extra`: the longest suffix (at least
        `min_n` tokens) seen in the text so far, else in the book; the most frequent follower there
        (in the text: the first seen on a tie)."""
        for n, local, hit in self.matches(extra):
            if n < min_n:
                break
            if local:
                token = max(local, key=local.get)  # the first seen of the largest count
                return Proposal(token, n, local[token] / sum(local.values()), True)
            return Proposal(hit[0], n, hit[1] / hit[2], False)
        return None


HEAD_CANDIDATES = 16  # the head's top tokens the reranker scores, beside every token the phrasebook names
N_FEATURES = 14


def candidate_features(matches: list, head_tokens: Sequence[int], head_logp: Sequence[float], depth: int) -> tuple[list[int], np.ndarray]:
    """The reranker's candidates at one node and their features (C, N_FEATURES): the head's top
    tokens (`head_tokens`, log-probabilities `head_logp`, best first) and every token the phrasebook
    names there (`Context.matches`). Per candidate: the head's log-probability (/10; -2 where not
    among its top), whether it is the head's top-1, whether among its top; in the text itself the
    longest suffix it followed (/8), its share and count there, whether the most frequent there;
    in the book the longest suffix whose most frequent follower it is (/8), that share and the
    suffix's count; whether `propose` would name it; the longest suffix seen (/8); the depth; the
    head's top-1 probability."""
    feats: dict[int, list[float]] = {}
    for k, (t, lp) in enumerate(zip(head_tokens, head_logp)):
        f = feats.setdefault(int(t), [0.0] * N_FEATURES)
        f[0], f[1], f[2] = max(float(lp), -20.0) / 10, float(k == 0), 1.0
    proposed = None
    for n, local, hit in matches:
        if local:
            total = sum(local.values())
            top = max(local, key=local.get)
            for t, c in local.items():
                f = feats.setdefault(t, [0.0] * N_FEATURES)
                if f[3] == 0:
                    f[3], f[4], f[5], f[6] = n / 8, c / total, float(np.log1p(c)) / 3, float(t == top)
            proposed = top if proposed is None else proposed
        if hit is not None:
            f = feats.setdefault(hit[0], [0.0] * N_FEATURES)
            if f[7] == 0:
                f[7], f[8], f[9] = n / 8, hit[1] / hit[2], float(np.log1p(hit[2])) / 5
            proposed = hit[0] if proposed is None else proposed
    longest = matches[0][0] / 8 if matches else 0.0
    p1 = float(np.exp(head_logp[0])) if len(head_logp) else 0.0
    for t, f in feats.items():
        if f[2] == 0:
            f[0] = -2.0
        f[10], f[11], f[12], f[13] = float(t == proposed), longest, float(depth), p1
    return list(feats), np.array(list(feats.values()), dtype=np.float64).reshape(-1, N_FEATURES)


@dataclass(frozen=True)
class Reranker:
    """A small scorer (two tanh layers) of the candidates at a node of the drafted spine: the
    head's top tokens and the phrasebook's, from `candidate_features`. Its `first` best go first
    in that node's ranking, the head's own order after them; with `depths`, at the spine's first
    `depths` nodes only (a node costs about as much again as the head's own there, and deep nodes
    are reached on few steps). Fitted on the banks' calibration prompts (scripts/fit_reranker.py);
    stored as JSON beside the Hydra heads it reads."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]  # (W (in, out), b (out,)) each; the last has out = 1
    first: int = 2
    path: str = ""  # the file, relative to the repository
    sha256: str = ""
    heads_sha256: str = ""  # the weights of the heads it was fitted for
    depths: int = 0  # it ranks the nodes of depth < depths only, the deeper ones keep the head's ranking (0: every depth)

    @classmethod
    def load(cls, path: Path) -> "Reranker":
        raw = path.read_bytes()
        d = json.loads(raw)
        layers = tuple((np.asarray(w, dtype=np.float64), np.asarray(b, dtype=np.float64)) for w, b in d["layers"])
        if layers[0][0].shape[0] != N_FEATURES or layers[-1][0].shape[1] != 1:
            raise ValueError(f"{path}: a reranker reads {N_FEATURES} features and gives one score")
        try:
            rel = str(path.resolve().relative_to(ROOT))
        except ValueError:
            rel = str(path)
        return cls(layers, int(d.get("first", 2)), rel, hashlib.sha256(raw).hexdigest()[:16], d.get("heads_sha256", ""),
                   int(d.get("depths", 0)))

    def save(self, path: Path, meta: dict) -> None:
        d = {"first": self.first, "layers": [[w.tolist(), b.tolist()] for w, b in self.layers]} | ({"depths": self.depths} if self.depths else {}) | meta
        path.write_text(json.dumps(d) + "\n")

    def scores(self, x: np.ndarray) -> np.ndarray:
        """(C, N_FEATURES) -> (C,), in float64."""
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < len(self.layers) - 1:
                x = np.tanh(x)
        return x[:, 0]

    def rank(self, matches: list, head_idx: list[int], head_logp: list[float], depth: int,
             ids: list[int] | None = None) -> tuple[list[int], list[float]]:
        """The `first` best tokens at a node and the probability the scorer gives each (a softmax
        over the candidates: its confidence that the token comes next): `matches` =
        `Context.matches` there, the head's top draft indices `head_idx` (token ids through `ids`,
        the draft vocabulary, where given) with their log-probabilities, `depth` = the node's (0:
        the first head's)."""
        tokens = [ids[i] for i in head_idx] if ids else head_idx
        cands, x = candidate_features(matches, tokens, head_logp, depth)
        s = self.scores(x)
        p = softmax(s)
        best = sorted(range(len(cands)), key=lambda i: -tie_key(s[i]))[: self.first]  # stable: the first candidate on a tie
        return [cands[i] for i in best], [float(p[i]) for i in best]


def tie_key(score: float) -> float:
    """A score on a grid of 1e-9, the key candidates are ranked by (the first on a tie): identical
    features can score a few ulps apart in numpy's BLAS (a row's sum order depends on where the row
    falls in the matrix), never in the extension, so exact scores would order such ties apart."""
    return float(np.rint(score * 1e9))


def softmax(s: np.ndarray) -> np.ndarray:
    """The scorer's probabilities over the candidates from their scores (C,)."""
    p = np.exp(s - s.max())
    return p / p.sum()


def head_top(row: torch.Tensor) -> tuple[list[float], list[int]]:
    """The head's `HEAD_CANDIDATES` best draft indices at a node, best first, and their
    log-probabilities, from its logits (K,): where the extension is loaded, by its `head_top`
    (as its forcer reads them: an equal logit after the earlier ones, the log-softmax summed in
    its own order), else by ATen's log_softmax and topk."""
    row = row.float().view(-1)
    kernels = ext.loaded() if row.device.type == "cpu" and bool(torch.isfinite(row).all()) else None
    if kernels is not None:
        top, idx = kernels.head_top(row, min(HEAD_CANDIDATES, row.numel()))
        return top.tolist(), idx.tolist()
    logp = torch.log_softmax(row, -1)
    top, idx = logp.topk(min(HEAD_CANDIDATES, logp.numel()))
    return top.tolist(), idx.tolist()


Rule = PhrasebookRule | Reranker
Forcer = Callable[[Sequence[int], float, torch.Tensor], tuple[list[int], float]]
"""(spine path from the root, the head's top-1 probability, its logits) -> (the draft indices to
put first, the first possibly a token outside the vocabulary as -1 - token (`spine_first`), the
drafter's probability for the first of them, or -1: the head's own stands)."""


class NativeForcer:
    """`forcer`'s callable run by the extension (`csrc/phrasebook.cpp`, the same steps in C++):
    it keeps its own copy of the text, brought up to `ctx`'s before each use, and `HeadChain`
    calls it at each node without returning to Python (`heads.top1_on_blocks`)."""

    def __init__(self, ctx: Context, native):
        self.ctx, self.native, self.synced = ctx, native, 0

    def sync(self):
        """The extension's forcer, its text now `ctx`'s."""
        if len(self.ctx.tokens) > self.synced:
            self.native.extend(self.ctx.tokens[self.synced :])
            self.synced = len(self.ctx.tokens)
        return self.native

    def __call__(self, path: Sequence[int], head_p: float, row: torch.Tensor) -> tuple[list[int], float]:
        idx, p = self.sync().force([int(t) for t in path], float(head_p), row)
        return list(idx), p


def forcer(ctx: Context, rule: Rule, draft_vocab: torch.Tensor, native: bool = True) -> Forcer:
    """What drafting asks at each node of the rank-0 spine: the draft-vocabulary indices of the
    tokens that go first after `path` (the root and the spine so far, after the text of `ctx`),
    best first ([]: the head's own ranking), and the probability the spine's next token is right.
    Under a `PhrasebookRule`, the phrasebook's guess where the rule lets it, the head's top-1
    probability standing (-1); under a `Reranker`, its best candidates and its probability for the
    first, which the path value then reads. A token outside the heads' draft vocabulary (empty:
    the whole vocabulary) has no entry in the head's row: the first may still go first on the
    spine, named as `-1 - token` (`spine_first`; the row keeps the rest, the node's rank-0 child is
    that token); any later one is passed over."""
    kernels = ext.loaded() if native else None  # where the served model runs on the extension, so does this
    if kernels is not None:
        layers = [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in rule.layers] if isinstance(rule, Reranker) else []
        first = rule.first if isinstance(rule, Reranker) else 1
        share = (0, 0.0, 0.0) if isinstance(rule, Reranker) else (rule.min_n, rule.max_head_p, rule.min_share)
        force = kernels.PhraseForcer(ctx.book.native(kernels), draft_vocab.cpu(), layers, first, *share)
        force.depths = rule.depths if isinstance(rule, Reranker) else 0
        return NativeForcer(ctx, force)
    ids = draft_vocab.tolist()
    index = {t: i for i, t in enumerate(ids)} if ids else None

    def draftable(tokens: list[int], probs: list[float]) -> tuple[list[int], float]:
        """The tokens' draft indices (the first outside the vocabulary as -1 - token, later ones
        outside it passed over) and the first one's probability."""
        kept: list[int] = []
        p = -1.0
        for t, q in zip(tokens, probs):
            i = t if index is None else index.get(t)
            if i is None:
                if kept:
                    continue
                i = -1 - t
            if not kept:
                p = q
            kept.append(i)
        return kept, p

    if isinstance(rule, Reranker):
        def rerank(path: Sequence[int], head_p: float, row: torch.Tensor) -> tuple[list[int], float]:
            if rule.depths and len(path) - 1 >= rule.depths:
                return [], -1.0  # past the depths it ranks: the head's own ranking and probability
            lp, idx = head_top(row)
            return draftable(*rule.rank(ctx.matches(path), idx, lp, len(path) - 1, ids))

        return rerank

    def force(path: Sequence[int], head_p: float, row: torch.Tensor) -> tuple[list[int], float]:
        if head_p >= rule.max_head_p:
            return [], -1.0
        guess = ctx.propose(path, rule.min_n)
        if guess is None or guess.share < rule.min_share:
            return [], -1.0
        return draftable([guess.token], [-1.0])  # the head's top-1 probability stands

    return force


def spine_first(indices: Sequence[int]) -> int:
    """The token a forcer puts first from outside the draft vocabulary (`-1 - token` first in
    `indices`), or -1: the node's rank-0 child, ahead of everything its row ranks."""
    return -1 - indices[0] if indices and indices[0] < 0 else -1


def force_row(row: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """The head's logits (K,) with the draft indices `indices` made the largest, in that order:
    its top-k is then they followed by the head's own ranking of the rest (the merged ranking
    drafting and traces share; a first outside the vocabulary, `spine_first`, has no entry and
    ranks ahead of the row). Float32 sums, as the extension's HeadChain makes them."""
    indices = [i for i in indices if i >= 0]
    row = row.clone()
    top = row.max()
    for j, i in enumerate(indices):
        row[i] = top + float(len(indices) - j)
    return row

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

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from entmtp.config import PhrasebookRule

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


def _table(tokens: np.ndarray, offset: np.ndarray, n: int) -> Table:
    """The n-gram table of the concatenated sequences `tokens`; `offset[i]` = i's place in its sequence."""
    at = np.nonzero(offset >= n)[0]  # positions whose n tokens before lie in the same sequence
    h = np.zeros(len(at), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(1, n + 1):  # the last token first, as `ngram_hash`
            h = (h ^ (tokens[at - j].astype(np.uint64) + np.uint64(1))) * np.uint64(_MUL)
    nxt = tokens[at]
    order = np.lexsort((nxt, h))
    h, nxt = h[order], nxt[order]
    # runs of equal (hash, next): their counts
    new_pair = np.ones(len(h), dtype=bool)
    new_pair[1:] = (h[1:] != h[:-1]) | (nxt[1:] != nxt[:-1])
    starts = np.nonzero(new_pair)[0]
    pair_count = np.diff(np.append(starts, len(h)))
    pair_h, pair_t = h[starts], nxt[starts]
    # per hash: the pair of the largest count, the smallest token on a tie
    order = np.lexsort((pair_t, -pair_count, pair_h))
    pair_h, pair_t, pair_count = pair_h[order], pair_t[order], pair_count[order]
    first = np.ones(len(pair_h), dtype=bool)
    first[1:] = pair_h[1:] != pair_h[:-1]
    group = np.cumsum(first) - 1
    total = np.bincount(group, weights=pair_count).astype(np.int64)
    return Table(pair_h[first], pair_t[first].astype(np.int64), pair_count[first].astype(np.int64), total)


class Phrasebook:
    """The stored answers' n-gram tables, n = 1..max_n."""

    def __init__(self, sequences: Iterable[Sequence[int]], max_n: int = MAX_N):
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences if len(s)]
        self.max_n = max_n
        tokens = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
        self.n_tokens = len(tokens)
        offset = np.concatenate([np.arange(len(s)) for s in seqs]) if seqs else np.zeros(0, dtype=np.int64)
        self.tables = {n: _table(tokens, offset, n) for n in range(1, max_n + 1)}

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

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            t = int(t)
            k = len(self.tokens)
            for n in range(1, min(self.book.max_n, k) + 1):
                nexts = self._seen.setdefault(tuple(self.tokens[k - n :]), {})
                nexts[t] = nexts.get(t, 0) + 1
            self.tokens.append(t)

    def propose(self, extra: Sequence[int] = (), min_n: int = 1) -> Proposal | None:
        """The next token after the text so far followed by `extra`: the longest suffix (at least
        `min_n` tokens) seen in the text so far, else in the book; the most frequent follower there
        (in the text: the first seen on a tie)."""
        seq = self.tokens[-self.book.max_n :] + [int(t) for t in extra]
        top = min(self.book.max_n, len(seq))
        hashes, h = [0], 0  # hashes[n]: the last n tokens' (`ngram_hash`), one pass
        for t in reversed(seq[-top:]):
            h = _mix(h, t)
            hashes.append(h)
        for n in range(top, min_n - 1, -1):
            gram = tuple(seq[-n:])
            nexts = self._seen.get(gram)
            if nexts:
                token = max(nexts, key=nexts.get)  # the first seen of the largest count
                return Proposal(token, n, nexts[token] / sum(nexts.values()), True)
            hit = self.book.tables[n].get(hashes[n])
            if hit is not None:
                return Proposal(hit[0], n, hit[1] / hit[2], False)
        return None

Forcer = Callable[[Sequence[int], float], "int | None"]  # (spine path from the root, head's top-1 prob) -> draft index


def forcer(ctx: Context, rule: PhrasebookRule, draft_vocab: torch.Tensor) -> Forcer:
    """What drafting asks at each node of the rank-0 spine: the draft-vocabulary index of the
    phrasebook's guess for the token after `path` (the root and the spine so far, after the text of
    `ctx`), where `rule` lets it go first, else None. A guess outside the heads' draft vocabulary
    (empty: the whole vocabulary) cannot be drafted and is passed over."""
    ids = draft_vocab.tolist()
    index = {t: i for i, t in enumerate(ids)} if ids else None

    def force(path: Sequence[int], head_p: float) -> int | None:
        if head_p >= rule.max_head_p:
            return None
        guess = ctx.propose(path, rule.min_n)
        if guess is None or guess.share < rule.min_share:
            return None
        return guess.token if index is None else index.get(guess.token)

    return force


def force_row(row: torch.Tensor, index: int) -> torch.Tensor:
    """The head's logits (K,) with draft index `index` made the largest: its top-k is then the
    guess followed by the head's own ranking of the rest (the merged ranking drafting and traces share)."""
    row = row.clone()
    row[index] = row.max() + 1.0
    return row

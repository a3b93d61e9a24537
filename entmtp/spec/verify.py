"""Tree verification in one base forward (`model.forward` runs it on whatever cache), greedy
acceptance and lossless tree sampling."""

from __future__ import annotations

import math

import torch

from entmtp.model import forward
from entmtp.spec.topology import Tree


def tree_forward(model, cache, tree: Tree, tokens: torch.Tensor, past: int):
    """Verify all tree tokens at once: each node attends the cache and its ancestors, at position
    past + its depth. -> hidden (N, H), logits (N, V)."""
    return forward.block_forward(model, cache, tokens, tree.depth_on(tokens.device), tree.mask_block, past)


def accept_greedy(tree: Tree, tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """Longest path whose every token is the base argmax at its parent.

    Returns the accepted node ids (root first) and the next root (argmax at the last one).
    """
    node, path = 0, [0]
    while True:
        want = target[node]
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


def accept_sample(
    tree: Tree, tokens: list[int], logits: torch.Tensor, temperature: float, gen: torch.Generator
) -> tuple[list[int], int]:
    """Lossless tree sampling for deterministic (top-k) drafts.

    At a node with target p, try its children in rank order: accept child x with probability
    p(x); on rejection set p(x) = 0 and renormalise. If all fail, the next root is drawn from
    the residual p. Every emitted token is then distributed exactly as under plain sampling.
    """
    node, path = 0, [0]
    while True:
        p = torch.softmax(logits[node].float() / temperature, -1).cpu()
        for c in tree.children[node]:
            x = tokens[c]
            if float(torch.rand((), generator=gen)) < float(p[x]):
                path.append(c)
                node = c
                break
            p[x] = 0.0
            p = p / p.sum()
        else:
            return path, sample(p, gen)


def accept_typical(
    tree: Tree,
    tokens: list[int],
    logits: torch.Tensor,
    temperature: float,
    gen: torch.Generator,
    epsilon: float,
    alpha: float,
) -> tuple[list[int], int]:
    """Hydra/Medusa typical acceptance: accept the first child with p(x) > min(eps, alpha*e^-H).

    LOSSY: the output no longer follows the base model's distribution. Opt-in, for parity only.
    """
    node, path = 0, [0]
    while True:
        p = torch.softmax(logits[node].float() / temperature, -1).cpu()
        entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
        threshold = min(epsilon, alpha * math.exp(-entropy))
        nxt = next((c for c in tree.children[node] if float(p[tokens[c]]) > threshold), None)
        if nxt is None:
            return path, sample(p, gen)
        path.append(nxt)
        node = nxt

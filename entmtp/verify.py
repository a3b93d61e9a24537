"""Tree verification in one base forward, greedy acceptance and lossless tree sampling."""

from __future__ import annotations

import math

import torch

from . import decoder, graphs, kv
from .topology import Tree


def forward(model, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None):
    """One base-model forward. input_ids (1, Q) -> final normed hidden (Q, H), logits (Q, V).
    Llama models on a CPU take `decoder.forward` (the same arithmetic, bit for bit, with less
    overhead); a CUDA-graph cache (`graphs.Cache`) runs its slot's forward eagerly (prompts vary
    in length; `mask` is None, causal, or a 4-D additive mask whose cached columns are all visible);
    everything else runs transformers' forward."""
    if isinstance(cache, graphs.Cache):
        slot, n = cache.slot, input_ids.shape[1]
        past = slot.length
        block = graphs.causal_block(n, slot.dtype, slot.device) if mask is None else mask[0, 0, :, past:]
        return slot.block(input_ids[0], position_ids[0] - past, block, graph=False)
    lean = decoder.forward(model, cache, input_ids, position_ids, mask)
    if lean is not None:
        return lean
    base = model.base_model
    out = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kv.cache_arg(base, cache))
    hidden = out.last_hidden_state[0]
    return hidden, model.get_output_embeddings()(hidden)


def tree_forward(model, cache, tree: Tree, tokens: torch.Tensor, past: int):
    """Verify all tree tokens at once: 4-D mask [1, 1, N, past+N], position ids past + depth."""
    device = tokens.device
    dtype = model.get_output_embeddings().weight.dtype
    n = tree.n_nodes
    if isinstance(cache, graphs.Cache):  # one CUDA graph per tree size over the static buffers
        return cache.slot.block(tokens, tree.depth_on(device), tree.mask_block(cache.slot.dtype, device), graph=True)
    pos = (tree.depth_on(device) + past)[None]
    if n == 1:  # plain decoding: the causal default is the mask; keeps generate's exact kernel path
        return forward(model, cache, tokens[None], pos, None)
    block = tree.mask_block(dtype, device)  # (N, N): 0 on ancestors (self included), min elsewhere
    mask = torch.cat([torch.zeros(n, past, dtype=dtype, device=device), block], dim=1)[None, None]
    return forward(model, cache, tokens[None], pos, mask)


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

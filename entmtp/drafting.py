"""Expand a compiled tree with the draft heads into one candidate token per node."""

from __future__ import annotations

import torch

from .heads import DraftHeads
from .topology import Tree


def top1_chain(heads: DraftHeads, feature: torch.Tensor, root: int, depth: int,
               prefix: tuple[list[torch.Tensor], list[float]] | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Run heads 0..depth-1 along the top-1 path from the root.

    Returns each head's draft logits (K,) on that path (reused when drafting the tree) and the
    top-1 probability p_d of each, for the confidence feature. `prefix` = an earlier, shorter
    chain from the same root and feature: its heads are not run again.
    """
    logits, probs = (list(prefix[0]), list(prefix[1])) if prefix else ([], [])
    path = torch.tensor([[root]], device=feature.device)  # (1, d+1)
    for row in logits:  # the prefix's top-1 tokens, picked exactly as `chain` picks them
        idx = torch.softmax(row.float(), -1).max(-1)[1]
        path = torch.cat([path, heads.to_token_ids(idx).view(1, 1)], dim=1)
    more, p = chain(heads, feature, path, depth)
    return logits + more, probs + p.tolist()


def chain(heads: DraftHeads, feature: torch.Tensor, path: torch.Tensor, depth: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The top-1 chain on the device, from `path` (1, d+1) = root and the chain's first d tokens
    on to `depth`: -> the logits (K,) of heads d..depth-1 and their top-1 probabilities
    (depth - d,) float32. No value goes to the host, so a CUDA graph can hold it."""
    h = feature[None]  # (1, H)
    logits, probs = [], []
    for d in range(path.shape[1] - 1, depth):
        row = heads.head_logits(d, h, path)[0]  # (K,)
        p, idx = torch.softmax(row.float(), -1).max(-1)
        logits.append(row)
        probs.append(p)
        path = torch.cat([path, heads.to_token_ids(idx).view(1, 1)], dim=1)
    return logits, torch.stack(probs) if probs else torch.zeros(0, device=feature.device)


def draft(tree: Tree, heads: DraftHeads, feature: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole draft on the device: the top-1 chain through the tree's depth, then its expansion.
    root (1,) long -> (tokens (N,), the chain's top-1 probabilities (depth,)); what
    `graphs.Drafts` captures per tree."""
    logits, probs = chain(heads, feature, root.view(1, 1), tree.max_depth)
    return expand(tree, heads, feature, root, logits), probs


def expand(tree: Tree, heads: DraftHeads | None, feature: torch.Tensor, root: int | torch.Tensor, chain: list[torch.Tensor]) -> torch.Tensor:
    """Draft tokens for every node of `tree`, root first. -> (N,) token ids.

    Depth by depth, head d runs once, batched over the depth-d nodes that have children, and
    their top-k become the children (child of rank r gets the rank-r token). Node order is
    (depth, path), so the rank-0 chain node (0, ..., 0) is the first parent when it has children;
    its logits then come from `chain`. It need not have any: in [[0], [1], [1, 0]] the only
    parent at depth 1 is (1,). `root` is a token id, or a (1,) tensor on the device.
    """
    device = feature.device
    tokens = torch.empty(tree.n_nodes, dtype=torch.long, device=device)
    if isinstance(root, torch.Tensor):
        tokens[:1] = root.view(1)
    else:
        tokens[0] = root
    for d, plan in enumerate(tree.plans):
        parents, children, slot = tree.plan_on(d, device)
        if not heads.path_dependent:  # Medusa: one distribution per depth, shared by all parents
            row = chain[d][None] if d < len(chain) else heads.head_logits(d, feature[None], tokens[:1, None])
            table = heads.to_token_ids(torch.topk(row, plan.k, dim=-1).indices).expand(len(parents), -1)
        else:
            reuse = d < len(chain) and _is_chain_node(tree, int(plan.parents[0]))
            rows = [chain[d][None]] if reuse else []
            paths = tree.ancestor_paths_on(d, device)[len(rows) :]  # (P', d+1)
            if len(paths):
                rows.append(heads.head_logits(d, feature[None].expand(len(paths), -1), tokens[paths]))
            logits = torch.cat(rows, dim=0)  # (P, K)
            table = heads.to_token_ids(torch.topk(logits, plan.k, dim=-1).indices)  # (P, k)
        tokens[children] = table.reshape(-1)[slot]
    return tokens


def _is_chain_node(tree: Tree, node: int) -> bool:
    """Whether `node` is the root or a rank-0 child of rank-0 children all the way: (0, ..., 0)."""
    return node == 0 or not any(tree.paths[node - 1])

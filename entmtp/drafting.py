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
    for row in logits:  # the prefix's top-1 tokens, picked exactly as below
        idx = torch.softmax(row.float(), -1).max(-1)[1]
        path = torch.cat([path, heads.to_token_ids(idx).view(1, 1)], dim=1)
    h = feature[None]  # (1, H)
    for d in range(len(logits), depth):
        row = heads.head_logits(d, h, path)[0]  # (K,)
        p, idx = torch.softmax(row.float(), -1).max(-1)
        logits.append(row)
        probs.append(float(p))
        path = torch.cat([path, heads.to_token_ids(idx).view(1, 1)], dim=1)
    return logits, probs


def expand(tree: Tree, heads: DraftHeads | None, feature: torch.Tensor, root: int, chain: list[torch.Tensor]) -> torch.Tensor:
    """Draft tokens for every node of `tree`, root first. -> (N,) token ids.

    Depth by depth, head d runs once, batched over the depth-d nodes that have children, and
    their top-k become the children (child of rank r gets the rank-r token). Node order is
    (depth, path), so the rank-0 chain node (0, ..., 0) is the first parent when it has children;
    its logits then come from `chain`. It need not have any: in [[0], [1], [1, 0]] the only
    parent at depth 1 is (1,).
    """
    device = feature.device
    tokens = torch.empty(tree.n_nodes, dtype=torch.long, device=device)
    tokens[0] = root
    for d, plan in enumerate(tree.plans):
        parents = plan.parents.to(device)
        if not heads.path_dependent:  # Medusa: one distribution per depth, shared by all parents
            row = chain[d][None] if d < len(chain) else heads.head_logits(d, feature[None], tokens[:1, None])
            table = heads.to_token_ids(torch.topk(row, plan.k, dim=-1).indices).expand(len(parents), -1)
        else:
            reuse = d < len(chain) and _is_chain_node(tree, int(plan.parents[0]))
            rows = [chain[d][None]] if reuse else []
            paths = _ancestor_paths(tree, d)[len(rows) :].to(device)  # (P', d+1)
            if len(paths):
                rows.append(heads.head_logits(d, feature[None].expand(len(paths), -1), tokens[paths]))
            logits = torch.cat(rows, dim=0)  # (P, K)
            table = heads.to_token_ids(torch.topk(logits, plan.k, dim=-1).indices)  # (P, k)
        tokens[plan.children.to(device)] = table.reshape(-1)[plan.slot.to(device)]
    return tokens


def _is_chain_node(tree: Tree, node: int) -> bool:
    """Whether `node` is the root or a rank-0 child of rank-0 children all the way: (0, ..., 0)."""
    return node == 0 or not any(tree.paths[node - 1])


def _ancestor_paths(tree: Tree, d: int) -> torch.Tensor:
    """(P, d+1) node ids root..parent for each parent expanded at depth d (cached on the tree)."""
    cache = tree.__dict__.setdefault("_anc_paths", {})
    if d not in cache:
        rows = []
        for node in tree.plans[d].parents.tolist():
            path = []
            while node >= 0:
                path.append(node)
                node = tree.parent[node]
            rows.append(path[::-1])
        cache[d] = torch.tensor(rows, dtype=torch.long)
    return cache[d]

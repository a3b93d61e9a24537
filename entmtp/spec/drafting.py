"""Expand a compiled tree with the draft heads into one candidate token per node, eagerly or as
CUDA graphs (`DraftGraphs`)."""

from __future__ import annotations

import threading
import time
import warnings

import torch

from entmtp.spec.heads import DraftHeads
from entmtp.spec.phrasebook import Forcer, force_row, spine_first
from entmtp.spec.policy import path_value
from entmtp.spec.topology import Tree


class Chain(tuple):
    """`top1_chain`'s (logits, probs), carrying the tokens its path went through after the root
    (`tokens`): a deeper chain from the same root and feature resumes from it without picking
    them again. Unpacks as the pair."""

    def __new__(cls, logits: list[torch.Tensor], probs: list[float], tokens: list[int]):
        self = super().__new__(cls, (logits, probs))
        self.tokens = tokens
        return self


def top1_chain(heads: DraftHeads, feature: torch.Tensor, root: int, depth: int,
               prefix: tuple[list[torch.Tensor], list[float]] | None = None,
               force: Forcer | None = None, settle: tuple[float, float, bool] | None = None,
               then: tuple[int, int] = (-1, -1)) -> Chain:
    """Run heads 0..depth-1 along the top-1 path from the root.

    Returns each head's draft logits (K,) on that path (reused when drafting the tree) and the
    top-1 probability p_d of each, for the confidence feature. `prefix` = an earlier, shorter
    chain from the same root and feature: its heads are not run again (nor, where it is a `Chain`,
    its tokens picked again). `force` (a phrasebook's, `phrasebook.forcer`) may put other tokens
    first at each node: that row's logits then rank them first (`phrasebook.force_row`), the path
    goes on through the first, and p_d is the probability it gives for that token (a reranker's),
    else the head's own top-1 probability. `settle` = (p0, t, strict): stop after the first head
    whose path value p0 * p_1 * ... * p_d (`policy.path_value`, over the prefix's heads too) is at
    most t (below t where strict), as the engine's head-by-head reading would (`Chooser.settle_at`);
    `then` = (settled, unsettled) with `settle`: once the value settles, go on without reading it to
    depth `settled` where that is deeper; where `depth` is reached unsettled, on to `unsettled`
    (-1: stop): the depths of the trees the policy then picks (`Chooser.outcomes`), so that a step's
    chain is one call.
    """
    logits, probs = (list(prefix[0]), list(prefix[1])) if prefix else ([], [])
    if settle is not None:  # the value through the prefix's heads, which the chain goes on multiplying
        settle = (path_value(settle[0], probs), settle[1], settle[2])
        if probs and _settles(settle[0], settle):  # the prefix has settled it: no further head read
            depth, settle = max(len(probs), then[0]), None
        elif probs and len(probs) >= depth:  # read through its depth, unsettled
            depth, settle = max(depth, then[1]), None
    tokens = getattr(prefix, "tokens", None)
    if tokens is None or len(tokens) != len(logits):  # the prefix's top-1 tokens, picked exactly as `top1_logits` picks them
        tokens = [int(heads.to_token_ids(heads.top1(row)[1])) for row in logits]
    path = [root] + list(tokens)  # the root and the prefix's tokens: the extension takes the list as it is
    more, p, picked = _top1(heads, feature, path, depth, force, settle, then)
    return Chain(logits + more, probs + _listed(p), list(tokens) + _listed(picked))


def _listed(values: torch.Tensor | list) -> list:
    """A chain's probabilities or tokens as a list (the extension's chain gives lists already)."""
    return values if isinstance(values, list) else values.tolist()


def _settles(g: float, settle: tuple[float, float, bool]) -> bool:
    """Whether path value g settles the choice under `settle`'s bound (t, strict): g <= t, or g < t."""
    return g < settle[1] if settle[2] else g <= settle[1]


def top1_logits(heads: DraftHeads, feature: torch.Tensor, path: torch.Tensor, depth: int,
                force: Forcer | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The top-1 chain on the device, from `path` (1, d+1) = root and the chain's first d tokens
    on to `depth`: -> the logits (K,) of heads d..depth-1 and their top-1 probabilities
    (depth - d,) float32. No value goes to the host, so a CUDA graph can hold it (not with
    `force`, which reads each node's path, probability and logits on the host)."""
    logits, probs, _ = _top1(heads, feature, path, depth, force)
    return logits, probs if isinstance(probs, torch.Tensor) else torch.tensor(probs, dtype=torch.float32)  # the extension's lists


def _top1(heads: DraftHeads, feature: torch.Tensor, path: torch.Tensor | list[int], depth: int,
          force: Forcer | None = None, settle: tuple[float, float, bool] | None = None,
          then: tuple[int, int] = (-1, -1)) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """`top1_logits`, and the tokens (depth - d,) long the path went on through; with `settle`
    (g so far, t, strict), only up to the first head that brings g to at most t (below t if strict),
    then on as `then` says (`top1_chain`). `path` may be the list of ids (a tensor is made of it
    only where the extension does not run the chain)."""
    fast = heads.top1_on_blocks(feature, path, depth, force, settle, then)  # block heads on a CPU: one extension call, the same bits
    if fast is not None:
        return fast
    if isinstance(path, list):
        path = torch.tensor([path], device=feature.device)  # (1, d+1)
    g = settle[0] if settle is not None else None
    h = feature[None]  # (1, H)
    logits, probs, tokens = [], [], []
    d, target = path.shape[1] - 1, depth
    while d < target:
        row = heads.head_logits(d, h, path)[0]  # (K,)
        p, idx = heads.top1(row)
        forced, q = force(path[0].tolist(), float(p), row) if force is not None else ([], -1.0)
        token = heads.to_token_ids(idx).view(1)
        if forced:
            row = force_row(row, forced)
            outside = spine_first(forced)  # a token outside the draft vocabulary goes first: the path goes on through it
            token = torch.tensor([outside], device=row.device) if outside >= 0 else heads.to_token_ids(torch.tensor(forced[0], device=row.device)).view(1)
        if q >= 0:  # the drafter's probability for the spine's token (`phrasebook.forcer`)
            p = torch.tensor(q, dtype=p.dtype, device=p.device)
        logits.append(row)
        probs.append(p)
        tokens.append(token)
        path = torch.cat([path, tokens[-1].view(1, 1)], dim=1)
        if g is not None:
            g *= float(p)
            if _settles(g, settle):
                g, target = None, max(d + 1, then[0])
            elif d + 1 >= depth:
                g, target = None, max(depth, then[1])
        d += 1
    if not probs:
        return logits, torch.zeros(0, device=feature.device), torch.zeros(0, dtype=torch.long, device=feature.device)
    return logits, torch.stack(probs), torch.cat(tokens)


def draft(tree: Tree, heads: DraftHeads, feature: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole draft on the device: the top-1 chain through the tree's depth, then its expansion.
    root (1,) long -> (tokens (N,), the chain's top-1 probabilities (depth,)); what
    `DraftGraphs` captures per tree."""
    logits, probs = top1_logits(heads, feature, root.view(1, 1), tree.max_depth)
    return expand(tree, heads, feature, root, logits), probs


def expand(tree: Tree, heads: DraftHeads | None, feature: torch.Tensor, root: int | torch.Tensor, chain: list[torch.Tensor],
           outside: list[int] | None = None, spine: list[int] | None = None) -> torch.Tensor:
    """Draft tokens for every node of `tree`, root first. -> (N,) token ids.

    Depth by depth, head d runs once, batched over the depth-d nodes that have children, and
    their top-k become the children (child of rank r gets the rank-r token). Node order is
    (depth, path), so the rank-0 chain node (0, ..., 0) is the first parent when it has children;
    its logits then come from the top-1 chain. It need not have any: in [[0], [1], [1, 0]] the only
    parent at depth 1 is (1,). `root` is a token id, or a (1,) tensor on the device. `outside`
    (`heads.outside` of `Chain.tokens`): where the chain's token at depth d lies outside the draft
    vocabulary, the chain node's children are that token, then its row's top k - 1. `spine`
    (`Chain.tokens`, from an int root): a chain of one child a depth is the root and the tokens
    the chain went through, with no row ranked again.
    """
    device = feature.device
    if spine is not None and not isinstance(root, torch.Tensor) and tree.chain_ks is not None \
            and len(spine) >= len(tree.chain_ks) and all(k == 1 for k in tree.chain_ks):
        return torch.tensor([root] + list(spine[: len(tree.chain_ks)]), device=device)
    outside = list(outside or [])[: len(chain)]

    def ranked(row: torch.Tensor, k: int, d: int) -> torch.Tensor:  # (P, K) -> (P, k) token ids; row 0 the chain node's where reused
        ids = heads.to_token_ids(torch.topk(row, k, dim=-1).indices)
        if d < len(outside) and outside[d] >= 0:
            first = torch.tensor([outside[d]], dtype=ids.dtype, device=ids.device)
            ids = ids.clone()
            ids[0] = torch.cat([first, ids[0, : k - 1]])
        return ids

    if tree.chain_ks is not None and len(chain) >= len(tree.chain_ks):  # every parent on the chain: its logits are all there
        root = root.view(1) if isinstance(root, torch.Tensor) else torch.tensor([root], device=device)
        return torch.cat([root] + [ranked(chain[d][None], k, d)[0] for d, k in enumerate(tree.chain_ks)])
    tokens = torch.empty(tree.n_nodes, dtype=torch.long, device=device)
    if isinstance(root, torch.Tensor):
        tokens[:1] = root.view(1)
    else:
        tokens[0] = root
    for d, plan in enumerate(tree.plans):
        parents, children, slot = tree.plan_on(d, device)
        on_chain = d < len(chain) and _is_chain_node(tree, int(plan.parents[0]))
        if not heads.path_dependent:  # Medusa: one distribution per depth, shared by all parents
            row = chain[d][None] if d < len(chain) else heads.head_logits(d, feature[None], tokens[:1, None])
            table = heads.to_token_ids(torch.topk(row, plan.k, dim=-1).indices).expand(len(parents), -1)
            if on_chain and d < len(outside) and outside[d] >= 0:
                table = torch.cat([ranked(row, plan.k, d), table[1:]])
        else:
            rows = [chain[d][None]] if on_chain else []
            paths = tree.ancestor_paths_on(d, device)[len(rows) :]  # (P', d+1)
            if len(paths):
                rows.append(heads.head_logits(d, feature[None].expand(len(paths), -1), tokens[paths]))
            logits = torch.cat(rows, dim=0)  # (P, K)
            table = ranked(logits, plan.k, d) if on_chain else heads.to_token_ids(torch.topk(logits, plan.k, dim=-1).indices)  # (P, k)
        tokens[children] = table.reshape(-1)[slot]
    return tokens


def _is_chain_node(tree: Tree, node: int) -> bool:
    """Whether `node` is the root or a rank-0 child of rank-0 children all the way: (0, ..., 0)."""
    return node == 0 or not any(tree.paths[node - 1])


class DraftGraphs:
    """The draft heads' work of a step as CUDA graphs: per tree, the top-1 chain through its depth
    and its expansion (`draft`); per depth, the chain alone (what a policy on the path
    value reads before it picks a tree). Eagerly, each is a few dozen small kernels and their
    Python a step (on an H200 about a quarter of a deep tree's step with captured verification).

    Inputs (the feature, the root token) are copied into static tensors and the graph replayed;
    outputs are cloned. Graphs are keyed by the heads and the tree's paths, captured on first use
    or by `Engine.warmup_drafts`; a failed capture warns once and drafting stays eager.
    `capture=False` runs the same functions eagerly (how tests check them on a CPU).
    """

    def __init__(self, capture: bool):
        self.capture = capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.capture_ms: dict[str, float] = {}
        self.pool = None
        self.lock = threading.Lock()  # two decodes (the app's race) may capture at once

    def draft(self, heads, tree, feature: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (N,), the chain's top-1 probabilities (depth,)), both on the device."""
        return self._run(("draft", id(heads), tree.paths), lambda f, r: draft(tree, heads, f, r), feature, root, tree.name, heads)

    def top1_chain(self, heads, feature: torch.Tensor, root: int, depth: int) -> tuple[list[torch.Tensor], list[float]]:
        """`top1_chain` to `depth`: the heads' logits and top-1 probabilities."""

        def fn(f, r):
            logits, probs = top1_logits(heads, f, r.view(1, 1), depth)
            return (torch.stack(logits) if logits else f.new_zeros(0, 0)), probs

        logits, probs = self._run(("chain", id(heads), depth), fn, feature, root, f"chain{depth}", heads)
        return list(logits.unbind(0)), probs.tolist()

    def _run(self, key: tuple, fn, feature: torch.Tensor, root: int, label: str, heads):
        if not self.capture:
            return fn(feature, torch.full((1,), root, dtype=torch.long, device=feature.device))
        with self.lock:
            if key not in self.graphs:
                try:
                    self._capture(key, fn, feature, label, heads)
                except Exception as e:  # drafting goes on eagerly
                    warnings.warn(f"CUDA graph capture of the draft failed ({type(e).__name__}: {e}); drafting stays eager")
                    self.capture = False
                    return self._run(key, fn, feature, root, label, heads)
            g, static, outs = self.graphs[key]
            static["feature"].copy_(feature)
            static["root"].fill_(root)
            g.replay()
            return tuple(o.clone() for o in outs)

    def _capture(self, key: tuple, fn, feature: torch.Tensor, label: str, heads) -> None:
        t0 = time.perf_counter()
        device = feature.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # the heads stay referenced while their graph lives (the key holds their id)
        static = {"feature": feature.detach().clone(), "root": torch.zeros(1, dtype=torch.long, device=device), "heads": heads}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # lazy set-up (the heads' draft-vocabulary weights, cuBLAS) outside the capture
            fn(static["feature"], static["root"])
        torch.cuda.current_stream(device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            outs = fn(static["feature"], static["root"])
        torch.cuda.synchronize(device)
        self.graphs[key] = (g, static, outs)
        self.capture_ms[label] = round((time.perf_counter() - t0) * 1e3, 1)

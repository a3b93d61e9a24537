"""Draft-tree topologies: validation and one-time compilation into attention buffers.

A tree is a list of rank paths: `(a, b)` is the rank-b child of the rank-a child of the root.
The root (the token chosen from the base logits) is implicit and is node 0 of the compiled tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import torch

Path_ = tuple[int, ...]


class TopologyError(ValueError):
    """A tree that is not prefix-closed, has rank gaps, or is otherwise malformed."""


def normalize(paths: Iterable[Sequence[int]]) -> list[Path_]:
    """Validate `paths` and return them sorted by (depth, path), as the compiled node order."""
    out: set[Path_] = set()
    for p in paths:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TopologyError(f"a tree path must be a list of ranks, got {p!r}")
        t = tuple(p)
        if not t:
            raise TopologyError("a tree path must not be empty (the root is implicit)")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in t):
            raise TopologyError(f"ranks must be non-negative integers, got {list(p)!r}")
        if t in out:
            raise TopologyError(f"duplicate path {list(t)!r}")
        out.add(t)
    for t in out:
        if len(t) > 1 and t[:-1] not in out:
            raise TopologyError(f"tree is not prefix-closed: {list(t)!r} has no parent {list(t[:-1])!r}")
        if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in out:
            raise TopologyError(f"rank gap: {list(t)!r} present but {list(t[:-1] + (t[-1] - 1,))!r} missing")
    return sorted(out, key=lambda t: (len(t), t))


@dataclass(frozen=True)
class DepthPlan:
    """How depth d+1 is drafted from depth d: one head call batched over `parents`."""

    parents: torch.Tensor  # (P,) node ids at depth d that have children
    k: int  # top-k taken per parent (the most children any of them has)
    children: torch.Tensor  # (C,) node ids at depth d+1
    slot: torch.Tensor  # (C,) index into the flattened (P, k) top-k table


@dataclass(frozen=True, eq=False)
class Tree:
    """A validated tree compiled once: masks, depths, parents, children and per-depth plans."""

    name: str
    paths: tuple[Path_, ...]
    parent: tuple[int, ...] = field(repr=False)  # parent node id per node (-1 for the root)
    depth: tuple[int, ...] = field(repr=False)  # depth per node (root 0)
    rank: tuple[int, ...] = field(repr=False)  # rank among siblings (root 0)
    children: tuple[tuple[int, ...], ...] = field(repr=False)  # child ids per node, by rank
    plans: tuple[DepthPlan, ...] = field(repr=False)

    @property
    def n_nodes(self) -> int:
        """Tokens verified per step, the root included."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: node i may attend node j (j is i or an ancestor of i)."""
        n = self.n_nodes
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            m[i, self.root_path(i)] = True
        return m

    @cached_property
    def depth_tensor(self) -> torch.Tensor:
        return torch.tensor(self.depth, dtype=torch.long)

    def root_path(self, node: int) -> list[int]:
        """Node ids from the root down to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent[node]
        return path[::-1]

    @cached_property
    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf node-id paths, one per leaf."""
        return [self.root_path(i) for i in range(self.n_nodes) if not self.children[i]]

    def node_of(self, rank_path: Sequence[int]) -> int:
        """Node id of a rank path (the empty path is the root)."""
        node = 0
        for r in rank_path:
            kids = self.children[node]
            if r >= len(kids):
                raise KeyError(f"{list(rank_path)!r} is not in tree {self.name!r}")
            node = kids[r]
        return node

    @cached_property
    def chain_ks(self) -> tuple[int, ...] | None:
        """Where every expanded node is on the rank-0 chain (0, ..., 0), the number of children it
        has at each depth (node order is then the root and each depth's top-k in rank order);
        None for other trees."""
        chain = 0
        for plan in self.plans:
            if plan.parents.tolist() != [chain] or plan.slot.tolist() != list(range(plan.k)):
                return None
            chain = self.children[chain][0]
        return tuple(plan.k for plan in self.plans)

    def depth_on(self, device: torch.device) -> torch.Tensor:
        """`depth_tensor` on `device`, cached per device (a copy per step costs a transfer on a GPU)."""
        cache = self.__dict__.setdefault("_depth_cache", {})
        if str(device) not in cache:
            cache[str(device)] = self.depth_tensor.to(device)
        return cache[str(device)]

    def plan_on(self, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Depth d's plan (parents, children, slot) on `device`, cached per device: a copy per step
        costs a transfer on a GPU, and a CUDA graph may not make one."""
        cache = self.__dict__.setdefault("_plan_cache", {})
        key = (d, str(device))
        if key not in cache:
            plan = self.plans[d]
            cache[key] = (plan.parents.to(device), plan.children.to(device), plan.slot.to(device))
        return cache[key]

    def ancestor_paths_on(self, d: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(P, d+1) node ids root..parent for each parent expanded at depth d, cached per device."""
        cache = self.__dict__.setdefault("_anc_paths", {})
        key = (d, str(device))
        if key not in cache:
            rows = [self.root_path(node) for node in self.plans[d].parents.tolist()]
            cache[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return cache[key]

    def mask_block(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(N, N) additive mask: 0 where attending, dtype-min where blocked. Cached per dtype/device."""
        key = (dtype, str(device))
        cache = self.__dict__.setdefault("_mask_cache", {})
        if key not in cache:
            blocked = torch.finfo(dtype).min
            block = torch.full(self.ancestor_mask.shape, blocked, dtype=dtype)
            cache[key] = block.masked_fill(self.ancestor_mask, 0.0).to(device)
        return cache[key]

    def as_lists(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def compile_tree(paths: Iterable[Sequence[int]], name: str = "tree") -> Tree:
    """Validate and compile a tree. The empty tree is plain decoding (root only)."""
    norm = normalize(paths)
    index: dict[Path_, int] = {(): 0}
    for i, p in enumerate(norm, start=1):
        index[p] = i
    n = len(norm) + 1
    parent = [-1] + [index[p[:-1]] for p in norm]
    depth = [0] + [len(p) for p in norm]
    rank = [0] + [p[-1] for p in norm]
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parent[i]].append(i)  # node order is (depth, path): children arrive in rank order
    plans = []
    for d in range(max(depth)):
        parents = [i for i in range(n) if depth[i] == d and kids[i]]
        k = max(len(kids[i]) for i in parents)
        children, slot = [], []
        for pi, node in enumerate(parents):
            for c in kids[node]:
                children.append(c)
                slot.append(pi * k + rank[c])
        plans.append(
            DepthPlan(
                parents=torch.tensor(parents, dtype=torch.long),
                k=k,
                children=torch.tensor(children, dtype=torch.long),
                slot=torch.tensor(slot, dtype=torch.long),
            )
        )
    return Tree(
        name=name,
        paths=tuple(norm),
        parent=tuple(parent),
        depth=tuple(depth),
        rank=tuple(rank),
        children=tuple(tuple(c) for c in kids),
        plans=tuple(plans),
    )


def chain_paths(depth: int) -> list[list[int]]:
    """The top-1 chain of `depth` drafted tokens: [(0,), (0, 0), ...]."""
    return [[0] * d for d in range(1, depth + 1)]


def load_named_trees(path: Path) -> dict[str, Tree]:
    """Public default trees stored as data (entmtp/spec/trees.json)."""
    with open(path) as f:
        raw = json.load(f)
    return {k: compile_tree(v["paths"], name=k) for k, v in raw.items() if not k.startswith("_")}

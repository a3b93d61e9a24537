"""TopologyBank: compiled trees indexed for switching, and the bank file (banks/<model>/<task>.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .policy import LadderPolicy, Policy, StaticPolicy, TauPolicy
from .topology import Tree, TopologyError, compile_tree

SCHEMA_VERSION = 1
TREE_FIELDS = ("id", "paths", "n_nodes", "depth", "mean_accepted", "step_ms", "tokens_per_s")
PROVENANCE_FIELDS = ("model", "heads_sha256", "calibration", "command", "date", "hardware")


class BankError(ValueError):
    """A bank file that does not follow the schema; the message names the bad field."""


@dataclass
class TopologyBank:
    """Trees compiled once; a decode step switches trees by index."""

    trees: list[Tree]
    stats: list[dict[str, Any]] = field(default_factory=list)  # per tree: measured figures
    policies: dict[str, Policy] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, *trees: Tree) -> "TopologyBank":
        return cls(list(trees), [{} for _ in trees], {"static": StaticPolicy(0)})

    def __len__(self) -> int:
        return len(self.trees)

    def __getitem__(self, i: int) -> Tree:
        return self.trees[i]

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.trees)

    def index(self, tree_id: str) -> int:
        for i, t in enumerate(self.trees):
            if t.name == tree_id:
                return i
        raise KeyError(tree_id)

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            raise BankError(f"bank has no {name!r} policy (has: {', '.join(self.policies) or 'none'})")
        return self.policies[name]

    def to_json(self) -> dict[str, Any]:
        trees = []
        for t, st in zip(self.trees, self.stats):
            trees.append({"id": t.name, "paths": t.as_lists(), "n_nodes": t.n_nodes, "depth": t.max_depth, **st})
        pol: dict[str, Any] = {}
        for name, p in self.policies.items():
            if isinstance(p, StaticPolicy):
                pol[name] = {"tree": self.trees[p.tree].name}
            elif isinstance(p, LadderPolicy):
                pol[name] = {"trees": [self.trees[i].name for i in p.trees], "thresholds": list(p.thresholds)}
            else:
                pol[name] = {
                    "small": self.trees[p.small].name,
                    "large": self.trees[p.large].name,
                    "tau_on": p.tau_on,
                    "tau_off": p.tau_off,
                }
        return {"schema_version": SCHEMA_VERSION, **self.meta, "trees": trees, "policies": pol}

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return p


def _need(obj: dict, key: str, where: str, types: type | tuple) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise BankError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, types) or isinstance(val, bool) and types is not bool:
        raise BankError(f"{where}.{key}: expected {getattr(types, '__name__', types)}, got {type(val).__name__}")
    return val


def parse_bank(raw: Any, where: str = "bank") -> TopologyBank:
    """Validate a bank JSON object and compile its trees."""
    if not isinstance(raw, dict):
        raise BankError(f"{where}: expected a JSON object")
    version = _need(raw, "schema_version", where, int)
    if version != SCHEMA_VERSION:
        raise BankError(f"{where}.schema_version: {version} is not supported (expected {SCHEMA_VERSION})")
    prov = _need(raw, "provenance", where, dict)
    for k in PROVENANCE_FIELDS:
        _need(prov, k, f"{where}.provenance", (str, dict, list, int, float))
    entries = _need(raw, "trees", where, list)
    if not entries:
        raise BankError(f"{where}.trees: empty")
    trees, stats, ids = [], [], {}
    for i, e in enumerate(entries):
        w = f"{where}.trees[{i}]"
        tid = _need(e, "id", w, str)
        if tid in ids:
            raise BankError(f"{w}.id: duplicate id {tid!r}")
        try:
            tree = compile_tree(_need(e, "paths", w, list), name=tid)
        except TopologyError as err:
            raise BankError(f"{w}.paths: {err}") from None
        if _need(e, "n_nodes", w, int) != tree.n_nodes:
            raise BankError(f"{w}.n_nodes: {e['n_nodes']} but the paths give {tree.n_nodes}")
        if _need(e, "depth", w, int) != tree.max_depth:
            raise BankError(f"{w}.depth: {e['depth']} but the paths give {tree.max_depth}")
        st = {k: float(_need(e, k, w, (int, float))) for k in ("mean_accepted", "step_ms", "tokens_per_s")}
        ids[tid] = len(trees)
        trees.append(tree)
        stats.append(st)

    def ref(obj: dict, key: str, w: str) -> int:
        tid = _need(obj, key, w, str)
        if tid not in ids:
            raise BankError(f"{w}.{key}: unknown tree id {tid!r}")
        return ids[tid]

    pols = _need(raw, "policies", where, dict)
    policies: dict[str, Policy] = {}
    try:
        w = f"{where}.policies.static"
        policies["static"] = StaticPolicy(ref(_need(pols, "static", f"{where}.policies", dict), "tree", w))
        lad = _need(pols, "ladder", f"{where}.policies", dict)
        w = f"{where}.policies.ladder"
        names = _need(lad, "trees", w, list)
        for n in names:
            if n not in ids:
                raise BankError(f"{w}.trees: unknown tree id {n!r}")
        thr = [float(x) for x in _need(lad, "thresholds", w, list)]
        policies["ladder"] = LadderPolicy(tuple(ids[n] for n in names), tuple(thr))
        tau = _need(pols, "tau", f"{where}.policies", dict)
        w = f"{where}.policies.tau"
        policies["tau"] = TauPolicy(
            ref(tau, "small", w),
            ref(tau, "large", w),
            float(_need(tau, "tau_on", w, (int, float))),
            float(_need(tau, "tau_off", w, (int, float))),
        )
    except ValueError as err:
        if isinstance(err, BankError):
            raise
        raise BankError(f"{where}.policies: {err}") from None
    meta = {k: v for k, v in raw.items() if k not in ("schema_version", "trees", "policies")}
    return TopologyBank(trees, stats, policies, meta)


def load_bank(path: str | Path) -> TopologyBank:
    p = Path(path)
    if not p.exists():
        raise BankError(f"bank file not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BankError(f"{p}: not valid JSON ({e})") from None
    return parse_bank(raw, where=str(p))

"""TopologyBank: compiled trees indexed for switching, and the bank file (banks/<model>/<task>.json)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from entmtp.config import ROOT, PhrasebookRule
from entmtp.spec.phrasebook import Reranker, Rule
from entmtp.spec.policy import FEATURES, LadderPolicy, Policy, StaticPolicy, TauPolicy
from entmtp.spec.topology import Tree, TopologyError, compile_tree
from entmtp.bank.traces import Trace

SCHEMA_VERSION = 2  # 2: the bank carries acceptance traces and the fit of the machine that built it
PROVENANCE_FIELDS = ("model", "heads_sha256", "calibration", "command", "date", "hardware")
STAT_FIELDS = ("mean_accepted", "step_ms", "tokens_per_s")


class BankError(ValueError):
    """A bank file that does not follow the schema; the message names the bad field."""


def phrasebook_rule(provenance: dict[str, Any], root: Path = ROOT) -> Rule | None:
    """The rule a bank's provenance names for the phrasebook (`provenance.phrasebook`), or None: a
    share rule (`{min_n, max_head_p, min_share}`) or a reranker (`{reranker: its file relative to
    the repository (`root`: the checkout the bank was read from), sha256}`), which must be the very
    file the traces were drafted with."""
    raw = provenance.get("phrasebook")
    if raw is None:
        return None
    if "reranker" in raw:
        path = root / raw["reranker"]
        if not path.exists():
            raise BankError(f"provenance.phrasebook.reranker: {raw['reranker']} is missing; rebuild the bank (build-bank)")
        rr = Reranker.load(path)
        if rr.sha256 != raw["sha256"]:
            raise BankError(f"provenance.phrasebook.reranker: {raw['reranker']} changed since the traces were drafted "
                            f"(sha256 {rr.sha256}, the bank's {raw['sha256']}); rebuild the bank (build-bank)")
        return rr
    return PhrasebookRule(int(raw["min_n"]), float(raw["max_head_p"]), float(raw.get("min_share", 0.0)))


def rule_provenance(rule: Rule) -> dict[str, Any]:
    """How a bank's provenance names `rule` (`phrasebook_rule` reads it back)."""
    if isinstance(rule, Reranker):
        return {"reranker": rule.path, "sha256": rule.sha256}
    return {"min_n": rule.min_n, "max_head_p": rule.max_head_p, "min_share": rule.min_share}


@dataclass
class TopologyBank:
    """Trees compiled once; a decode step switches trees by index.

    A bank file holds the candidate trees and the acceptance traces they were chosen from (the
    portable half), plus one fit: per-tree step costs measured on one machine and the front and
    policies fitted to them. `with_fit` swaps in the fit of the machine the engine runs on.
    """

    trees: list[Tree]
    stats: list[dict[str, Any]] = field(default_factory=list)  # per tree: figures of the active fit
    policies: dict[str, Policy] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    traces: list[Trace] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)  # the active fit (see bank.fit.fit_task)
    shipped_fit: dict[str, Any] = field(default_factory=dict)  # the fit the file was saved with
    root: Path = ROOT  # the checkout whose files the provenance names (another one's banks: scripts/compare_heads.py)

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

    @property
    def front(self) -> list[int]:
        """Indices of the active fit's throughput front (all trees when there is no fit)."""
        ids = self.fit.get("front")
        return [self.index(t) for t in ids] if ids else list(range(len(self.trees)))

    def portable_key(self) -> str:
        """A checksum of what a fit depends on besides the machine: trees, traces and heads."""
        raw = json.dumps([[t.as_lists() for t in self.trees], [t.to_json() for t in self.traces],
                          self.meta.get("provenance", {}).get("heads_sha256")], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    @property
    def phrasebook_rule(self) -> Rule | None:
        """The rule its traces were drafted under with the model's phrasebook (`spec.phrasebook`), or
        None: heads alone. The engine must draft alike for the fit to hold."""
        return phrasebook_rule(self.meta.get("provenance", {}), self.root)

    def smallest(self) -> int:
        return min(range(len(self.trees)), key=lambda i: self.trees[i].n_nodes)

    def with_fit(self, fit: dict[str, Any]) -> "TopologyBank":
        """The same trees and traces under another fit (validated like the file's own)."""
        ids = {t.name: i for i, t in enumerate(self.trees)}
        where = f"fit ({fit.get('hardware', '?')})"
        stats = []
        for t in self.trees:
            st = _need(_need(fit, "trees", where, dict), t.name, f"{where}.trees", dict)
            stats.append({k: float(_need(st, k, f"{where}.trees.{t.name}", (int, float))) for k in STAT_FIELDS})
        policies = parse_policies(_need(fit, "policies", where, dict), ids, f"{where}.policies")
        for name in _need(fit, "front", where, list):
            if name not in ids:
                raise BankError(f"{where}.front: unknown tree id {name!r}")
        return TopologyBank(self.trees, stats, policies, self.meta, self.traces, fit, self.shipped_fit, self.root)

    def policy(self, name: str) -> Policy:
        if name not in self.policies:
            raise BankError(f"bank has no {name!r} policy (has: {', '.join(self.policies) or 'none'})")
        return self.policies[name]

    def to_json(self) -> dict[str, Any]:
        trees = []
        for t, st in zip(self.trees, self.stats):
            trees.append({"id": t.name, "paths": t.as_lists(), "n_nodes": t.n_nodes, "depth": t.max_depth, **st})
        out = {"schema_version": SCHEMA_VERSION, **self.meta, "trees": trees, "policies": policies_json(self.policies, self.trees)}
        if self.traces:
            out["traces"] = [t.to_json() for t in self.traces]
        if self.shipped_fit:
            out["fit"] = self.shipped_fit
        return out

    def save(self, path: str | Path) -> Path:
        """Indented JSON, except that each trace is one line (they hold thousands of numbers)."""
        raw = self.to_json()
        traces = raw.pop("traces", [])
        text = json.dumps({**raw, "traces": ["@"] * len(traces)}, indent=1)
        for t in traces:
            text = text.replace('"@"', json.dumps(t, separators=(",", ":")), 1)
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
        return p


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated (smaller or equal x and larger y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


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
    book = prov.get("phrasebook")
    if book is not None:
        w = f"{where}.provenance.phrasebook"
        if isinstance(book, dict) and "reranker" in book:
            _need(book, "reranker", w, str)
            _need(book, "sha256", w, str)
        elif (not isinstance(book, dict) or _need(book, "min_n", w, int) < 1 or not 0 < _need(book, "max_head_p", w, (int, float)) <= 2
                or not 0 <= book.get("min_share", 0) <= 1):
            raise BankError(f"{w}: expected {{\"reranker\": file, \"sha256\": hex}} or {{\"min_n\": >= 1, \"max_head_p\": in (0, 2], "
                            f"\"min_share\": in [0, 1]}}, got {book!r}")
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
        st = {k: float(_need(e, k, w, (int, float))) for k in STAT_FIELDS}
        ids[tid] = len(trees)
        trees.append(tree)
        stats.append(st)

    policies = parse_policies(_need(raw, "policies", where, dict), ids, f"{where}.policies")
    traces = []
    for i, t in enumerate(_need(raw, "traces", where, list)):
        try:
            traces.append(Trace.from_json(t))
        except (KeyError, TypeError, ValueError) as e:
            raise BankError(f"{where}.traces[{i}]: {e!r}") from None
    fit = _need(raw, "fit", where, dict)
    meta = {k: v for k, v in raw.items() if k not in ("schema_version", "trees", "policies", "traces", "fit")}
    return TopologyBank(trees, stats, policies, meta, traces, fit, fit)


def policies_json(policies: dict[str, Policy], trees: list[Tree]) -> dict[str, Any]:
    pol: dict[str, Any] = {}
    for name, p in policies.items():
        if isinstance(p, StaticPolicy):
            pol[name] = {"tree": trees[p.tree].name}
        elif isinstance(p, LadderPolicy):
            pol[name] = {"trees": [trees[i].name for i in p.trees], "thresholds": list(p.thresholds), "feature": p.feature}
        else:
            pol[name] = {"small": trees[p.small].name, "large": trees[p.large].name, "tau_on": p.tau_on,
                         "tau_off": p.tau_off, "feature": p.feature}
        if p.depth and p.feature == "path_value":
            pol[name]["depth"] = p.depth
    return pol


def parse_policies(pols: dict, ids: dict[str, int], where: str) -> dict[str, Policy]:
    """static, ladder and tau from their JSON form; tree ids resolved against `ids`."""

    def ref(obj: dict, key: str, w: str) -> int:
        tid = _need(obj, key, w, str)
        if tid not in ids:
            raise BankError(f"{w}.{key}: unknown tree id {tid!r}")
        return ids[tid]

    def feature(obj: dict, w: str) -> str:
        name = obj.get("feature", "p0")
        if name not in FEATURES:
            raise BankError(f"{w}.feature: unknown feature {name!r} (expected one of {', '.join(FEATURES)})")
        return name

    def depth(obj: dict, w: str) -> int:
        d = obj.get("depth", 0)
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise BankError(f"{w}.depth: expected a non-negative integer, got {d!r}")
        return d

    policies: dict[str, Policy] = {}
    try:
        w = f"{where}.static"
        policies["static"] = StaticPolicy(ref(_need(pols, "static", where, dict), "tree", w))
        lad = _need(pols, "ladder", where, dict)
        w = f"{where}.ladder"
        names = _need(lad, "trees", w, list)
        for n in names:
            if n not in ids:
                raise BankError(f"{w}.trees: unknown tree id {n!r}")
        thr = [float(x) for x in _need(lad, "thresholds", w, list)]
        policies["ladder"] = LadderPolicy(tuple(ids[n] for n in names), tuple(thr), feature(lad, w), depth(lad, w))
        tau = _need(pols, "tau", where, dict)
        w = f"{where}.tau"
        policies["tau"] = TauPolicy(
            ref(tau, "small", w),
            ref(tau, "large", w),
            float(_need(tau, "tau_on", w, (int, float))),
            float(_need(tau, "tau_off", w, (int, float))),
            feature(tau, w),
            depth(tau, w),
        )
    except ValueError as err:
        if isinstance(err, BankError):
            raise
        raise BankError(f"{where}: {err}") from None
    return policies


def load_bank(path: str | Path) -> TopologyBank:
    p = Path(path)
    if not p.exists():
        raise BankError(f"bank file not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise BankError(f"{p}: not valid JSON ({e})") from None
    bank = parse_bank(raw, where=str(p))
    up = p.resolve().parents  # a checkout's bank: <checkout>/banks/<model>/<task>.json
    if len(up) > 2 and up[1].name == "banks" and (up[2] / "assets").is_dir():
        bank.root = up[2]
    return bank

"""The confidence features and the tree-choosing policies (static, ladder, tau)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from entmtp.model import ext

Chooser = Callable[[float], int]
"""feature value -> tree index; the policy's state (τ's current tree) lives inside. A chooser may
carry `settled(value)`: whether every value at most `value` picks the tree `value` picks (so a
path value read through fewer heads, an upper bound of the deeper ones, already decides), and
`settle_at()`: the same test as a bound, (t, strict): settled where value <= t (< t if strict),
which the heads' chain applies itself (`drafting.top1_chain`'s `settle`: one call, not one a head),
and `outcomes()`: (the tree a settled value picks, the tree a value read through the policy's depth
unsettled picks, or None where that depends on the value), so that the chain goes on in the same call
to the depth of the tree picked."""


def confidence(z: torch.Tensor) -> tuple[float, float]:
    """(s, entropy) from the base logits z (V,) at the last accepted position.

    DESIGN.md (*One decode step*) defines s = max(p0, g_1, ..., g_D) with g_d = p0 * p_1 * ... * p_d the value of the
    heads' top-1 path to depth d (EAGLE-2's path value). Every g_d <= p0, so s is p0 exactly:
    the policy can pick a tree before any head runs, and the heads then run only as deep as
    that tree needs.
    """
    built = ext.loaded()
    if built is not None and z.dtype == torch.float32 and z.device.type == "cpu" and z.dim() == 1:
        p0, entropy = built.confidence(z)  # both in two vector passes (csrc/layers.cpp), within ~1e-6 of the lines below
        return p0, (0.0 if math.isnan(entropy) else entropy)
    logp = torch.log_softmax(z.float(), -1)
    p = logp.exp()
    p0, entropy = torch.stack([p.max(), -(p * logp).sum()]).tolist()  # one read from the device
    return p0, (0.0 if math.isnan(entropy) else entropy)


def confidence_rows(z: torch.Tensor) -> tuple[list[float], list[float]]:
    """`confidence` of each row of the base logits z (N, V): (p0, entropy) per position, as the
    engine reads them at each step (a bank's traces: the same bits)."""
    if z.shape[0] == 0:
        return [], []
    p0, entropy = zip(*(confidence(row) for row in z.float().unbind(0)))
    return list(p0), list(entropy)


def path_value(p0: float, chain_probs: list[float]) -> float:
    """g_D = p0 * p_1 * ... * p_D: how confident the heads are along their top-1 path."""
    g = p0
    for pd in chain_probs:
        g *= pd
    return g


FEATURES = ("p0", "path_value", "neg_entropy")  # what a policy reads; each in [0, 1], larger = more confident


def feature_value(name: str, p0: float, entropy: float, value: float) -> float:
    """The policy input named `name`: p0, the heads' path value g_D, or exp(-entropy)."""
    if name == "p0":
        return p0
    if name == "path_value":
        return value
    if name == "neg_entropy":
        return math.exp(-entropy)
    raise ValueError(f"unknown feature {name!r} (expected one of {', '.join(FEATURES)})")


@dataclass(frozen=True)
class StaticPolicy:
    """EntMTP*: always the same tree."""

    tree: int = 0
    feature: str = "p0"  # read but unused: one tree whatever the value
    depth: int = 0
    name = "static"

    def chooser(self) -> Chooser:
        def choose(s: float) -> int:
            return self.tree

        choose.settled = lambda s: True
        choose.settle_at = lambda: (math.inf, False)  # `settled` as a bound: s <= inf
        choose.outcomes = lambda: (self.tree, self.tree)
        return choose


@dataclass(frozen=True)
class LadderPolicy:
    """EntMTP-l: K-1 increasing thresholds over K trees; bigger s -> bigger tree."""

    trees: tuple[int, ...]
    thresholds: tuple[float, ...]
    feature: str = "p0"
    depth: int = 0  # path_value: through the first `depth` heads (0: the bank's depth)
    name = "ladder"

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"ladder: unknown feature {self.feature!r}")
        if self.depth < 0:
            raise ValueError(f"ladder: depth must be >= 0, got {self.depth}")
        if len(self.thresholds) != len(self.trees) - 1:
            raise ValueError(f"ladder: {len(self.trees)} trees need {len(self.trees) - 1} thresholds, got {len(self.thresholds)}")
        if list(self.thresholds) != sorted(self.thresholds):
            raise ValueError(f"ladder: thresholds must increase, got {list(self.thresholds)}")

    def chooser(self) -> Chooser:
        def choose(s: float) -> int:
            return self.trees[bisect.bisect_right(self.thresholds, s)]

        choose.settled = lambda s: not self.thresholds or s < self.thresholds[0]  # the bottom rung
        choose.settle_at = lambda: (self.thresholds[0], True) if self.thresholds else (math.inf, False)
        choose.outcomes = lambda: (self.trees[0], None if len(set(self.trees)) > 1 else self.trees[0])
        return choose


@dataclass(frozen=True)
class TauPolicy:
    """EntMTPτ: hysteresis between a small tree T- and a large tree T+.

    On T+ and s <= tau_off -> T-; otherwise s > tau_on -> T+; otherwise stay. Starts on T-.
    """

    small: int
    large: int
    tau_on: float
    tau_off: float
    feature: str = "p0"
    depth: int = 0  # path_value: through the first `depth` heads (0: the bank's depth)
    name = "tau"

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"tau: unknown feature {self.feature!r}")
        if self.depth < 0:
            raise ValueError(f"tau: depth must be >= 0, got {self.depth}")
        if self.tau_off > self.tau_on:
            raise ValueError(f"tau: tau_off ({self.tau_off}) must not exceed tau_on ({self.tau_on})")

    def chooser(self) -> Chooser:
        state = {"tree": self.small}

        def choose(s: float) -> int:
            if state["tree"] == self.large and s <= self.tau_off:
                state["tree"] = self.small
            elif s > self.tau_on:
                state["tree"] = self.large
            return state["tree"]

        # on T-, any value <= tau_on stays; on T+, any value <= tau_off leaves
        choose.settled = lambda s: s <= (self.tau_off if state["tree"] == self.large else self.tau_on)
        choose.settle_at = lambda: (self.tau_off if state["tree"] == self.large else self.tau_on, False)
        # settled: T- (stay or leave to it); not settled: T+ (go or stay), whichever tree it is on
        choose.outcomes = lambda: (self.small, self.large)
        return choose


Policy = StaticPolicy | LadderPolicy | TauPolicy

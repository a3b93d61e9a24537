"""Which machine this is: its name for reports, and the fingerprint that keys a bank's fit
(everything that decides the cost of a decode step besides the tree)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def device_name(device: torch.device | None = None) -> str:
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(device if device is not None else 0)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {name}, {os.cpu_count()} cores"


def hardware() -> str:
    """One line naming this machine, for reports."""
    return f"{device_name()}, torch threads {torch.get_num_threads()}"


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

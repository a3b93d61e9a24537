"""Where the app's device work runs: inside `spaces.GPU` calls on a ZeroGPU Space, in-process elsewhere.

On ZeroGPU the GPU exists only during a call of a function decorated with `spaces.GPU`, which
runs in a forked worker; the page's own process emulates CUDA, and what a worker learns (its
objects, its state) never comes back except as the call's return values or yields, pickled. So
every piece of device work (a race, a fit) is a module-level function of small picklable
arguments wrapped by `on_gpu`, and what the page needs of it comes back as plain data: the
device's fingerprint (`remember`, read by `page_fingerprint`) and the fits.

`spaces.GPU(duration=...)` asks the platform for that many seconds before the call is scheduled,
and the platform refuses a request above the visitor's remaining daily quota (2 minutes for a
visitor who is not logged in): `duration` is a callable of the call's own arguments, sized to it.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import os
import threading
from functools import wraps
from pathlib import Path
from typing import Any, Callable

from entmtp.runtime.weights import cache_root

try:  # importing it first is app.py's business (before anything initialises CUDA)
    import spaces
except ImportError:
    spaces = None

MAX_REQUEST_S = 120  # never ask for more: a visitor who is not logged in has 2 minutes a day
_inside = contextvars.ContextVar("entmtp_gpu_context", default=False)
_seen: dict[str, Any] = {}


def zero_gpu() -> bool:
    """Whether this process serves a ZeroGPU Space (the GPU exists only inside `on_gpu` calls)."""
    config = getattr(getattr(spaces, "config", None), "Config", None)
    return bool(getattr(config, "zero_gpu", False))


def inside() -> bool:
    """Whether the caller runs inside an `on_gpu` call (on ZeroGPU: in the GPU worker)."""
    return _inside.get()


def on_gpu(duration: Callable[..., float]):
    """Decorator: run the function (or each step of the generator) in the GPU context.

    `duration(*args, **kwargs)` gives the seconds to request for a call with those arguments; the
    request is capped at MAX_REQUEST_S. The context is set around each step of a generator, not
    across its yields, so the page's code between two yields never counts as inside.
    """

    def request(*args, **kwargs) -> int:
        return int(min(MAX_REQUEST_S, max(1, round(duration(*args, **kwargs)))))

    def decorate(fn):
        if inspect.isgeneratorfunction(fn):
            @wraps(fn)
            def run(*args, **kwargs):
                steps = fn(*args, **kwargs)
                try:
                    while True:
                        token = _inside.set(True)
                        try:
                            item = next(steps)
                        except StopIteration:
                            return
                        finally:
                            _inside.reset(token)
                        yield item
                finally:
                    token = _inside.set(True)
                    try:
                        steps.close()  # a Stop ends the device work too
                    finally:
                        _inside.reset(token)
        else:
            @wraps(fn)
            def run(*args, **kwargs):
                token = _inside.set(True)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _inside.reset(token)
        run.request_s = request
        return spaces.GPU(duration=request)(run) if spaces is not None else run

    return decorate


# -- the device's fingerprint, as the GPU worker saw it ----------------------------------------------


def record_file() -> Path:
    return cache_root() / "zerogpu-device.json"


def remember(fingerprint: dict[str, Any]) -> None:
    """Keep the fingerprint a GPU call measured, for this process and its restarts."""
    _seen["fingerprint"] = fingerprint
    path = record_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # two threads of a page may remember at once
    tmp.write_text(json.dumps(fingerprint))
    tmp.replace(path)


UNSEEN = {"device": "the ZeroGPU device (not seen yet: no GPU call has run)", "threads": None, "dtype": "?", "kernels": "?", "torch": "?"}


def page_fingerprint() -> dict[str, Any] | None:
    """The fingerprint fits are keyed by, as the page's process must name it: None (take the
    process's own) except on ZeroGPU outside a GPU call, where it is the one a GPU call recorded,
    or UNSEEN before any (which matches no fit)."""
    if not zero_gpu() or inside():
        return None
    if "fingerprint" not in _seen:
        try:
            _seen["fingerprint"] = json.loads(record_file().read_text())
        except (OSError, ValueError):
            return UNSEEN
    return _seen["fingerprint"]

"""A stand-in for Hugging Face's `spaces` package on a ZeroGPU Space, for tests (fork-free).

What it keeps of the real package (spaces 0.51, `spaces/zero/wrappers.py`):
- `GPU(fn)`, `GPU(duration=...)(fn)`: `duration` may be a callable of the call's own arguments;
  every call records the seconds it requests (`REQUESTS`, and one JSON line per call in the file
  FAKE_SPACES_LOG names) and is refused above MAX_S, as the platform refuses a request above a
  visitor's quota;
- the call's arguments, return value and every yield cross a process boundary, pickled: here
  they are pickled too, and a tensor among them is refused (a CUDA tensor in the page's process);
- a generator runs one step at a time in the GPU context, and closing the caller's generator (a
  Stop) closes it (logged: {"closed": name, "early": true}); a plain call's end is logged too
  ({"returned": name});
- `config.Config.zero_gpu` is True.

What it adds: `guard(module, *names)` makes those functions (the model's forwards) fail outside
a GPU call once the app is served (`arm`, called when Gradio launches: what runs before is the
start-up, which loads the model; on a GPU it does no device work, on a CPU it packs the heads'
int8 rows with one forward).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import io
import json
import os
import pickle
import threading

from . import config  # spaces.config.Config, as the real package exposes it

__all__ = ["GPU", "config"]

MAX_S = 120  # what a visitor who is not logged in may request at most (2 minutes a day)
REQUESTS: list[dict] = []
_inside = contextvars.ContextVar("fake_spaces_gpu", default=False)
_armed = threading.Event()
_active = [0]


class DeviceWorkOutsideGPU(RuntimeError):
    pass


def inside() -> bool:
    return _inside.get()


def active() -> int:
    """GPU calls under way now."""
    return _active[0]


def arm() -> None:
    _armed.set()


def _log(entry: dict) -> None:
    REQUESTS.append(entry)
    path = os.environ.get("FAKE_SPACES_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def guard(module, *names) -> None:
    """Device work: each function fails when called outside a GPU call (once armed)."""
    for name in names:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def checked(*args, _fn=fn, _name=f"{module.__name__}.{name}", **kwargs):
            if _armed.is_set() and not _inside.get():
                _log({"violation": _name})
                raise DeviceWorkOutsideGPU(f"{_name} ran outside a @spaces.GPU call")
            return _fn(*args, **kwargs)

        setattr(module, name, checked)


class _NoTensors(pickle.Pickler):
    def reducer_override(self, obj):
        import torch

        if isinstance(obj, torch.Tensor):
            raise pickle.PicklingError("a tensor would cross the ZeroGPU process boundary")
        return NotImplemented


def _cross(obj):
    buf = io.BytesIO()
    _NoTensors(buf).dump(obj)
    return pickle.loads(buf.getvalue())


def GPU(task=None, *, duration=None, size=None, **kwargs):
    if task is None or not callable(task):
        return functools.partial(GPU, duration=duration if task is None else task, size=size)

    def schedule(args, kwargs) -> None:
        seconds = duration(*args, **kwargs) if callable(duration) else (duration or 60)
        _log({"function": task.__name__, "seconds": seconds})
        if seconds > MAX_S:
            raise RuntimeError(f"ZeroGPU illegal duration: {seconds} s requested, more than {MAX_S} s")

    def step(fn, *args):
        token = _inside.set(True)
        try:
            return fn(*args)
        finally:
            _inside.reset(token)

    if inspect.isgeneratorfunction(task):
        @functools.wraps(task)
        def run(*args, **kwargs):
            schedule(args, kwargs)
            args, kwargs = _cross((args, kwargs))
            steps = task(*args, **kwargs)
            _active[0] += 1
            finished = False
            try:
                while True:
                    try:
                        item = step(next, steps)
                    except StopIteration:
                        finished = True
                        return
                    yield _cross(item)
            finally:
                step(steps.close)
                _active[0] -= 1
                _log({"closed": task.__name__, "early": not finished})
    else:
        @functools.wraps(task)
        def run(*args, **kwargs):
            schedule(args, kwargs)
            args, kwargs = _cross((args, kwargs))
            _active[0] += 1
            try:
                return _cross(step(task, *args, **kwargs))
            finally:
                _active[0] -= 1
                _log({"returned": task.__name__})
    return run

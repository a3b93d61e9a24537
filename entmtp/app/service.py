"""The work behind the page: the start-up (the page is served at once while the model loads), this
machine's bank fits (measured in the background, giving way to races), and the device work of a
race or a fit, run through `gpu.on_gpu` so that on a ZeroGPU Space it happens in the GPU worker.

A race at the page: `Service.wait_ready` (progress messages while the model loads), then
`race_steps`, whose yields are plain data (`Side.delta`), at most YIELDS_PER_S a second (CPU_YIELDS_PER_S on a CPU); the page
builds its figures from them. Before this machine's fit of the task's bank exists, a race runs
with the bank file's shipped fit (and says so) while the fit is measured in the background.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import gradio as gr
import torch

from entmtp.app import gpu
from entmtp.app.counterfactual import counterfactual
from entmtp.app.lesson import lesson_step
from entmtp.app.race import (Models, PerProcess, RaceError, Request, bank_for, bank_note, entmtp_policy, has_bank, start)
from entmtp.bank.ondemand import BankBuild, read_status, status_text
from entmtp.config import GenerationConfig
from entmtp.config import DEFAULT_MODEL, TASKS
from entmtp.model import ext
from entmtp.runtime.weights import LoadError, default_weights_kind
from entmtp.spec.engine import GenerationError
from entmtp.spec.policy import TauPolicy

# A race's cadence: updates a second (each is pickled across the ZeroGPU process boundary) and
# seconds between chart redraws (charts are re-sent whole), on a GPU and on a CPU (`cadence`).
# On a CPU the browser drawing the page may share the engine's cores (`make demo`), and whatever it
# draws is taken from the steps both sides time: on the 2-core AMD EPYC Zen 3 (AVX2), a local
# Chromium and 96 chat tokens, EntMTPτ measured 31-40 tok/s with 15 updates a second, charts every
# 0.8 s and Gradio's progress overlays, 79-105 (a first race after start: 33) with 4 updates a second,
# charts every 2.5 s and no overlays, and 148-150 with no browser (gradio_client).
YIELDS_PER_S, CHART_EVERY_S = 15, 0.8
CPU_YIELDS_PER_S, CPU_CHART_EVERY_S = 4, 2.5
RACE_START_S = 13.0  # a cold GPU worker (weights onto the device, the policy's graphs, two prefills) and the counterfactual pass
STEP_BUDGET_MS = 18.0  # per decode step and side: 1.5x an unknown GPU's slowest default step (H200: 3.5-10.3 ms)
FIT_START_S, FIT_TASK_S = 20.0, 15.0  # a GPU fit: graphs for every tree, then each task's timing rounds
DEADLINE_MARGIN_S = 3.0  # a race ends itself this long before the GPU time it asked for runs out
# A bank built here (`bank.ondemand`): GPU seconds a piece of it asks for, and the seconds it builds
# for within them (after a cold worker's start, before the margin); ENTMTP_APP_BUILD_PIECE_S sets
# the second shorter (tests).
BUILD_CALL_S = 90.0
BUILD_PIECE_S = float(os.environ.get("ENTMTP_APP_BUILD_PIECE_S", BUILD_CALL_S - RACE_START_S - DEADLINE_MARGIN_S))
_services: dict[int, "Service"] = {}


def cadence(rt) -> tuple[float, float]:
    """(updates a second, seconds between chart redraws) of a race on `rt`'s device."""
    return (YIELDS_PER_S, CHART_EVERY_S) if rt.engine.device.type == "cuda" else (CPU_YIELDS_PER_S, CPU_CHART_EVERY_S)


@contextmanager
def page_errors(title: str, errors: tuple = (LoadError, GenerationError, ValueError)):
    """A refused request (`RaceError`, under its own title) or one of `errors` (under `title`) as the
    message the page shows: a `gr.Error`, which also crosses the ZeroGPU process boundary intact."""
    try:
        yield
    except RaceError as e:
        raise gr.Error(str(e), title=e.title) from None
    except errors as e:
        raise gr.Error(str(e), title=title) from None


def race_bank(rt, task: str):
    """(bank, fitted): the task's bank under this machine's fit where one exists (never timed
    here), else under the bank file's shipped fit."""
    fitted = not rt.needs_calibration(task)
    return bank_for(rt, task, mode=None if fitted else "shipped"), fitted


def race_seconds(req: Request) -> float:
    """GPU seconds a race asks for: its start plus a step per token on each side at STEP_BUDGET_MS
    (speculative steps emit more than a token, so this bounds them from above)."""
    return RACE_START_S + 2 * req.max_new_tokens * STEP_BUDGET_MS / 1e3


def fit_seconds(tasks: list[str] | tuple[str, ...]) -> float:
    return FIT_START_S + FIT_TASK_S * len(tasks)


class Turns:
    """The machine, shared by races (which run whole, several at once) and the background fit
    (which times in short blocks, `calibrate.measure_costs`, and lets a waiting race in between
    two blocks), so that neither skews the other's clock."""

    def __init__(self):
        self._state = PerProcess(lambda: SimpleNamespace(cv=threading.Condition(), racing=0, waiting=0, timing=False))

    @contextmanager
    def race(self):
        st = self._state.get()
        with st.cv:
            st.waiting += 1
            while st.timing:
                st.cv.wait()
            st.waiting -= 1
            st.racing += 1
        try:
            yield
        finally:
            with st.cv:
                st.racing -= 1
                st.cv.notify_all()

    @contextmanager
    def fit_block(self):
        st = self._state.get()
        with st.cv:
            while st.racing or st.waiting:
                st.cv.wait()
            st.timing = True
        try:
            yield
        finally:
            with st.cv:
                st.timing = False
                st.cv.notify_all()


class Background:
    """Work by (model, task), queued and done one at a time on a daemon thread, each under the
    context of the request that queued it (on ZeroGPU its GPU calls are charged to that visitor).
    `states` says where each stands: "queued", then what the work writes there, "failed: …" where
    it raised (queued again on the next `put`); the work removes its entry when done."""

    def __init__(self, name: str, work: Callable[[str, str], None]):
        self.states: dict[tuple[str, str], str] = {}
        self._name, self._work = name, work
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def put(self, model: str, task: str) -> None:
        """Queue the work for (model, task), unless it is queued or under way."""
        with self._guard:
            if (model, task) in self.states and not self.states[(model, task)].startswith("failed"):
                return
            self.states[(model, task)] = "queued"
            self._queue.put((model, task, contextvars.copy_context()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            model, task, context = self._queue.get()
            try:
                context.run(self._work, model, task)
            except Exception as e:  # the page shows it
                self.states[(model, task)] = f"failed: {e}"


class Service:
    """One page's models, start-up and fits; device work finds it again by `key` (an int, so that
    a GPU call's arguments stay small and picklable)."""

    def __init__(self, models: Models):
        self.models = models
        self.key = id(self)
        _services[self.key] = self
        self.turns = Turns()
        self.status = "not started"
        self.error: str | None = None
        self.ready = threading.Event()
        # this machine's fits of the banks and the banks built here, in the background (races keep the
        # shipped fit, or the fallback bank, meanwhile): (model, task) -> what each is doing
        self._fitting = Background("entmtp-fit", lambda name, task: self.fit(name, [task], "auto"))
        self._building = Background("entmtp-build", self.build)
        self.fits, self.builds = self._fitting.states, self._building.states
        self._guard = threading.Lock()
        self._started = False

    # -- start-up ----------------------------------------------------------------------------

    def start(self, background: bool = True) -> "Service":
        """Load the app's model and heads, then queue its banks' fits. In a thread when
        `background` (the page is served meanwhile); on ZeroGPU always here and now, before the
        page is served: its CUDA emulation covers the main thread only, and the model must be on
        the (emulated) device before `launch` for the GPU workers to inherit it. Once only."""
        with self._guard:
            if self._started:
                return self
            self._started = True
        if background and not gpu.zero_gpu():
            threading.Thread(target=self._load, name="entmtp-start", daemon=True).start()
        else:
            self._load()
        return self

    def _load(self) -> None:
        started = time.monotonic()
        try:
            if self._builds_kernels():  # compile them (other processes) while this one dequantises the weights
                threading.Thread(target=ext.extension, name="entmtp-kernels", daemon=True).start()
            self.status = ("loading the model (a machine's first start also dequantises its weights and builds "
                           "its CPU kernels: about 40 s on 2 cores)")
            rt = self.models.get(None)
            self.status = "loading the draft heads"
            for kind in ("hydra", "medusa"):
                try:
                    rt.heads(kind)
                except LoadError as e:  # a race that needs them says so
                    print(f"entmtp: {e}", flush=True)
            # the banks draft with it: built here (~3 s on 2 cores), not in a visitor's first race
            # (on ZeroGPU that race's GPU call would pay for it)
            self.status = "reading the phrasebook (n-grams of the stored answers)"
            rt.phrasebook()
            self.status = f"ready (loaded in {time.monotonic() - started:.0f} s)"
        except Exception as e:  # the page shows it; a race names it
            self.error = f"{type(e).__name__}: {e}" if not isinstance(e, (LoadError, RaceError)) else str(e)
            self.status = f"the model failed to load: {self.error}"
            self.ready.set()
            return
        self.ready.set()
        if not gpu.zero_gpu():  # on ZeroGPU a fit or a build is a GPU call: it waits for a visitor's race
            for task in TASKS:
                self.queue_fit(None, task)
                self.queue_build(None, task)

    def _builds_kernels(self) -> bool:
        """Whether loading the app's model will use (and so first build) the CPU kernels."""
        try:
            return (self.models.check(None) == DEFAULT_MODEL and default_weights_kind() == "gguf"
                    and not torch.cuda.is_available() and ext.unavailable_reason() is None)
        except (LoadError, RaceError):
            return False

    def wait_ready(self, poll_s: float = 0.5) -> Iterator[str]:
        """Progress messages while the start-up loads (none once it has); raises when it failed.
        Starts it if nobody has (a page served by `gradio app.py` imports `demo` only)."""
        self.start()
        t0 = time.monotonic()
        while not self.ready.wait(poll_s):
            yield f"waiting for the start-up: {self.status} ({time.monotonic() - t0:.0f} s)…"
        if self.error:
            raise LoadError(self.error)

    # -- this machine's fits, in the background -------------------------------------------------

    def fit_status(self, model: str | None, task: str) -> str:
        return self.fits.get((self.models.check(model), task), "")

    def queue_fit(self, model: str | None, task: str) -> None:
        """Measure this machine's fit of the task's bank in the background, unless it exists or is
        queued; on ZeroGPU the GPU call runs under the caller's request (its visitor's quota)."""
        name = self.models.check(model)
        rt = self.models.loaded(name)
        if rt is None or self.models.fit_mode != "auto" or not has_bank(rt, task) or not rt.needs_calibration(task):
            return
        self._fitting.put(name, task)

    def fit(self, model: str | None, tasks: list[str], mode: str = "auto") -> None:
        """Fit the tasks' banks to this machine (mode "refit": measure again) through `fit_banks`,
        and keep what it measured for the page."""
        name = self.models.check(model)
        for task in tasks:  # under way from its call, not from its first progress: the status line says so at once
            self.fits[(name, task)] = "measuring this machine: starting"
        try:
            fingerprint, fits = fit_banks(self.key, name, tuple(tasks), mode)
        finally:  # the status line's "measuring" ends with the fit (a failure is the caller's to show)
            for task in tasks:
                self.fits.pop((name, task), None)
        if gpu.zero_gpu():
            gpu.remember(fingerprint)
        self.models.get(name).adopt_fits(fits)

    # -- banks built here, where a model has none (`bank.ondemand`) --------------------------------

    def queue_build(self, model: str | None, task: str) -> None:
        """Build the task's bank for the model in the background where it has none (shipped or built
        here) and its Hydra heads load: on ZeroGPU as a sequence of GPU calls (`build_piece`), each
        charged to the request of the visitor whose race asked for it; elsewhere in one go, each
        prompt's traces and each block of timing giving way to races (`Turns.fit_block`). Races
        meanwhile use the fallback bank and say how far the build is."""
        name = self.models.check(model)
        rt = self.models.loaded(name)
        if rt is None or rt.bank_file(task) is not None or rt.built_file(task) is None:
            return
        self._building.put(name, task)

    def build(self, model: str | None, task: str) -> None:
        """Build the task's bank piece by piece (`build_piece`) until it is done."""
        name = self.models.check(model)
        self.builds[(name, task)] = "building"
        while True:
            got = build_piece(self.key, name, task)
            if gpu.zero_gpu():
                gpu.remember(got["fingerprint"])
            if got["done"]:
                break
        self.builds.pop((name, task), None)

    def build_status(self, model: str | None, task: str) -> str:
        """One line on the task's bank being built here ("" where none is)."""
        name = self.models.check(model)
        state = self.builds.get((name, task))
        if state is None:
            return ""
        if state.startswith("failed"):
            return state
        rt = self.models.loaded(name)
        where = rt.built_file(task) if rt is not None else None
        return status_text(read_status(where)) if where is not None else state

    def progress(self, name: str, tasks: tuple[str, ...]):
        """A calibration progress callback that keeps the page's fit status current."""

        def wrap(iterable, desc, total):
            for i, item in enumerate(iterable):
                for task in tasks:
                    self.fits[(name, task)] = f"measuring this machine: {desc} {i + 1}/{total}"
                yield item

        return wrap


# -- device work ---------------------------------------------------------------------------------


@gpu.on_gpu(duration=lambda key, model, tasks, mode="auto": fit_seconds(tasks))
def fit_banks(key: int, model: str, tasks: tuple[str, ...], mode: str = "auto") -> tuple[dict, dict[str, dict]]:
    """(fingerprint, {task: fit}) of the tasks' banks on this device, timed if need be (each
    block of timing in a `Turns.fit_block`, so races go first)."""
    svc = _services[key]
    rt = svc.models.get(model)
    with page_errors("Cannot fit the bank", (LoadError,)):
        banks = rt.banks(list(tasks), svc.progress(model, tasks), mode, svc.turns.fit_block)
    return rt.fingerprint, {task: bank.fit for task, bank in banks.items()}


@gpu.on_gpu(duration=lambda key, model, task: BUILD_CALL_S)
def build_piece(key: int, model: str, task: str) -> dict[str, Any]:
    """A piece of the task's bank built on this device (`bank.ondemand.BankBuild.advance`): on
    ZeroGPU until BUILD_PIECE_S have passed, between two prompts or before a timing stage that
    would not end in time; elsewhere to the end. -> {"done", "status", "fingerprint"}."""
    svc = _services[key]
    t0 = time.monotonic()
    with page_errors("Cannot build the bank", (LoadError,)):
        rt = svc.models.get(model)
        job = BankBuild(rt, task)
        bank = job.advance(t0 + BUILD_PIECE_S if gpu.zero_gpu() else None, svc.turns.fit_block)
    return {"done": bank is not None, "status": job.status(), "fingerprint": rt.fingerprint}


@gpu.on_gpu(duration=lambda key, req, model=None: race_seconds(req))
def race_steps(key: int, req: Request, model: str | None = None) -> Iterator[dict[str, Any]]:
    """A race on the device: first {"fingerprint", "names", "forecasts", "fitted", "note", "policy"}, then
    {"sides": (EntMTP's delta, the baseline's delta)} at most YIELDS_PER_S a second (CPU_YIELDS_PER_S on a CPU), the last one
    when both sides are done, then at temperature 0 {"counterfactual": what every bank tree would
    have done on this output}. Never a tensor, never a model object. On ZeroGPU the race ends
    itself before the GPU time it asked for runs out."""
    svc = _services[key]
    with page_errors("Cannot run this race"):
        rt = svc.models.get(model)
        bank, fitted = race_bank(rt, req.task)
        ent, base, pol = start(rt, req, bank, svc.models.runtime_lock(model))
    tau = (pol.tau_on, pol.tau_off) if isinstance(pol, TauPolicy) and pol.small != pol.large else None
    yield {"fingerprint": rt.fingerprint, "names": (ent.name, base.name), "forecasts": (ent.forecast, base.forecast), "fitted": fitted,
           "note": bank_note(rt, req.task, bank), "policy": {"tau": tau, "feature": pol.feature, "depth": pol.depth or bank.max_depth}}
    deadline = time.monotonic() + race_seconds(req) - DEADLINE_MARGIN_S if gpu.zero_gpu() else None
    rate = cadence(rt)[0]
    last = 0.0
    try:
        with svc.turns.race():
            while True:
                for side in (ent, base):
                    if not side.done:
                        side.advance(rt)
                if deadline is not None and time.monotonic() > deadline:
                    for side in (ent, base):
                        side.stop("the GPU time this race asked for ran out")
                finished = ent.done and base.done
                if finished or time.monotonic() - last >= 1 / rate:
                    last = time.monotonic()
                    yield {"sides": (ent.delta(), base.delta())}
                if finished:
                    break
            if req.temperature == 0 and not ent.cut and not bank.meta.get("fallback") and bank.max_depth:
                yield {"counterfactual": counterfactual(rt, bank, pol, ent.name, rt.encode(req.prompt), ent.ids, ent.records)}
    except GenerationError as e:
        raise gr.Error(str(e), title="The race stopped") from None
    finally:
        for side in (ent, base):
            side.stop("stopped")


@gpu.on_gpu(duration=lambda key, req, model, k: RACE_START_S + (k + 1) * STEP_BUDGET_MS / 1e3)
def lesson(key: int, req: Request, model: str | None, k: int) -> dict[str, Any]:
    """Step k of EntMTP on the request's prompt, explained (`lesson.lesson_step`), as plain data."""
    svc = _services[key]
    with page_errors("Cannot run this step"):
        rt = svc.models.get(model)
        bank, _ = race_bank(rt, req.task)
        policy, label = entmtp_policy(bank, req)
        gen = GenerationConfig(max_new_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed)
        with svc.models.runtime_lock(model):
            rt.heads("hydra")
        with svc.turns.race():
            return lesson_step(rt, bank, policy, label, rt.encode(req.prompt), gen, k)

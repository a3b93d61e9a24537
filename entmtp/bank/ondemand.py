"""A bank built where it is needed (DESIGN.md *Banks built where they are needed*).

A model with draft heads but no bank in `banks/` gets one the first time a front end needs it:
`build-bank`'s own stages (`build.build_task_bank`: greedy continuations of the task's
calibration prompts and their acceptance traces, candidate trees grown from them, then
`calibrate`'s timing and fit on this machine), run in pieces. Each piece goes on until a deadline
(a ZeroGPU call's end) and stops between two prompts; the stages checkpoint after every prompt,
so a piece cut short, or a process restarted, resumes where the last prompt ended.

Where it lives: `ENTMTP_CACHE/banks/<model>/<key>/<task>.json`, the key hashing the model, its
weights (and their revision), the heads' files and the build's settings, so other
heads or weights never find a bank traced for these. The finished file is a bank like the shipped
ones: copied to `banks/<model>/<task>.json` beside a Space, later starts skip the build.

`BankBuild.status` says how far a build is (prompts traced, trees timed, an estimate of the time
left from the step time it measured), written to the work folder as it goes so that another
process (the page, while a ZeroGPU worker builds) reads it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from entmtp.bank.bank import TopologyBank
from entmtp.bank.build import build_task_bank, calibration_prompts
from entmtp.config import BankBuildConfig, CalibrateConfig, Progress
from entmtp.data.answers import repo_store

Turn = Callable[[], contextlib.AbstractContextManager]
TIMING_MARGIN = 1.5  # the timing stage starts only where this many times its estimate is left
PROMPT_MARGIN = 1.5  # and a prompt only where this many times the last prompt's seconds are


class BuildPaused(Exception):
    """A piece of a build reached its deadline between two prompts (or before the timing stage,
    which it could not finish in time); its checkpoints resume it."""


def build_key(rt, cfg: BankBuildConfig) -> str:
    """What a built bank depends on: the model and its weights (their revision), the Hydra heads'
    files, the build's settings. Not the device: traces drafted on another device's arithmetic
    differ at near-ties only, and the fit is this machine's (measured again where it changes)."""
    what = {"model": rt.name, "weights": rt.weights, "revision": getattr(rt.model.config, "_commit_hash", None),
            "heads": rt.heads_digest("hydra"), "cfg": asdict(cfg)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build_dir(rt, cfg: BankBuildConfig) -> Path:
    return Path(rt.fits_root) / "banks" / rt.slug / build_key(rt, cfg)


def built_path(rt, task: str, cfg: BankBuildConfig | None = None) -> Path:
    """Where `rt`'s bank for `task`, built here, is (or will be) cached."""
    return build_dir(rt, cfg or rt.build_config) / f"{task}.json"


def work_dir(out: Path) -> Path:
    """The stages and status of the build whose bank goes to `out`, until it is saved."""
    return out.with_name(f"{out.stem}-work")


class BankBuild:
    """One task's bank for a runtime's model and heads, built where it runs (resumable)."""

    def __init__(self, rt, task: str, cfg: BankBuildConfig | None = None, calib: CalibrateConfig | None = None):
        self.rt, self.task = rt, task
        self.cfg = cfg or rt.build_config
        self.calib = calib or rt.calibrate_config
        rt.heads("hydra")  # heads that do not fit the model fail here, before anything is built
        self.out = built_path(rt, task, self.cfg)
        self.work = work_dir(self.out)

    # -- where it stands ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """{"stage": "waiting" | "traces" | "timing" | "done" | "failed", "traced", "prompts",
        "prompt_s", "step_ms", "eta_s", "timed", "rounds", "note"}: what the last piece wrote, read from the work
        folder (a bank that exists is "done")."""
        return read_status(self.out)

    def _write(self, **st: Any) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        path = self.work / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        tmp.replace(path)

    def _eta_s(self, traced: int, n: int, prompt_s: float | None) -> float | None:
        """Seconds left: the prompts still to trace at the seconds a prompt measured so far, then
        the timing stage at the step time that implies."""
        if prompt_s is None:
            return None
        return (n - traced) * prompt_s + self.timing_s(self.step_ms(prompt_s))

    def step_ms(self, prompt_s: float) -> float:
        """A decode step's ms as a traced prompt measured it: its greedy answer (a step a token at
        most) and the passes that rank its heads, over its tokens."""
        return prompt_s * 1e3 / self.cfg.calib_new_tokens

    def timing_s(self, step_ms: float) -> float:
        """About how long the timing stage takes at `step_ms` a step: every candidate tree and
        Hydra's, `calibrate`'s rounds of timed and untimed steps, at two contexts, and the chain."""
        c = self.calib
        steps = c.warm_steps + c.rounds * (c.steps + c.steps // max(1, c.block))
        return (self.cfg.max_candidates + 1) * steps * 2 * step_ms / 1e3 + 2.0

    # -- building ----------------------------------------------------------------------------------

    def advance(self, deadline: float | None = None, turn: Turn = contextlib.nullcontext,
                progress: Progress | None = None) -> TopologyBank | None:
        """Build on until the bank is done (-> it, saved under `out`) or `deadline` (time.monotonic())
        comes between two prompts or before a timing stage it could not finish (-> None). Each
        prompt's traces, and each block of the timing stage, run inside `turn()` (a race may go
        between two). `progress` wraps the stages' loops (traces, then timing rounds) as a bar."""
        if self.out.exists():
            return self.rt.built_bank(self.task)
        texts, calibration = calibration_prompts(self.task, None, self.cfg.calib_prompts)
        n = len(texts)
        stage1 = self.work / "stage1.json"
        traced = len(json.loads(stage1.read_text())) if stage1.exists() else 0
        started = traced
        resumed_all = traced >= n  # a piece that starts at the timing stage runs it, whatever its estimate
        prompt_s = self.status().get("prompt_s")

        def report(**kw):
            self._write(**({"stage": "traces", "traced": traced, "prompts": n, "prompt_s": prompt_s,
                            "step_ms": None if prompt_s is None else self.step_ms(prompt_s), "rounds": None, "timed": 0,
                            "eta_s": self._eta_s(traced, n, prompt_s), "updated": time.time()} | kw))

        def pieces(iterable, desc, total):
            nonlocal traced, prompt_s
            shown = progress(iterable, desc, total) if progress is not None else iterable
            if desc == "traces":
                for i, item in enumerate(shown):
                    late = deadline is not None and time.monotonic() + PROMPT_MARGIN * (prompt_s or 0.0) >= deadline
                    if i >= traced and late and traced > started:  # the next prompt might not end in time (a piece traces one at least)
                        raise BuildPaused(f"{traced}/{n} prompts traced")
                    t0 = time.monotonic()
                    with turn():
                        yield item
                    if i >= traced:
                        traced, prompt_s = i + 1, time.monotonic() - t0
                        report()
                timing = self.timing_s(self.step_ms(prompt_s or 0.0))
                if deadline is not None and not resumed_all and time.monotonic() + TIMING_MARGIN * timing >= deadline:
                    raise BuildPaused(f"{n}/{n} prompts traced: the timing stage goes in the next piece")
                return
            timing = self.timing_s(self.step_ms(prompt_s or 0.0))
            for i, item in enumerate(shown):  # the timing stage: rounds of every tree
                report(stage="timing", traced=n, timed=i, rounds=total, eta_s=(total - i) * timing / max(1, total))
                yield item

        report()
        rule = self.rt.phrasebook_rule() if repo_store(self.rt.name) is not None else None
        try:
            bank = build_task_bank(self.rt, self.task, texts, calibration, self.cfg, self.work, False,
                                   f"built here on first use (entmtp.bank.ondemand, {self.cfg.calib_prompts} prompts)",
                                   pieces, rule, turn=turn, answers=None, calib=self.calib)
        except BuildPaused:
            return None
        except Exception as e:
            self._write(stage="failed", traced=traced, prompts=n, note=f"{type(e).__name__}: {e}", updated=time.time())
            raise
        bank.meta["provenance"]["built_here"] = True
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp.json")
        bank.save(tmp)
        tmp.replace(self.out)
        shutil.rmtree(self.work, ignore_errors=True)
        return self.rt.built_bank(self.task)


def read_status(out: Path) -> dict[str, Any]:
    """The status of the build whose bank goes to `out` (`BankBuild.status`)."""
    if out.exists():
        return {"stage": "done", "path": str(out)}
    try:
        return json.loads((work_dir(out) / "status.json").read_text())
    except (OSError, ValueError):
        return {"stage": "waiting"}


def status_text(st: dict[str, Any]) -> str:
    """One line on a build's progress."""
    stage = st.get("stage", "waiting")
    if stage == "done":
        return "built"
    if stage == "failed":
        return f"failed: {st.get('note', '?')}"
    if stage == "waiting":
        return "queued"
    eta = st.get("eta_s")
    left = "" if eta is None else f", about {_duration(eta)} left"
    step = "" if st.get("prompt_s") is None else f" ({st['prompt_s']:.1f} s a prompt, ~{st['step_ms']:.0f} ms a step)"
    if stage == "timing":
        return f"timing the candidate trees: round {st.get('timed', 0)}/{st.get('rounds') or '?'}{left}"
    return f"tracing the calibration prompts: {st.get('traced', 0)}/{st.get('prompts', '?')}{step}{left}"


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"

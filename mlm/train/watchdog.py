"""The job's watch over its ranks: one error per job, every rank stopped promptly when one
fails, hung ranks found, dumped and stopped, and SIGTERM/SIGUSR1 turned into a request to stop.

In a job of several processes each rank runs a daemon thread that polls one key of the job's
rendezvous store (the TCPStore of torch.distributed's env:// rendezvous, which the process group
is then built on; under torchrun, the agent's, which outlives restarts: each attempt uses keys
under its own prefix, `attempt_N`). The thread never
touches the process group, so a rank blocked in a collective still answers. The first event
written to the key wins, and every rank then ends the same way:

- **an error**: an exception that ends `mlm train` on a rank (`Watchdog.fail`). Rank 0 prints it
  once: its own error if it has one, else the first one with the rank that raised it (an
  `MlmError` is its one line; any other exception is printed with its traceback by the rank
  that raised it first). Every rank then exits with that error's code: 2 for bad input
  (`BAD_INPUT_EXIT_CODE`), 130 for Ctrl-C, 1 for anything else.
- **a hang**: the trainer calls `beat(phase)` around each step and each of its collective
  phases. A rank that has made no progress for `train.resilience.hang_timeout` seconds declares a hang;
  every rank writes its Python stacks (every thread), its phase and the distributed call its main
  thread waits in to RUN_DIR/hang/rank{N}.txt; rank 0 prints a one-screen summary naming the
  ranks not waiting with the others, and every rank exits with `HANG_EXIT_CODE`.

Rank 0 acknowledges an event once it has printed it; the other ranks wait for that (so that a
launcher which stops the job when its first process exits does not stop rank 0 before it has
spoken), then report that they are leaving, and rank 0 leaves last (under srun it hosts the
store). One process (no launcher) keeps the hang detection, without a store.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from rich.markup import escape

from mlm.console import console
from mlm.errors import MlmError
from mlm.fileio import atomic_write_text
from mlm.parallel.launch import detect

FAILED_EXIT_CODE = 1  # an exception on some rank (its traceback printed by that rank), or a lost peer
BAD_INPUT_EXIT_CODE = 2  # an MlmError: the configuration or an input is wrong; rerunning will not help
HANG_EXIT_CODE = 4  # no progress for train.resilience.hang_timeout: stacks in RUN_DIR/hang/; requeue may help
INTERRUPTED_EXIT_CODE = 130  # Ctrl-C

EVENT, ACK, LEFT, FINISHED, HANG = "mlm/stop", "mlm/stop/ack", "mlm/stop/left", "mlm/finished", "mlm/hang/"


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, MlmError):
        return BAD_INPUT_EXIT_CODE
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED_EXIT_CODE
    return FAILED_EXIT_CODE


def pg_timeout(hang_timeout: float) -> datetime.timedelta | None:
    """The process group's own timeout: with hang detection on, long enough that the watchdog
    always acts first (torch's defaults, 10 min for NCCL and 30 for gloo, otherwise)."""
    return datetime.timedelta(seconds=hang_timeout + 300) if hang_timeout > 0 else None


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → "0-2, 5, 7-8"."""
    parts, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def _short(filename: str) -> str:
    """A source path relative to the working directory or site-packages, for one-line reports."""
    for root in (os.getcwd() + os.sep, *(p + os.sep for p in sys.path if p.endswith("-packages"))):
        if filename.startswith(root):
            return filename[len(root) :]
    return filename


_WAIT_LINE = re.compile(r"\.wait\(|\bbarrier\(|\.synchronize\(")


def main_thread_position() -> tuple[bool, str]:
    """Whether the main thread waits in a distributed call, and where (`stack_position`)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "the main thread has ended"
    return stack_position(traceback.extract_stack(frame))


def stack_position(stack: traceback.StackSummary) -> tuple[bool, str]:
    """Whether `stack` (outermost call first) waits in a distributed call, and where: the
    innermost torch.distributed function and the line that called it, or a line that waits on a
    request (`work.wait()`, a barrier); otherwise its innermost line."""
    if not stack:
        return False, "no Python frame"
    in_dist = [i for i, f in enumerate(stack) if "/torch/distributed/" in f.filename.replace(os.sep, "/")]
    if in_dist:
        caller = stack[max(in_dist[0] - 1, 0)]
        return True, (
            f"torch.distributed {stack[in_dist[-1]].name}, called at "
            f"{_short(caller.filename)}:{caller.lineno} ({caller.name})"
        )
    here = stack[-1]
    at = f"{(here.line or '').strip()!r} at {_short(here.filename)}:{here.lineno} ({here.name})"
    return bool(_WAIT_LINE.search(here.line or "")), at


def thread_stacks() -> str:
    """Every thread's Python stack, innermost call last, as tracebacks print them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:")
        out.append("".join(traceback.format_stack(frame)).rstrip())
        out.append("")
    return "\n".join(out)


class Watchdog:
    """This rank's watch (see the module docstring). `store` is None in a one-process job."""

    def __init__(self, store, rank: int = 0, world_size: int = 1, poll_s: float = 1.0):
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.poll_s = poll_s
        self.stop_signal: int | None = None  # SIGTERM/SIGUSR1 seen (the trainer stops after its step)
        self.phase, self.step, self.last_beat = "setup", 0, time.monotonic()
        self.hang_timeout = 0.0
        self.run_dir: Path | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._claimed = False  # the end of this rank is being handled (by fail or by the thread)

    @classmethod
    def for_job(cls) -> Watchdog:
        """This process's watch, from the launcher's environment: the rendezvous store in a job of
        several processes (the process group is built on it: `store`), none in one process."""
        launch = detect()
        store = None
        if launch.world_size > 1:
            store, _, _ = next(dist.rendezvous("env://"))
            # torchrun's agent keeps its store across restarts: a restarted attempt must not read
            # the keys of the last one (gloo would dial the dead ranks' addresses)
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        watchdog = cls(store, launch.rank, launch.world_size)
        watchdog.start()
        return watchdog

    # ------------------------------------------------------------------ main thread

    def start(self) -> None:
        """Catch SIGTERM and SIGUSR1 (from the main thread only), and watch the store."""
        if threading.current_thread() is threading.main_thread():

            def request_stop(signum, frame):
                self.stop_signal = signum

            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, request_stop)
        self._start_thread()

    def _start_thread(self) -> None:
        if self._thread is None and (self.store is not None or self.hang_timeout > 0):
            self._closed = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._closed,), name="mlm-watchdog", daemon=True
            )
            self._thread.start()

    def _stop_thread(self) -> None:
        self._closed.set()
        self._thread = None

    def _claim(self) -> bool:
        """The right to end this rank, once: the main thread's failure or the watching thread."""
        with self._lock:
            first, self._claimed = not self._claimed, True
        return first

    def watch_hangs(self, run_dir: str | Path, hang_timeout: float) -> None:
        """From now on, declare a hang when no `beat` comes for `hang_timeout` seconds (0: never)."""
        self.run_dir, self.hang_timeout = Path(run_dir), float(hang_timeout)
        self.beat("start")
        self._start_thread()

    def unwatch_hangs(self) -> None:
        self.hang_timeout = 0.0
        if self.store is None:
            self._stop_thread()

    def beat(self, phase: str, step: int | None = None) -> None:
        """Progress: this rank enters `phase` (of `step`)."""
        self.phase = phase
        if step is not None:
            self.step = step
        self.last_beat = time.monotonic()

    def fail(self, exc: BaseException) -> NoReturn:
        """This rank's main thread ends with `exc`: record it for the job, print what is this
        rank's to print, wait for the others as the module docstring says, and exit."""
        if not self._claim():  # the watching thread is already ending this process
            threading.Event().wait()
        code = exit_code(exc)
        try:
            message = str(exc) if isinstance(exc, MlmError) else f"{type(exc).__name__}: {exc}"
            event = self._record({"what": "error", "rank": self.rank, "code": code, "message": message})
            code = event["code"]
            if event["what"] == "hang":  # declared first: this error is likely its echo (a peer gone)
                self._report_hang(event, exc)
                self._leave(event)
                return
            if not isinstance(exc, MlmError) and event["rank"] == self.rank:  # the first failure, not an echo
                traceback.print_exception(exc)
            if self.rank == 0 and isinstance(exc, MlmError):
                self._say(f"[bold red]error:[/] {escape(str(exc))}")
            elif self.rank == 0:
                self._say(self._error_line(event))
            self._leave(event)
        finally:  # whatever went wrong while telling the others, this rank ends
            self._exit(code)

    def finish(self) -> None:
        """The job ends normally on this rank: stop watching; rank 0 then waits (a minute at
        most) until every rank has stopped, so that none loses the store it hosts under srun."""
        self._stop_thread()
        if self.store is None:
            return
        self.store.add(FINISHED, 1)
        deadline = time.monotonic() + 60
        while (
            self.rank == 0 and self.store.add(FINISHED, 0) < self.world_size and time.monotonic() < deadline
        ):
            time.sleep(0.05)

    # ------------------------------------------------------------------ the thread

    def _run(self, closed: threading.Event) -> None:
        while not closed.wait(self.poll_s):
            try:
                event = self._poll()
            except Exception as e:  # the store is gone: rank 0 or the launcher died
                if closed.is_set() or not self._claim():
                    return
                try:
                    self._say(
                        f"[bold red]rank {self.rank}:[/] lost the job's rendezvous store ({escape(str(e))}); stopping"
                    )
                finally:  # a report that fails still ends the rank (fail() now waits for this thread)
                    self._exit(FAILED_EXIT_CODE)
            if event is not None and self.rank == 0 and event["code"] == BAD_INPUT_EXIT_CODE:
                # the same bad input usually fails every rank: a moment for rank 0's own error,
                # which fail() then prints as it is, without naming another rank
                closed.wait(2.0)
            if event is not None and not closed.is_set() and self._claim():
                try:
                    self._handle(event)
                finally:  # whatever went wrong while reporting, this rank ends
                    self._exit(event["code"])

    def _poll(self) -> dict | None:
        if self.store is not None and self.store.check([EVENT]):
            return json.loads(self.store.get(EVENT))
        stale = time.monotonic() - self.last_beat
        if self.hang_timeout > 0 and stale > self.hang_timeout:
            return self._record({"what": "hang", "rank": self.rank, "code": HANG_EXIT_CODE, "seconds": stale})
        return None

    def _handle(self, event: dict) -> None:
        if event["what"] == "hang":
            self._report_hang(event)
        elif self.rank == 0:
            self._say(self._error_line(event))
        self._leave(event)

    def _error_line(self, event: dict) -> str:
        if event["code"] == BAD_INPUT_EXIT_CODE:
            return f"[bold red]error:[/] rank {event['rank']}: {escape(event['message'])}"
        return (
            f"[bold red]error:[/] rank {event['rank']} failed ({escape(event['message'])}); every rank stops, "
            f"exit code {event['code']}"
        )

    # ------------------------------------------------------------------ the store

    def _record(self, event: dict) -> dict:
        """Write `event` unless another came first; the event that counts."""
        if self.store is None:
            return event
        return json.loads(self.store.compare_set(EVENT, "", json.dumps(event)))

    def _leave(self, event: dict) -> None:
        """Rank 0 acknowledges (it has printed) and waits for the others to report leaving; the
        others wait for the acknowledgement and report. Bounded waits: a dead peer never answers."""
        if self.store is None:
            return
        patience = 5 * self.poll_s + 5.0
        with contextlib.suppress(Exception):
            if self.rank == 0:
                self.store.set(ACK, "1")
                deadline = time.monotonic() + patience
                while self.store.add(LEFT, 0) < self.world_size - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                self.store.wait([ACK], datetime.timedelta(seconds=patience))
                self.store.add(LEFT, 1)

    def _exit(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _say(self, text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ hangs

    def _report_hang(self, event: dict, exc: BaseException | None = None) -> None:
        """This rank's dump and status; `exc`: the main thread's error (in `fail`), reported where
        it was raised (the main thread's own stack is then that of `fail`)."""
        if exc is None:
            waiting, where = main_thread_position()
        else:
            waiting, where = stack_position(traceback.extract_tb(exc.__traceback__))
            where += f", raised {type(exc).__name__}: {exc}"
        status = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "idle_s": round(time.monotonic() - self.last_beat, 1),
            "waiting": waiting,
            "where": where,
        }
        dump = self._dump(status)
        if self.store is not None:
            self.store.set(f"{HANG}{self.rank}", json.dumps(status))
        if self.rank == 0:
            self._say(
                hang_summary(event, self._statuses(status), dump.parent if dump else None, self.world_size)
            )

    def _dump(self, status: dict) -> Path | None:
        if self.run_dir is None:
            return None
        path = self.run_dir / "hang" / f"rank{self.rank}.txt"
        head = (
            f"mlm train: hang report of rank {status['rank']} of {self.world_size} "
            f"(host {status['host']}, pid {status['pid']})\n"
            f"step {status['step']}, phase {status['phase']}, {status['idle_s']} s since this rank's "
            f"last progress (train.resilience.hang_timeout={self.hang_timeout:g})\n"
            f"main thread: {'waiting in ' if status['waiting'] else 'not waiting: '}{status['where']}\n\n"
        )
        with contextlib.suppress(OSError):  # a full or read-only run dir must not stop the exit
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, head + thread_stacks())
            return path
        return None

    def _statuses(self, mine: dict) -> list[dict]:
        """Every rank's status that arrives within the grace period (rank 0)."""
        if self.store is None:
            return [mine]
        keys = [f"{HANG}{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + 5 * self.poll_s + 10.0
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]


def hang_summary(
    event: dict, statuses: list[dict], dump_dir: Path | None, world_size: int | None = None
) -> str:
    """Rank 0's one screen: who declared the hang, the ranks grouped by where their main thread
    is, and those not waiting with the others (the ranks not in a distributed call; if every
    rank waits, those in a place fewer ranks wait in)."""
    groups: dict[tuple[bool, str, str], list[int]] = {}
    for s in statuses:
        groups.setdefault((s["waiting"], s["phase"], s["where"]), []).append(s["rank"])
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    lines = [
        f"[bold red]hang:[/] no progress for {event['seconds']:.0f} s (train.resilience.hang_timeout) at step "
        f"{max((s['step'] for s in statuses), default=0)}, first seen on rank {event['rank']}"
        + (f"; every rank's stacks in {escape(str(dump_dir))}/rank<N>.txt" if dump_dir else "")
    ]
    for (waiting, phase, where), ranks in ordered[:10]:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
        lines.append(f"  {who}: {escape(phase)}, {'waiting in' if waiting else 'running'} {escape(where)}")
    if len(ordered) > 10:
        lines.append(f"  … and {len(ordered) - 10} more places")
    heard = {s["rank"] for s in statuses}
    n = world_size or max(heard, default=0) + 1
    silent = [r for r in range(n) if r not in heard]
    if silent:
        lines.append(f"  no report from rank(s) {rank_ranges(silent)}")
    running = sorted(r for (waiting, _, _), ranks in ordered if not waiting for r in ranks)
    if running:
        lines.append(f"not waiting with the others: rank(s) {rank_ranges(running)}")
    elif len(ordered) > 1:
        lines.append(
            f"waiting apart from the others: rank(s) {rank_ranges(sorted(r for _, rs in ordered[1:] for r in rs))}"
        )
    elif statuses:
        lines.append("every rank waits in the same place: look for a lost peer or the network")
    lines.append(f"exit code {HANG_EXIT_CODE}: `mlm slurm`'s script requeues the job")
    return "\n".join(lines)

"""Bounded probes of vendor software: importing a vendor's extension module, running its device-query command.

Backends probe lazily, the first time `glm5-hal info` or an `auto` op call asks about them, and a probe must
neither kill nor freeze that caller. Vendor software can: a module that calls sys.exit() at import, an import
that waits forever on a driver, an SMI command that hangs. So every probe here

- has a time bound (`GLM5_HAL_PROBE_TIMEOUT_S`, default 5 s for an import, 2 s for a command; device-query
  commands run concurrently, so all of them together cost one bound),
- catches every exception a vendor module raises, SystemExit and KeyboardInterrupt included,
- and says what happened: not installed / not found on PATH, timed out after N s, exited with code N, failed
  with X.

Nothing here runs at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ENV_TIMEOUT = "GLM5_HAL_PROBE_TIMEOUT_S"
IMPORT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 2.0


def import_timeout_s() -> float:
    """The bound on one vendor import: GLM5_HAL_PROBE_TIMEOUT_S if set (a positive number), else 5 s."""
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    try:
        return float(value) if value and float(value) > 0 else IMPORT_TIMEOUT_S
    except ValueError:
        return IMPORT_TIMEOUT_S


def command_timeout_s() -> float:
    """The bound on one device-query command: the import bound if GLM5_HAL_PROBE_TIMEOUT_S is set, else 2 s."""
    return import_timeout_s() if os.environ.get(ENV_TIMEOUT, "").strip() else COMMAND_TIMEOUT_S


# --------------------------------------------------------------------------------------- calls and imports
@dataclass(frozen=True)
class Outcome:
    """What a bounded call gave: its `value`, or why not (`error`: what it raised; `reason`: the whole sentence,
    empty on success)."""

    value: object = None
    reason: str = ""
    error: BaseException | None = None


class _Call:
    """One call running in a daemon thread, and its result once it ends."""

    def __init__(self, fn: Callable[[], object], name: str) -> None:
        self.fn = fn
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"glm5_hal probe: {name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # SystemExit / KeyboardInterrupt too: vendor code must not end the caller
            self.error = exc

    def outcome(self, what: str, timeout_s: float) -> Outcome | None:
        """The outcome after waiting up to timeout_s; None while it still runs."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return None
        if self.error is not None:
            return Outcome(None, f"{what} failed: {describe_exception(self.error)}", self.error)
        return Outcome(self.value)


def call_bounded(fn: Callable[[], object], what: str, timeout_s: float | None = None) -> Outcome:
    """fn() within `timeout_s` (default import_timeout_s()), in a daemon thread; never raises. `what` names it in
    the reason ("torch.mlu.is_available() timed out after 5s", "... failed: RuntimeError: ...")."""
    timeout_s = import_timeout_s() if timeout_s is None else timeout_s
    outcome = _Call(fn, what).outcome(what, timeout_s)
    return outcome if outcome is not None else Outcome(None, f"{what} timed out after {timeout_s:g}s")


_imports: dict[str, _Call] = {}
_imports_lock = threading.Lock()


def import_bounded(name: str, timeout_s: float | None = None) -> Outcome:
    """Import module `name` (a vendor extension) within `timeout_s` (default: import_timeout_s()); never raises.
    Outcome.value is the module.

    If the import does not finish in time the caller gets a "timed out" reason and the import goes on in the
    background (Python cannot stop a thread). A later call for the same module waits for that same import
    (again bounded) instead of starting a second one.
    """
    timeout_s = import_timeout_s() if timeout_s is None else timeout_s
    with _imports_lock:
        call = _imports.get(name)
        if call is None:
            if name in sys.modules:
                module = sys.modules[name]
                if module is None:
                    return Outcome(None, f"{name} import is blocked (sys.modules[{name!r}] is None)")
                return Outcome(module)
            call = _imports[name] = _Call(lambda: importlib.import_module(name), f"import {name}")
    outcome = call.outcome(f"{name} import", timeout_s)
    if outcome is None:
        return Outcome(None, f"import {name} timed out after {timeout_s:g}s (it goes on in the background)")
    with _imports_lock:
        _imports.pop(name, None)  # ended: a later call finds it in sys.modules, or imports afresh after a failure
    return outcome


def describe_exception(exc: BaseException) -> str:
    """`TypeName: first line of the message` (`SystemExit: 3` for sys.exit(3))."""
    message = str(exc).strip()
    first_line = message.splitlines()[0] if message else ""
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__


def is_installed(name: str) -> tuple[bool, str]:
    """(whether module `name` can be found without importing it, why not). Never raises."""
    try:
        return importlib.util.find_spec(name) is not None, f"{name} is not installed"
    except BaseException as exc:  # a broken finder or a half-installed package
        return False, f"looking for {name} raised {describe_exception(exc)}"


# ----------------------------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class CommandOutcome:
    """A device-query command's outcome: `ok` if it ran and exited 0; `reason` says what happened either way."""

    ok: bool
    reason: str


_command_outcomes: dict[tuple[str, str], CommandOutcome] = {}
_command_lock = threading.Lock()


def run_commands(commands: Iterable[str], timeout_s: float | None = None) -> dict[str, CommandOutcome]:
    """Run every command (no arguments) concurrently, each bounded by `timeout_s` (default command_timeout_s());
    -> {command: outcome}. A command's outcome is remembered for its resolved path, so probing again (another
    backend, a refreshed registry) costs nothing; a changed PATH resolves, and runs, afresh."""
    timeout_s = command_timeout_s() if timeout_s is None else timeout_s
    resolved = {command: shutil.which(command) for command in dict.fromkeys(commands)}
    outcomes = {c: CommandOutcome(False, f"{c} not found on PATH") for c, path in resolved.items() if path is None}
    with _command_lock:
        to_run = {c: p for c, p in resolved.items() if p is not None and (c, p) not in _command_outcomes}
        if to_run:
            with ThreadPoolExecutor(max_workers=len(to_run), thread_name_prefix="glm5_hal probe") as pool:
                done = dict(zip(to_run, pool.map(lambda c: _run_command(c, to_run[c], timeout_s), to_run)))
            _command_outcomes.update({(c, to_run[c]): outcome for c, outcome in done.items()})
        outcomes.update({c: _command_outcomes[(c, p)] for c, p in resolved.items() if p is not None})
    return outcomes


def _run_command(command: str, path: str, timeout_s: float) -> CommandOutcome:
    try:
        # Its own session, so that a timeout kills whatever the command started too (a shell script's children).
        process = subprocess.Popen(
            [path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        return CommandOutcome(False, f"{command} found on PATH but could not run: {describe_exception(exc)}")
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            process.kill()
        process.wait()
        return CommandOutcome(False, f"{command} found on PATH but timed out after {timeout_s:g}s")
    if code != 0:
        return CommandOutcome(False, f"{command} found on PATH but exited with code {code}")
    return CommandOutcome(True, f"{command} found on PATH and exited 0")

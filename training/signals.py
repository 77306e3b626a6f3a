"""Signals that ask a run to stop, handled alike wherever a run can be: preparing data, training,
evaluating, sampling.

SIGINT (Ctrl-C), SIGTERM (pre-emption), SIGHUP (a closed terminal, a dropped SSH session) and SIGUSR1
/ SIGUSR2 (which schedulers such as SLURM send before they pre-empt a job) all mean "stop": SIGUSR1
and SIGUSR2 are treated exactly like SIGTERM.

- While the training loop runs, ``StopRequest`` holds them: the first finishes the current step,
  saves a checkpoint and leaves; a second exits at once.
- Everywhere else (tokenizing, building the model, the final sample, the scripts), ``signals_raise``
  makes each of them raise ``StopSignal``, as Python does for SIGINT with KeyboardInterrupt, so
  ``finally`` blocks run (temporary files are removed, locks released) and the process ends with one
  line and status 128 + the signal number (training/exits.py).

Temporary files being written are registered with ``temporary``; an exit at once removes them first.
"""
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Optional, Set

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
RAISED = tuple(s for s in STOP_SIGNALS if s != signal.SIGINT)  # SIGINT raises KeyboardInterrupt already

_temporaries: Set[Path] = set()


class StopSignal(BaseException):
    """A stop signal arrived outside the training loop. A BaseException, like KeyboardInterrupt, so that
    ``except Exception`` blocks do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum, frame) -> None:
    raise StopSignal(signum)


@contextlib.contextmanager
def signals_raise():
    """Within it, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 raise StopSignal (SIGINT raises KeyboardInterrupt)."""
    previous = {sig: signal.signal(sig, _raise_stop) for sig in RAISED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def temporary(path: Path):
    """``path`` (a file or a folder) is being written: an exit at once (a second signal) removes it."""
    _temporaries.add(Path(path))
    try:
        yield
    finally:
        _temporaries.discard(Path(path))


def remove_temporaries() -> None:
    for path in list(_temporaries):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class StopRequest:
    """Holds the stop signals (STOP_SIGNALS) while the loop runs.

    The first signal only sets ``signum``; the loop checks it at each step boundary (and before each
    evaluation batch, so a long evaluation does not outlast a scheduler's grace period), saves a
    checkpoint and leaves. A second signal removes the temporary files being written and exits at
    once with status 128 + signal number, through ``os._exit``: raising SystemExit instead can land
    inside ``torch.save`` of that checkpoint, whose zip writer then fails while closing and replaces
    the exit with a RuntimeError. Checkpoints are written to a temporary file and renamed, so the
    last complete one stays.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now without saving", file=sys.stderr, flush=True)
            remove_temporaries()
            os._exit(128 + signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

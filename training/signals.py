"""Pre-emption, Ctrl-C and hang-up: finish the current step, save a checkpoint, exit; a second signal exits now."""
import os
import signal
import sys
from typing import Optional


class StopRequest:
    """Catches SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) while the loop runs.

    The first signal only sets ``signum``; the loop checks it at each step boundary (and before each
    evaluation batch, so a long evaluation does not outlast a scheduler's grace period), saves a
    checkpoint and leaves. A second signal exits at once with status 128 + signal number, through
    ``os._exit``: raising SystemExit instead can land inside ``torch.save`` of that checkpoint,
    whose zip writer then fails while closing and replaces the exit with a RuntimeError. Whatever
    was being written is abandoned; checkpoints are written to a temporary file and renamed, so
    the last complete one stays.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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
            os._exit(128 + signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

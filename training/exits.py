"""How a process of ours ends: one policy for train.py and every script.

Whatever reaches the top ends the process with one line on stderr:
- a stop signal (training/signals.py): what was kept, status 128 + the signal number;
- a UserError: ``error: <message>``, status 2;
- running out of memory: the advice of training/errors.py, status 2;
- anything else (Hydra's and OmegaConf's own errors, a file the system refuses, a bug): ``error:`` and
  the error in one line, status 2. ``NANOFLASH_TRACEBACK=1`` (or Hydra's ``HYDRA_FULL_ERROR=1``)
  shows the traceback of such an error instead.
"""
import argparse
import contextlib
import os
import signal
import sys

from errors import UserError, first_line
from training.errors import Interrupted, OutOfMemory, memory_exhausted
from training.signals import StopSignal, signals_raise

# Read before exit_on_error sets HYDRA_FULL_ERROR for Hydra's sake: the user's own wish.
SHOW_TRACEBACK = os.environ.get("NANOFLASH_TRACEBACK") == "1" or os.environ.get("HYDRA_FULL_ERROR") == "1"


def fail(message: str) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown or malformed option, a missing argument) are one line,
    ``error: <prog>: <message> (<prog> --help lists the options)``, status 2, as every other error of
    ours, instead of argparse's usage block and line. The scripts build their parsers with it."""

    def error(self, message: str):
        fail(f"{self.prog}: {message} ({self.prog} --help lists the options)")


def one_line(text: str, width: int = 600) -> str:
    """``text`` with its lines joined (Hydra's messages span several), cut to ``width`` characters."""
    joined = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    return joined if len(joined) <= width else joined[:width - 3] + "..."


STOPPED_OUTSIDE_THE_STEPS = "interrupted outside the training steps; checkpoints written so far are kept"


@contextlib.contextmanager
def exit_on_error(stopped: str = STOPPED_OUTSIDE_THE_STEPS):
    """Run the body under the policy above; stop signals raise inside it (training/signals.py), and
    end the process with "<SIGNAL>: ``stopped``".

    Hydra is told to raise its errors (HYDRA_FULL_ERROR=1) rather than print them over several lines
    with status 1, so that they reach this policy too.
    """
    hydra_full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with signals_raise():
            yield
    except SystemExit:
        raise
    except BaseException as err:  # noqa: B036 -- every way out of the process goes through here
        signum = signal_of(err)
        if SHOW_TRACEBACK and signum is None and not isinstance(err, UserError):
            raise
        end(err, signum, stopped)
    finally:
        if hydra_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = hydra_full_error


def signal_of(err: BaseException):
    """The stop signal behind ``err`` (anywhere in its chain: a library may replace the exception it
    was in), or None."""
    while err is not None:
        if isinstance(err, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(err, (StopSignal, Interrupted)):
            return err.signum
        err = err.__cause__ or err.__context__
    return None


def end(err: BaseException, signum, stopped: str) -> None:
    """Print ``err`` as one line and exit with its status."""
    if isinstance(err, Interrupted):
        print(str(err), file=sys.stderr)
        sys.exit(128 + err.signum)
    if signum is not None:
        print(f"{signal.Signals(signum).name}: {stopped}", file=sys.stderr)
        sys.exit(128 + signum)
    if isinstance(err, UserError):
        fail(str(err))
    memory = memory_exhausted(err)
    if memory:
        fail(str(OutOfMemory(memory=memory, err=err)))
    if isinstance(err, OSError) and err.filename is not None:
        fail(f"{err.filename}: {err.strerror or first_line(err)}")
    if is_config_error(err):
        fail(str(err))
    fail(f"{type(err).__name__}: {str(err) or 'no message'} (unexpected: NANOFLASH_TRACEBACK=1 shows where it comes "
         "from; please report it)")


def is_config_error(err: BaseException) -> bool:
    """Hydra's and OmegaConf's errors: about the command line or the config files, said in their own words."""
    return type(err).__module__.split(".")[0] in ("hydra", "omegaconf")

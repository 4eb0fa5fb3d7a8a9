"""SIGINT and SIGTERM for a worker that runs one job after another: between two jobs a
signal is kept and stops the worker at its next safe point; one that reaches a job near
its end is kept for after it; one kept before a job stops that job before it sends; a
second one goes to the handler there was before."""

from __future__ import annotations

import os
import signal
import time

import pytest

from llm_annotator.errors import RunInterruptedError
from llm_annotator.jobs.loop.interrupt import Interrupt, between_jobs, handling_signals


def test_a_signal_between_jobs_ends_a_pause_at_once_and_stops_at_the_next_check() -> None:
    with between_jobs() as between:
        between.check()  # nothing yet
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(RunInterruptedError, match="stopped by SIGTERM between two jobs"):
            between.pause(30.0)
        assert time.monotonic() - started < 5.0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back as it was


def test_a_signal_a_job_got_is_kept_for_after_it_and_one_kept_before_stops_the_next() -> None:
    """A job whose handlers are inside the worker's: a signal it gets is noted outside
    too (the job may end without acting on it); a job begun after it is told at once."""
    with between_jobs() as between:
        first = Interrupt(grace=1.0)
        with handling_signals(first):
            os.kill(os.getpid(), signal.SIGINT)
        assert first.signals == [] and first._early == [signal.SIGINT]  # told, not bound
        assert between.signum == signal.SIGINT
        second = Interrupt(grace=1.0)
        with handling_signals(second):
            assert second._early == [signal.SIGINT]  # stops before it sends anything
        with pytest.raises(RunInterruptedError, match="SIGINT"):
            between.check()


def test_a_second_signal_goes_to_the_handler_there_was_before() -> None:
    """SIGINT's own handler raises KeyboardInterrupt, which the command line turns into
    its message; the worker's handler is out of the way after it."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with between_jobs() as between:
        os.kill(os.getpid(), signal.SIGINT)
        assert between.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            _signalled(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _signalled(signum: int) -> None:
    """Send ``signum`` to this process and give its handler the next bytecodes."""
    os.kill(os.getpid(), signum)
    time.sleep(1.0)

"""One thread that owns an in-process vLLM engine and steps it for every caller.

vLLM's ``LLM`` is not safe to call from several threads at once, and its ``chat()``
returns only when the whole batch it was given is done. The driver here takes
conversations from any thread or event loop, adds each to the running engine as soon
as it arrives (``LLM.enqueue_chat``), and steps the engine, handing each answer to its
caller the moment it is finished. Requests of different calls therefore share the
engine's continuous batch, as requests to a server do.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine was closed, or died, before the request finished."""


@dataclass(slots=True)
class Job:
    """One conversation to generate: what ``LLM.enqueue_chat`` takes for it."""

    conversation: list[dict[str, Any]]
    params: Any
    chat: dict[str, Any]
    future: Future[Any] = field(default_factory=Future)
    request_id: str | None = None


_STOP = object()


class EngineDriver:
    """Feed and step one ``vllm.LLM`` from a thread of its own.

    Args:
        llm: The engine (``vllm.LLM``), built by the caller.
        name: A name for the thread and the log lines.
    """

    def __init__(self, llm: Any, name: str = "vllm-offline") -> None:
        self._llm = llm
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._running: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped working, or None while it works."""
        return self._failure

    @property
    def alive(self) -> bool:
        """Whether requests can still be served."""
        return self._failure is None and not self._closed and self._thread.is_alive()

    def submit(self, job: Job) -> Future[Any]:
        """Queue ``job``; its future gets the engine's ``RequestOutput``, or an exception
        (the request's own, or :class:`EngineStoppedError`)."""
        job.future.add_done_callback(self._on_done)
        with self._lock:
            if self._closed_or_failed():
                _settle(job.future, error=self._stopped_error())
                return job.future
            self._inbox.put(job)
        return job.future

    def _on_done(self, future: Future[Any]) -> None:
        """A future cancelled by its caller (a stopped job) aborts its request."""
        if future.cancelled():
            self._inbox.put(("abort", future))

    def _closed_or_failed(self) -> bool:
        return self._closed or self._failure is not None

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still running end with EngineStoppedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join(timeout)

    def _stopped_error(self) -> EngineStoppedError:
        if self._failure is not None:
            return EngineStoppedError(f"the in-process vLLM engine failed: {self._failure!r}")
        return EngineStoppedError("the in-process vLLM engine is closed")

    def _run(self) -> None:
        engine = self._llm.llm_engine
        try:
            while True:
                if not self._take(block=not engine.has_unfinished_requests()):
                    return
                if engine.has_unfinished_requests():
                    self._step(engine)
                elif self._running:  # never left waiting for an answer that cannot come
                    self._lost()
        except BaseException as exc:  # the engine died: fail everything, accept nothing
            with self._lock:  # no submit may slip in between the check and the drain
                self._failure = exc
            log.error("offline_engine_failed", error=repr(exc))
        finally:
            with self._lock:
                self._closed = True
                self._fail_all()

    def _take(self, *, block: bool) -> bool:
        """Add what arrived to the engine; False once asked to stop."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if isinstance(item, tuple):
                self._abort(item[1])
            else:
                self._add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, job: Job) -> None:
        if job.future.done():  # cancelled before it reached the engine
            return
        try:
            (request_id,) = self._llm.enqueue_chat(
                [job.conversation], job.params, use_tqdm=False, **job.chat
            )
        except Exception as exc:  # this conversation's own fault: prompt too long, ...
            _settle(job.future, error=exc)
            return
        # Answers and aborts name a request by the id it was added under, before
        # the engine appended its random suffix to the one it returns.
        job.request_id = external_id(request_id)
        job.future.request_id = job.request_id  # type: ignore[attr-defined]  # for _abort
        self._running[job.request_id] = job

    def _abort(self, future: Future[Any]) -> None:
        request_id = getattr(future, "request_id", None)
        if request_id is not None and self._running.pop(request_id, None) is not None:
            self._llm.llm_engine.abort_request([request_id])

    def _lost(self) -> None:
        """The engine has nothing left, yet requests wait: end them as errors."""
        running, self._running = self._running, {}
        log.error("offline_requests_lost", requests=len(running))
        for job in running.values():
            _settle(
                job.future,
                error=EngineStoppedError("the in-process engine dropped the request"),
            )

    def _step(self, engine: Any) -> None:
        for output in engine.step():
            if not getattr(output, "finished", False):
                continue
            job = self._running.pop(output.request_id, None)
            if job is not None:
                _settle(job.future, result=output)

    def _fail_all(self) -> None:
        error = self._stopped_error()
        running, self._running = self._running, {}
        for job in running.values():
            _settle(job.future, error=error)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                _settle(item.future, error=error)


def external_id(request_id: str) -> str:
    """The id a request was added under, from the one the engine returned for it.

    ``LLM`` numbers its requests (``"7"``) and the engine returns them with ``-`` and
    a random suffix appended (``"7-1a2b3c4d"``, unless told not to); answers and aborts
    use the number.

    Raises:
        RuntimeError: The id has another form (a vLLM this code does not know): better
            to stop at once than to wait for answers that never match.

    Examples:
        >>> external_id("7-1a2b3c4d"), external_id("7")
        ('7', '7')
    """
    head = request_id.partition("-")[0]
    if not head.isdigit():
        raise RuntimeError(
            f"the engine returned a request id of an unknown form ({request_id!r}); this "
            "version of vLLM is not supported by the offline client"
        )
    return head


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's result, or its exception, unless it is done already."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except Exception:  # cancelled meanwhile (InvalidStateError)
        return


__all__ = ["EngineDriver", "EngineStoppedError", "Job", "external_id"]

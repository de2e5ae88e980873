"""Waiting on a vLLM server without waiting forever: requests on daemon threads, the server's ``/health`` probed
while they run; a server left paused resumed at start-up. Shared by the recipe's server engine
(`grpo.engines.server`) and TRL's server mode (`merge.trl`).

A front end shutting down (SIGTERM) refuses new connections while it keeps the open ones waiting, and a stuck
server does not answer at all: an HTTP read alone would wait indefinitely.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

HEALTH_PROBE_S = 5.0  # while waiting on the server: the wait for one /health answer, and the time between probes


def start_in_daemon_threads(calls: list[Callable[[], object]], max_workers: int) -> list[Future]:
    """Start ``calls`` on at most ``max_workers`` threads; their futures, in order. Daemon threads: a call stuck on
    a server that went away never keeps the process from exiting (a ThreadPoolExecutor's threads are joined at exit,
    and an HTTP read of a server whose front end keeps its connections open never returns)."""
    futures = [Future() for _ in calls]
    work = collections.deque(zip(futures, calls))

    def worker():
        while work:
            try:
                future, call = work.popleft()
            except IndexError:  # another worker took the last call
                return
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread through the future
                future.set_exception(error)

    for _ in range(min(max_workers, len(calls))):
        threading.Thread(target=worker, daemon=True).start()
    return futures


class RequestThreads:
    """Daemon threads that run submitted calls, at most ``max_workers`` at a time, the rest queued: a client's
    requests in flight bounded by its connection pool (urllib3 discards, with a "Connection pool is full" warning,
    each connection beyond its pool's size), on threads started as needed and kept for the next calls."""

    def __init__(self, max_workers: int):
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be at least 1")
        self.max_workers = max_workers
        self.threads = 0  # started so far (they wait for the next call, never exit: daemon threads)
        self._busy = 0  # calls submitted and not finished
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], object]) -> Future:
        future = Future()
        self._work.put((future, call))
        with self._lock:
            self._busy += 1
            if self.threads < min(self._busy, self.max_workers):  # an idle thread takes a call waiting, if any
                self.threads += 1
                threading.Thread(target=self._worker, daemon=True).start()
        return future

    def _worker(self) -> None:
        while True:
            future, call = self._work.get()
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread through the future
                future.set_exception(error)
            with self._lock:
                self._busy -= 1


def health_problem(url: str) -> str | None:
    """None while the server's /health answers 200 within `HEALTH_PROBE_S`; else what went wrong (a dead engine
    core answers 503, a front end shutting down refuses the connection, a stuck one does not answer)."""
    import requests

    try:
        status = requests.get(f"{url}/health", timeout=HEALTH_PROBE_S).status_code
    except requests.RequestException as error:
        return f"/health: {type(error).__name__}"
    return None if status == 200 else f"/health answers {status}"


class HealthWatch:
    """One /health probe of a server for every wait on it: while any wait is on, a daemon thread probes it every
    `HEALTH_PROBE_S`; each wait reads for how long it has failed. Hundreds of episodes waiting on their turns thus
    send one probe every few seconds, not one each (`health_watch`: one per URL, per process)."""

    def __init__(self, url: str):
        self.url = url
        self.waits = 0
        self.probing = False
        self.problem: str | None = None
        self.failing_since: float | None = None  # time.monotonic() of the first failed probe since the last good one
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watching(self):
        with self._lock:
            self.waits += 1
            if not self.probing:
                self.probing = True
                threading.Thread(target=self._probe, daemon=True).start()
        try:
            yield self
        finally:
            with self._lock:
                self.waits -= 1

    def failing(self) -> tuple[str, float] | None:
        """(what went wrong, seconds since it began) while the server fails its probes, else None."""
        with self._lock:
            if self.failing_since is None:
                return None
            return self.problem, time.monotonic() - self.failing_since

    def _probe(self) -> None:
        while True:
            time.sleep(HEALTH_PROBE_S)
            with self._lock:
                if not self.waits:  # nobody waits: the next wait starts afresh
                    self.probing, self.problem, self.failing_since = False, None, None
                    return
            problem = health_problem(self.url)
            with self._lock:
                self.problem = problem
                if problem is None:
                    self.failing_since = None
                elif self.failing_since is None:
                    self.failing_since = time.monotonic()


_health_watches: dict[str, HealthWatch] = {}
_health_watches_lock = threading.Lock()


def health_watch(url: str) -> HealthWatch:
    """This process's `HealthWatch` of the server at ``url``."""
    with _health_watches_lock:
        return _health_watches.setdefault(url, HealthWatch(url))


def results_watching_health(
    futures: list[Future], url: str, server_timeout: float, gone: Callable[[str, float], Exception]
) -> list:
    """The futures' results, in order, once all are done; a failed call raises its error at once. Meanwhile the
    server's health is probed (`health_watch`): failing for ``server_timeout`` seconds raises ``gone(problem,
    seconds)``."""
    pending = set(futures)
    with health_watch(url).watching() as watch:
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=HEALTH_PROBE_S, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            for future in done:
                future.result()
            failing = watch.failing() if pending else None
            if failing is not None and failing[1] >= server_timeout:
                raise gone(*failing)
    return [future.result() for future in futures]


def resume_if_paused(url: str) -> bool:
    """Resume a server that a trainer left paused; whether it was. A trainer stopped while it held the pause of a
    weight update (the merge; with ``pause_whole_update`` the whole update) leaves it paused, and a paused server
    queues every request, the next run's first ones included, until someone resumes it. Safe: the merge happens at
    ``/finish_weight_update`` alone, so the server holds its last complete weight version (the next sync replaces
    it). A server without vLLM's RL routes (404) is not paused."""
    import requests

    reply = requests.get(f"{url}/is_paused", timeout=30)
    if reply.status_code != 200 or not reply.json().get("is_paused"):
        return False
    requests.post(f"{url}/resume", timeout=30).raise_for_status()
    return True


def connection_failure(error: Exception) -> str:
    """A requests ConnectionError in a few words: what the connection met."""
    text = str(error)
    for words in ("Connection refused", "Connection reset by peer", "Remote end closed connection"):
        if words in text:
            return f"ConnectionError: {words.lower()}"
    return f"ConnectionError: {' '.join(text.split())[-120:]}"

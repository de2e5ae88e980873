"""Waiting on a vLLM server without waiting forever: requests on daemon threads, the server's ``/health`` probed
while they run; a server left paused resumed at start-up. Shared by the recipe's server engine
(`grpo.engines.server`) and TRL's server mode (`merge.trl`).

A front end shutting down (SIGTERM) refuses new connections while it keeps the open ones waiting, and a stuck
server does not answer at all: an HTTP read alone would wait indefinitely.
"""

from __future__ import annotations

import collections
import concurrent.futures
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


def health_problem(url: str) -> str | None:
    """None while the server's /health answers 200 within `HEALTH_PROBE_S`; else what went wrong (a dead engine
    core answers 503, a front end shutting down refuses the connection, a stuck one does not answer)."""
    import requests

    try:
        status = requests.get(f"{url}/health", timeout=HEALTH_PROBE_S).status_code
    except requests.RequestException as error:
        return f"/health: {type(error).__name__}"
    return None if status == 200 else f"/health answers {status}"


def results_watching_health(
    futures: list[Future], url: str, server_timeout: float, gone: Callable[[str, float], Exception]
) -> list:
    """The futures' results, in order, once all are done; a failed call raises its error at once. Meanwhile the
    server's health is probed: failing for ``server_timeout`` seconds raises ``gone(problem, seconds)``."""
    pending, unhealthy_since = set(futures), None
    while pending:
        done, pending = concurrent.futures.wait(
            pending, timeout=HEALTH_PROBE_S, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        for future in done:
            future.result()
        if not pending:
            break
        problem = health_problem(url)
        if problem is None:
            unhealthy_since = None
        elif unhealthy_since is None:
            unhealthy_since = time.monotonic()
        elif time.monotonic() - unhealthy_since >= server_timeout:
            raise gone(problem, time.monotonic() - unhealthy_since)
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

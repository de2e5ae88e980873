"""A tool that misbehaves as libraries do (used by tests/test_reliability.py): it changes the working directory at
every call; until the run's first checkpoint is written it ends its call with ``SystemExit(3)`` (a library's
``sys.exit``) or ``KeyboardInterrupt``, after that it hangs. FAULTY_TOOL_RUN names the run's folder (absolute),
FAULTY_TOOL_ELSEWHERE the folder it moves to; a file ``hanging-<pid>`` beside the run's folder says it hangs."""

import itertools
import os
import threading
from pathlib import Path

_calls = itertools.count()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 12*34.
    """
    os.chdir(os.environ["FAULTY_TOOL_ELSEWHERE"])
    run = Path(os.environ["FAULTY_TOOL_RUN"])
    if not list(run.glob("checkpoint-*")):
        if next(_calls) % 2:
            raise KeyboardInterrupt
        raise SystemExit(3)
    (run.parent / f"hanging-{os.getpid()}").touch()
    threading.Event().wait()
    return "never"

"""How the recipe ends: on an error, one line on stderr instead of a traceback and an exit code that says which kind;
after a complete run, without the interpreter's slow teardown (`exit_finished`).

Standard library only: the recipe uses it before its slow imports, for a config it refuses within seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time


def exit_with_line(err: Exception, code: int, every_rank: bool = False) -> None:
    """Print ``error: <err>`` (rank 0 only, unless ``every_rank``) and exit with ``code``. Under ``accelerate
    launch`` / torchrun the line also goes to torchelastic's error file, so that the launcher's failure summary
    names it instead of "To enable traceback see ..." (the launcher still exits 1 with its own summary)."""
    line = f"error: {err}"
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        sys.stderr.write(line + "\n")  # one write: lines of ranks that stop at once do not interleave
        sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            with open(error_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
    sys.exit(code)


def exit_refused(err: Exception) -> None:
    """A bad input found before any work: one line, from one process, exit code 2."""
    exit_with_line(err, 2)


def exit_finished(code: int = 0) -> None:
    """Exit with ``code`` (0: a complete run; 128 + signal: stopped by one, after its checkpoint) without the
    interpreter's teardown of torch's, transformers' and vLLM's modules: 4-5 s per process on 2 CPU cores, after the
    run's last line. By now every file the run writes is closed, the engine is shut down and the process group
    destroyed; the atexit handlers (logging's flush among them) still run, and the streams are flushed, before
    ``os._exit`` (which leaves behind the daemon threads of tool calls still hanging)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""A child process's life tied to its parent's (`cellswarm up`, LocalSwarm, the tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

# Set by a parent that starts this process (`cellswarm up`, LocalSwarm) to its own pid:
# this process ends when that parent is gone, even by SIGKILL (it cannot stop its children
# then). A watch on the parent pid, not PR_SET_PDEATHSIG, which fires when the *thread*
# that forked exits (a restart from a short-lived thread would kill a healthy worker).
DIE_WITH_ENV = "CELLSWARM_DIE_WITH"
DIE_CHECK_S = 0.5


def die_with_parent() -> None:
    """If DIE_WITH_ENV names our parent, SIGTERM ourselves when it is gone (then SIGKILL
    10 s later, should the shutdown hang)."""
    want = os.environ.get(DIE_WITH_ENV, "")
    if not want.isdigit() or os.getppid() != int(want):
        return

    def watch() -> None:
        while os.getppid() == int(want):
            time.sleep(DIE_CHECK_S)
        with contextlib.suppress(OSError):  # its pipe may have died with it
            print(f"cellswarm: my parent (pid {want}) is gone: stopping", file=sys.stderr,
                  flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()

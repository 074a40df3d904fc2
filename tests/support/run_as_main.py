"""End a forked child as a fresh interpreter running the same ``__main__`` code would end.

Used by the test support servers that fork children instead of starting interpreters
(``preloaded_python.py``, ``ray_worker_zygote.py``). Standard library only.
"""

from __future__ import annotations

import os
import sys
import traceback


def exit_as_main(run) -> None:
    """Call ``run()``, then end this process with the status Python gives a script: 0; the code
    of a ``SystemExit`` (a non-integer one printed to stderr, status 1); or 1, with the traceback
    printed, for any other exception. The streams are flushed first; this never returns."""
    code = 0
    try:
        run()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the code's own failure, reported as a fresh interpreter would
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

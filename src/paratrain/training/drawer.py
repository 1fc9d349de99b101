"""The drawer process (:func:`.report.start_drawer`): imports matplotlib, then answers each
JSON request line on stdin (``run_dir``, ``x_key``, ``title``) with ``{"path"}`` or
``{"error"}`` on stdout, until its input ends. SIGINT is the run's; other output goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever a library prints goes where this process's errors go
    sys.stdout = sys.stderr
    from . import report

    try:
        report._import_matplotlib()
    except Exception as e:  # noqa: BLE001 - met again, and answered, at the request
        logging.getLogger(__name__).debug("importing matplotlib failed: %r", e)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            path = report._draw(req["run_dir"], str(req.get("x_key") or "step"), req.get("title"))
            answer = {"path": str(path)}
        except Exception as e:  # noqa: BLE001 - the run warns with it
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()

"""What libraries print goes to the log, even when one of them has pointed a handler at the redirected stream."""

from __future__ import annotations

import logging
import sys

from pipelines import logs


def test_a_handler_on_the_redirected_stderr_does_not_recurse(capfd):
    # e.g. a library that calls logging.basicConfig() while its output is redirected, in a program that set up no
    # logging: its root handler writes to the writer, which logs to the root: without a guard, RecursionError.
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        with logs.library_output("test"):
            root.addHandler(logging.StreamHandler(sys.stderr))
            logging.getLogger("lib.test").setLevel(logging.INFO)
            print("banner line")
    finally:
        root.handlers[:] = before
    assert "banner line" in capfd.readouterr().err

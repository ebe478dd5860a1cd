"""What libraries print goes to the log, even when one of them has pointed a handler at the redirected stream."""

from __future__ import annotations

import logging
import sys

from pipelines import logs


def test_a_handler_on_the_redirected_stderr_does_not_recurse(capfd, caplog):
    # e.g. a library that calls logging.basicConfig() while its output is redirected, in a program that set up no
    # logging: its root handler writes to the writer, which logs to the root: without a guard, RecursionError.
    root, lib = logging.getLogger(), logging.getLogger("lib.test")
    before, level = list(root.handlers), lib.level
    caplog.set_level(logging.INFO, logger="lib.test")
    try:
        with logs.library_output("test"):
            handler = logging.StreamHandler(sys.stderr)
            root.addHandler(handler)
            print("banner line")
    finally:
        root.handlers[:] = before
        handler.close()
        lib.setLevel(level)
    assert [r.getMessage() for r in caplog.records if r.name == "lib.test"] == ["banner line"]  # still logged
    assert "banner line" in capfd.readouterr().err  # and the stray handler's copy went to the real stderr


def test_printed_lines_go_to_the_log_not_the_console(capfd, caplog):
    caplog.set_level(logging.INFO, logger="lib.quiet")
    with logs.library_output("quiet"):
        print("progress 1/2\rprogress 2/2")
        sys.stderr.write("no newline at the end")
    assert [r.getMessage() for r in caplog.records if r.name == "lib.quiet"] == [
        "progress 1/2", "progress 2/2", "no newline at the end"]
    assert "progress" not in capfd.readouterr().out

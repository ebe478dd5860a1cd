"""What libraries print goes to the log, even when one of them has pointed a handler at the redirected stream."""

from __future__ import annotations

import logging
import sys
import threading

from pipelines.core import logs


def test_a_handler_on_the_redirected_stderr_neither_recurses_nor_outlives_the_block(capfd, caplog):
    # e.g. a library that calls logging.basicConfig() while its output is redirected, in a program that set up no
    # logging: its root handler writes to the writer, which logs to the root: without a guard, RecursionError.
    root = logging.getLogger()
    before = list(root.handlers)
    caplog.set_level(logging.INFO, logger="lib.test")
    try:
        with logs.library_output("test"):
            root.addHandler(logging.StreamHandler(sys.stderr))
            print("banner line")
        after = list(root.handlers)
    finally:
        root.handlers[:] = before
    assert [r.getMessage() for r in caplog.records if r.name == "lib.test"] == ["banner line"]  # still logged
    assert "banner line" in capfd.readouterr().err  # and the stray handler's copy went to the real stderr
    assert after == before  # the stray handler is gone: later log lines are not copied into a dead writer


def test_another_threads_output_still_reaches_the_log_while_one_thread_logs(caplog):
    caplog.set_level(logging.INFO, logger="lib.threads")
    workers = []

    class SlowHandler(logging.Handler):  # the main thread is inside its logger call while another thread prints
        def emit(self, record):
            if record.getMessage() == "main line":
                printed = threading.Event()
                workers.append(threading.Thread(target=lambda: (print("worker line"), printed.set())))
                workers[0].start()
                printed.wait(1.0)  # a guard shared by all threads would send the worker's line to the console now

    handler = SlowHandler()
    logging.getLogger("lib.threads").addHandler(handler)
    try:
        with logs.library_output("threads"):
            print("main line")
            workers[0].join(10)
    finally:
        logging.getLogger("lib.threads").removeHandler(handler)
    assert sorted(r.getMessage() for r in caplog.records if r.name == "lib.threads") == ["main line", "worker line"]


def test_printed_lines_go_to_the_log_not_the_console(capfd, caplog):
    caplog.set_level(logging.INFO, logger="lib.quiet")
    with logs.library_output("quiet"):
        print("progress 1/2\rprogress 2/2")
        sys.stderr.write("no newline at the end")
    assert [r.getMessage() for r in caplog.records if r.name == "lib.quiet"] == [
        "progress 1/2", "progress 2/2", "no newline at the end"]
    assert "progress" not in capfd.readouterr().out

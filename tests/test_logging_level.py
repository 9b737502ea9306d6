"""--logging-level: parsed, applied at start-up; operator messages reach logging (and the OTel log bridge) once."""
import logging
from types import SimpleNamespace

import pytest

from megatron.core.telemetry.logging_bridge import OtelLogHandler
from megatron.training import initialize, training_log
from megatron.training.arguments import parse_args
from megatron.training.config import DistributedInitConfig, LoggerConfig
from pretrain_utils import LOG_LINE, console_objects, run_pretrain


@pytest.mark.parametrize("text,level", [("20", 20), ("INFO", logging.INFO), ("debug", logging.DEBUG),
                                        ("warn", logging.WARNING), ("0", 0), ("15", 15)])
def test_flag_accepts_numbers_and_level_names(text, level):
    assert parse_args(args=["--logging-level", text]).logging_level == level


def test_bad_level_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=["--logging-level", "loud"])
    assert "argument --logging-level: 'loud' is neither a number nor a logging level name" in capsys.readouterr().err


class _Collect(OtelLogHandler):
    """The OpenTelemetry log bridge's handler, collecting messages instead of exporting them."""

    def __init__(self):
        super().__init__(logger_provider=None)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def bare_logging():
    """Root and megatron loggers with Python's default levels, restored after.

    pytest attaches its capture handler to the root logger when the test body starts, so each
    test removes the root handlers itself (``root.handlers[:] = []``) before setup_logging.
    """
    root, framework = logging.getLogger(), logging.getLogger("megatron")
    saved = (root.level, framework.level)
    root.setLevel(logging.WARNING)
    framework.setLevel(logging.NOTSET)
    yield root, framework
    if initialize._CONSOLE_HANDLER is not None:
        root.removeHandler(initialize._CONSOLE_HANDLER)
        initialize._CONSOLE_HANDLER = None
    root.setLevel(saved[0])
    framework.setLevel(saved[1])


def _args(level=None, rank=1):
    """setup_logging's two slices: the LoggerConfig and the DistributedInitConfig."""
    return LoggerConfig(logging_level=level), DistributedInitConfig(rank=rank)


def test_level_applied_to_root_and_megatron_and_printed_once(bare_logging, capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    root, framework = bare_logging
    root.handlers[:] = []
    assert initialize.setup_logging(*_args(logging.DEBUG)) == logging.DEBUG
    assert root.level == framework.level == logging.DEBUG
    logging.getLogger("megatron.core.something").debug("a debug record")
    training_log.log_operator_message("an already printed line", printed_on_this_rank=True)
    err = capsys.readouterr().err
    assert err == "a debug record\n"  # the printed line is not printed a second time
    # Calling it again (a second run in one process) replaces the handler instead of adding one.
    initialize.setup_logging(*_args(logging.INFO))
    assert sum(isinstance(h, initialize._ConsoleHandler) for h in root.handlers) == 1
    logging.getLogger("megatron.x").debug("hidden")
    logging.getLogger("megatron.x").info("shown")
    assert capsys.readouterr().err == "shown\n"


def test_default_sends_info_to_logging_but_prints_only_warnings(bare_logging, capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    root, framework = bare_logging
    root.handlers[:] = []
    collect = _Collect()
    root.addHandler(collect)
    try:
        assert initialize.setup_logging(*_args(None)) == logging.INFO
        assert root.level == logging.WARNING  # the user's other libraries are left as they were
        logging.getLogger("megatron.x").info("info record")
        logging.getLogger("megatron.x").warning("warning record")
        logging.getLogger("some.library").info("library info")
    finally:
        root.removeHandler(collect)
    assert capsys.readouterr().err == "warning record\n"
    assert collect.messages == ["info record", "warning record"]


def test_environment_variable_and_its_errors(bare_logging, monkeypatch):
    root, framework = bare_logging
    root.handlers[:] = []
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "ERROR")
    assert initialize.setup_logging(*_args(None)) == logging.ERROR
    assert initialize.setup_logging(*_args(logging.INFO)) == logging.INFO  # the flag wins
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "chatty")
    with pytest.raises(ValueError, match="MEGATRON_LOGGING_LEVEL: 'chatty' is neither a number nor a logging level"):
        initialize.setup_logging(*_args(None))


def test_console_handler_only_when_nobody_else_handles(bare_logging, monkeypatch):
    root, _ = bare_logging
    root.handlers[:] = []
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    bridge = OtelLogHandler(logger_provider=None)
    root.addHandler(bridge)
    initialize.setup_logging(*_args(None))
    # The bridge alone would swallow warnings (Python's last-resort printer only runs with no handler).
    assert any(isinstance(h, initialize._ConsoleHandler) for h in root.handlers)
    root.removeHandler(bridge)
    users = logging.StreamHandler()
    root.addHandler(users)
    initialize.setup_logging(*_args(None))
    assert root.handlers == [users]


def test_operator_message_goes_out_on_printing_or_bridging_ranks(monkeypatch, caplog):
    monkeypatch.setattr(training_log, "get_telemetry", lambda: None)
    with caplog.at_level(logging.INFO, logger="megatron"):
        training_log.log_operator_message("printed here", printed_on_this_rank=True)
        training_log.log_operator_message("printed elsewhere", printed_on_this_rank=False)
    assert [r.getMessage() for r in caplog.records] == ["printed here"]
    assert getattr(caplog.records[0], training_log.CONSOLE_PRINTED) is True
    caplog.clear()
    monkeypatch.setattr(training_log, "get_telemetry", lambda: SimpleNamespace(logger_provider=object()))
    with caplog.at_level(logging.INFO, logger="megatron"):
        training_log.log_operator_message("printed elsewhere", printed_on_this_rank=False)
    assert [r.getMessage() for r in caplog.records] == ["printed elsewhere"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron"):  # --logging-level WARNING drops INFO summaries
        training_log.log_operator_message("an INFO summary", printed_on_this_rank=True)
    assert caplog.records == []


def _log_bodies(out):
    bodies = []
    for record in console_objects(out):
        if "severity_text" in record:
            bodies.append((record["body"], record["severity_text"], record["attributes"].get("logger.name")))
    return bodies


def _console_iteration_lines(out):
    return [line for line in out.splitlines() if LOG_LINE.match(line)]


@pytest.mark.parametrize("level_flags", [[], ["--logging-level", "DEBUG"]])
def test_unmodified_run_feeds_the_log_bridge_and_prints_each_line_once(shared_data, shakespeare_prefix, tmp_path,
                                                                       monkeypatch, level_flags):
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_LOGS_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_TRACES_ENABLED", "0")
    monkeypatch.setenv("MEGATRON_OTEL_METRICS_ENABLED", "0")
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    ckpt = tmp_path / "ckpt"
    out = run_pretrain(2, ["--micro-batch-size", "2", "--train-iters", "3", "--eval-interval", "2",
                           "--hidden-dropout", "0", "--attention-dropout", "0", "--save", str(ckpt),
                           "--save-interval", "3", *level_flags],
                       shared_data, shakespeare_prefix, tmp_path, stderr_too=True)
    bodies = _log_bodies(out)
    texts = [body for body, _, _ in bodies]
    # The exporting rank (the last) sends the iteration summaries, the evaluation and the checkpoint.
    summaries = [t for t in texts if "elapsed time per iteration" in t]
    assert [int(LOG_LINE.match(t).group(1)) for t in summaries] == [1, 2, 3]
    assert all(sev == "INFO" and name == "megatron.training.training_log"
               for body, sev, name in bodies if "elapsed time per iteration" in body)
    assert any(t.startswith("validation loss at iteration 2 | lm loss value:") for t in texts)
    assert any(t.startswith("successfully saved checkpoint from iteration       3 to ") for t in texts)
    # The console shows every iteration line exactly once (stdout and stderr together).
    console = _console_iteration_lines(out)
    assert [int(LOG_LINE.match(line).group(1)) for line in console] == [1, 2, 3]
    framework_info = "setting number of microbatches to constant 2"
    if level_flags:  # DEBUG: the framework's own INFO records are printed too, by rank 0 only
        assert "> setting logging level to DEBUG (10)" in out
        assert out.count(framework_info) == 1 + texts.count(framework_info)
    else:
        assert framework_info not in [line.strip() for line in out.splitlines()]

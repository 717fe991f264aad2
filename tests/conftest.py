import os

import pytest

import metal_emulator
from kvarn_mlx import config

# A tuning file measured on this machine (python -m kvarn_mlx.bench) must not change
# which path the tests take: no tuning file, here and in the commands tests start.
os.environ["KVARN_MLX_TUNING"] = ""

# Node ids of skipped tests: kernel tests that had no Metal device or emulator, and the rest.
SKIPPED = {"kernel": set(), "other": set()}


def pytest_addoption(parser):
    parser.addoption(
        "--fail-on-skip",
        action="store_true",
        help=(
            "fail the run if any test skips, except kernel tests on a machine with neither a Metal "
            "device nor the MSL emulator (.ci/run sets this on Linux)"
        ),
    )


def pytest_configure(config):
    try:
        metal_emulator.find()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        kind = "kernel" if metal_emulator.SKIP_REASON in str(report.longrepr) else "other"
        SKIPPED[kind].add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("fail_on_skip") and exitstatus == 0 and SKIPPED["other"]:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kernel, other = SKIPPED["kernel"], SKIPPED["other"]
    if kernel:
        terminalreporter.write_line(
            f"{len(kernel)} kernel tests did not run: {metal_emulator.SKIP_REASON}", yellow=True
        )
    if other and config.getoption("fail_on_skip"):
        # Everything .ci/run installs is what the tests need: such a skip is a missing
        # install step, not a passing test.
        terminalreporter.write_line(
            f"--fail-on-skip: {len(other)} skipped (reasons below): failing", red=True
        )


@pytest.fixture(autouse=True)
def no_default_tail(request, monkeypatch):
    """make_cache and the commands keep the newest config.DEFAULT_TAIL_TOKENS tokens in full
    precision unless told. The suite's sequences are short and most tests are about quantized
    tiles, so in this process a preset named without a tail gets none; tests marked
    default_tail, and commands the tests run as subprocesses, get the default."""
    if "default_tail" not in request.keywords:
        monkeypatch.setattr(config, "DEFAULT_TAIL_TOKENS", {})


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the embedded default model, SmolLM2-135M-Instruct
    in float32, converted once into $KVARN_MLX_HOME."""
    from kvarn_mlx import loader

    return loader.load()

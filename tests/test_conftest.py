"""The test suite's own hygiene (tests/conftest.py): a test that leaks an environment variable fails,
naming it, and the next test sees the environment restored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LEAKY = """
import os


def test_adds():
    os.environ["GRADACCUM_LEAK_ADDED"] = "1"


def test_changes():
    os.environ["GRADACCUM_PRESENT"] = "changed"


def test_removes():
    del os.environ["GRADACCUM_PRESENT"]


def test_monkeypatch_is_fine(monkeypatch):
    monkeypatch.setenv("GRADACCUM_LEAK_ADDED", "1")
    monkeypatch.delenv("GRADACCUM_PRESENT")


def test_the_environment_was_restored():
    assert "GRADACCUM_LEAK_ADDED" not in os.environ
    assert os.environ["GRADACCUM_PRESENT"] == "1"
"""


def test_a_test_that_leaks_an_environment_variable_fails_naming_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import _restore_environment  # noqa: F401\n")
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = {
        **os.environ,
        "GRADACCUM_PRESENT": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rE", "-p", "no:cacheprovider", "test_leaky.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "5 passed, 3 errors" in text, text  # a leak fails its test at teardown
    # pytest prints "ERROR at teardown of TEST" and then the message, one section per failed test
    sections = text.split("ERROR at teardown of ")[1:]
    failed = {section.split()[0]: " ".join(section.split()) for section in sections}
    assert sorted(failed) == ["test_adds", "test_changes", "test_removes"], text
    assert "(added ['GRADACCUM_LEAK_ADDED']); they were restored" in failed["test_adds"]
    assert "(changed ['GRADACCUM_PRESENT']); they were restored" in failed["test_changes"]
    assert "(removed ['GRADACCUM_PRESENT']); they were restored" in failed["test_removes"]

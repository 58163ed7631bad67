"""The workloads page's offline tokenizer recipe, run as written: its script trains a BPE
tokenizer on a local text file and writes an hf: folder beside a config, then the page's commands
verify and train on that folder (nothing downloaded)."""

from __future__ import annotations

import re
import runpy
import shlex
from importlib.resources import files
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from tests.docs.markdown import DOCS

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _section() -> str:
    text = (DOCS / "workloads.md").read_text(encoding="utf-8")
    return text.split("\n## A tokenizer of your own, offline\n", 1)[1].split("\n## ", 1)[0]


def _script() -> str:
    (script,) = re.findall(r'^```python title="make_model_folder.py"\n(.*?)^```', _section(), re.S | re.M)
    return script


def _commands() -> list[list[str]]:
    (block,) = re.findall(r"^```bash\n(.*?)^```", _section(), re.S | re.M)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_recipe_shows_a_script_and_the_commands_that_use_its_folder() -> None:
    commands = _commands()
    assert commands[0] == ["python", "make_model_folder.py"]
    assert [c[:2] for c in commands[1:]] == [["gradaccum", "verify"], ["gradaccum", "train"]]
    assert all("hf:my-model" in c for c in commands[1:])
    assert "from tokenizers import" in _script() and 'save_pretrained("my-model")' in _script()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = files("gradaccum.examples").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    (tmp_path / "corpus.txt").write_text(corpus, encoding="utf-8")  # the page's one-liner, in Python
    (tmp_path / "make_model_folder.py").write_text(_script(), encoding="utf-8")
    first, verify, train = _commands()
    runpy.run_path(str(tmp_path / first[1]), run_name="__main__")
    assert capsys.readouterr().out == "my-model: a 512-token BPE tokenizer and a 2-layer Llama config\n"
    assert sorted(p.name for p in (tmp_path / "my-model").iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert main(verify[1:]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out.splitlines(), out
    assert main(train[1:]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^completed: 20 boundaries, 20 updates applied, 0 skipped", out, re.M), out
    assert len(list((tmp_path / "runs").glob("train-*/checkpoints/step-*"))) == 1

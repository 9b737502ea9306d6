"""docs/flags.md's flags table (moved out of the README) is the one tools/flags_table.py generates from the training
parser (it cannot drift)."""
import argparse
import subprocess
import sys

import pytest

from megatron.training.arguments import add_megatron_arguments
from pretrain_utils import REPO

sys.path.insert(0, str(REPO / "tools"))
import flags_table  # noqa: E402


def test_flags_page_table_equals_the_generated_one():
    page = (REPO / "docs" / "flags.md").read_text(encoding="utf-8")
    assert flags_table.page_with_table(page, flags_table.flags_table()) == page, \
        "docs/flags.md's flags table is out of date: run python tools/flags_table.py --write"


def test_table_has_one_row_per_parser_flag_with_its_default():
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = [a.option_strings[0] for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    rows = flags_table.flags_table().splitlines()[2:]
    assert [row.split("|")[2].strip().split(",")[0].strip("` ") for row in rows] == options
    by_flag = {row.split("|")[2].strip().split(",")[0].strip("` "): row for row in rows}
    assert "| `1234` |" in by_flag["--seed"]
    assert "| off |" in by_flag["--bf16"]
    assert "Choices: LayerNorm, RMSNorm." in by_flag["--normalization"]


def test_check_mode_fails_on_a_stale_table(tmp_path, monkeypatch):
    stale = tmp_path / "flags.md"
    text = (REPO / "docs" / "flags.md").read_text(encoding="utf-8")
    stale.write_text(text.replace("| `1234` |", "| `4321` |"), encoding="utf-8")
    monkeypatch.setattr(flags_table, "PAGE", stale)
    assert flags_table.main(["--check"]) == 1
    assert flags_table.main(["--write"]) == 0
    assert stale.read_text(encoding="utf-8") == text
    with pytest.raises(ValueError, match="markers"):
        flags_table.page_with_table("no markers here", "table")


def test_command_line_check_passes_on_the_repository():
    result = subprocess.run([sys.executable, "tools/flags_table.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr

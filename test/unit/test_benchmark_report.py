"""benchmark/report.py: the README's benchmark table is what the committed result files say."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmark_report", os.path.join(ROOT, "benchmark", "report.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_table_equals_the_table_regenerated_from_the_result_files(report):
    assert report.main(["--check"]) == 0


def test_a_stale_table_is_caught(report, tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    row = report.table_lines()[2]
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace(row, row.replace("| Zen 4 |", "| Zen 5 |", 1)))
    assert report.main(["--check", "--readme", str(stale)]) == 1
    assert report.replace_table(stale.read_text(), report.table_lines()) == readme  # what a rerun writes


def test_every_row_names_a_kept_result_file_without_run_numbers(report):
    names = set(os.listdir(os.path.join(ROOT, "benchmark", "results")))
    for row in report.ROWS:
        assert f"{row.file}.json" in names
        assert row.file.rsplit("_", 1)[1] in report.CPU_NAMES

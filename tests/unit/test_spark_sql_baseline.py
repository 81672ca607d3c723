"""Spark's own WordCount, the baseline of ``benchmarks/wordcount.py``: its input files
and reference counts, and the check that fails the benchmark when its counts are not
``collections.Counter``'s. (The query itself runs in the benchmark, which checks every
run's counts; the unit suite starts no JVM.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.limits import (
    _check_counts,
    _write_files,
    wordcount_expected,
    wordcount_lines,
)


def test_expected_counts_are_the_engines_words() -> None:
    lines = wordcount_lines([b"A b  a\n\nB", b"c"])
    assert lines == ["A b  a", "", "B", "c"]
    assert wordcount_expected(lines) == {"a": 2, "b": 2, "c": 1}


def test_a_count_off_by_one_or_a_line_missed_fails_the_baseline() -> None:
    expected = {"a": 2, "b": 1}
    _check_counts({"a": 2, "b": 1}, expected, rows=2, lines=2)
    with pytest.raises(RuntimeError, match=r"1 words differ from Counter.*'b': 2 != 1"):
        _check_counts({"a": 2, "b": 2}, expected, rows=2, lines=2)
    with pytest.raises(RuntimeError, match=r"1 words differ.*'c': 1 != None"):
        _check_counts({"a": 2, "b": 1, "c": 1}, expected, rows=2, lines=2)
    with pytest.raises(RuntimeError, match="read 1 rows of 2 lines"):
        _check_counts({"a": 2, "b": 1}, expected, rows=1, lines=2)


def test_body_i_goes_to_file_i_mod_queues_a_line_each(tmp_path: Path) -> None:
    bodies = [f"b{i}x\nb{i}y".encode() for i in range(5)]
    directory = _write_files(tmp_path / "in", bodies, 3)
    files = sorted(directory.iterdir())
    assert [f.name for f in files] == ["part-00000.txt", "part-00001.txt", "part-00002.txt"]
    assert files[0].read_text() == "b0x\nb0y\nb3x\nb3y\n"
    assert files[2].read_text() == "b2x\nb2y\n"
    read = [line for f in files for line in f.read_text().splitlines()]
    assert sorted(read) == sorted(wordcount_lines(bodies))

"""benchmarks/kernel_ab.py's harness on the tiny model: this tree's build against itself."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import kernel_ab
from deploy import kernels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.needs_kernels
def test_a_build_against_itself_has_the_same_bits_for_every_row_count(tiny_gguf, capsys):
    assert kernel_ab.main(["--against", str(REPO), "--model", str(tiny_gguf), "--rows", "1,3", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("T=")]
    assert [ln.split(":")[0] for ln in lines] == ["T=1", "T=3"], out
    assert all("same bits" in ln and "B/A" in ln for ln in lines), out


def test_a_tree_without_a_build_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="no deploy/kernels/_qmatmul"):
        kernel_ab.load_build(tmp_path, "nothing")

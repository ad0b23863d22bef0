"""``python -m loadtest.bench_lora --quick``: the LoRA benchmark end to end on a tiny shape: a row per
way, each with positive speeds. No timing is
asserted (a shared 2-core host)."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_lora import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_quick_run_gives_a_row_per_way(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert main(["--quick", "--rank", "4", "--dtype", "float32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    cells = json.loads(out.read_text())["cells"]
    assert list(cells) == ["base", "base, adapters loaded", "four adapters mixed"]
    for way, rounds in cells.items():
        assert f"| {way} |" in table
        assert all(v > 0 for v in rounds[0].values())

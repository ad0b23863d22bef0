"""``python -m loadtest.bench_families --quick``: the per-family benchmark end to end on tiny shapes, one
mixture-of-experts family and one dense: both rows come out, Augur's greedy tokens equal ``generate``'s
and speculation's equal plain decoding's. No timing is asserted (a shared 2-core host)."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_families import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ["Qwen3MoeForCausalLM", "LlamaForCausalLM"]


def test_quick_run_gives_a_row_per_family_with_identical_tokens(tmp_path, capsys):
    out = tmp_path / "families.json"
    report = main(["--quick", "--families", *FAMILIES, "--json", str(out)])
    table = capsys.readouterr().out
    assert not report["skipped"]
    rows = {r["family"]: r for r in report["rows"]}
    assert list(rows) == FAMILIES
    for arch, row in rows.items():
        assert row["dtype"] == "float32"
        assert row["identical"], row["notes"]
        assert row["spec_identical"], row["notes"]
        line = next(line for line in table.splitlines() if line.startswith(f"| {arch} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-2:] == ["yes", "yes"], line
        assert all(r["hf_tokens"] == r["augur_tokens"] for r in row["rounds"])
    assert rows["Qwen3MoeForCausalLM"]["active_params"] < rows["Qwen3MoeForCausalLM"]["params"]
    assert rows["LlamaForCausalLM"]["active_params"] == rows["LlamaForCausalLM"]["params"]
    assert json.loads(out.read_text())["table"] in table

"""``python -m loadtest.bench_quant --quick``: the quantization benchmark end to end on a tiny shape:
a row per way, the memory each way should take (a quarter of float32's KV bytes a token under the FP8
cache, fewer weight bytes under int4 and FP8), the FP8 checkpoint it writes read back as FP8. No
timing is asserted (a shared 2-core host)."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_quant import WAYS, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_quick_run_gives_a_row_per_way_with_the_memory_each_takes(tmp_path, capsys):
    out = tmp_path / "quant.json"
    assert main(["--quick", "--dtype", "float32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    cells = {way: rounds[0] for way, rounds in json.loads(out.read_text())["cells"].items()}
    assert list(cells) == list(WAYS)
    for way in WAYS:
        assert f"| {way} |" in table
    plain = cells["plain"]
    assert cells["fp8 KV"]["kv_bytes_per_token"] * 4 == plain["kv_bytes_per_token"]
    assert cells["int4 kernel"]["weights_MiB"] < 0.75 * plain["weights_MiB"]  # (the embeddings stay float32)
    assert cells["fp8 W8A8"]["weights_MiB"] < 0.75 * plain["weights_MiB"]
    assert cells["fp8 checkpoint"]["weights_MiB"] == plain["weights_MiB"]  # served dequantized, as read
    assert all(v > 0 for row in cells.values() for v in row.values())
    peaks = json.loads(out.read_text())["load_peak"]  # (peak MiB, loaded tensors MiB), a process each
    assert list(peaks) == ["plain", "fp8 checkpoint", "int4 kernel", "fp8 W8A8", "fp8 checkpoint, --quantization fp8"]
    assert "load peak MiB" in table
    assert all(peak > 0 for peak, _ in peaks.values())
    assert peaks["int4 kernel"][1] < 0.75 * peaks["plain"][1] and peaks["fp8 W8A8"][1] < 0.75 * peaks["plain"][1]

"""The paired in-process A/B (``python -m loadtest.bench_ab``) end to end on the tiny model: every
method against plain decoding, a ratio per round and category, the medians and their geometric mean,
and each run drafting from stores of its own (a tenant per run)."""

from __future__ import annotations

import json
import math

from loadtest import bench_ab


def test_each_method_gets_a_paired_ratio_per_round_and_category(model_dirs, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    lines = [{"category": "code", "prompt": f"def f{i}(x):\n    return x + {i}\n"} for i in range(3)]
    lines += [{"category": "chat", "messages": [{"role": "user", "content": f"Say {i} twice."}]} for i in range(2)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tenants = []
    add = bench_ab.LLMEngine.add_request

    def spy(self, request_id, prompt, params, *a, **kw):
        tenants.append((request_id, params.tenant))
        return add(self, request_id, prompt, params, *a, **kw)

    monkeypatch.setattr(bench_ab.LLMEngine, "add_request", spy)
    out = tmp_path / "ab.json"
    argv = ["--model", str(model_dirs["LlamaForCausalLM"]), "--draft-model", "", "--methods", "ngram", "suffix",
            "--prompts", str(prompts), "--rounds", "3", "--max-tokens", "4", "--output", str(out)]  # fmt: skip
    assert bench_ab.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["rounds"] == 3 and r["concurrency"] == 1 and set(r["methods"]) == {"ngram", "suffix"}
    for m in r["methods"].values():
        assert set(m["by_category"]) == {"code", "chat"}
        assert all(len(v) == 3 and all(x > 0 for x in v) for v in m["rounds"].values())
        assert m["geometric_mean"] == math.exp(sum(math.log(v) for v in m["by_category"].values()) / 2)
    # three engines, each warmed (two requests) and then run once per round and category: fresh tenants
    runs = {t for _, t in tenants}
    assert len(tenants) == 3 * 2 + 3 * 3 * 2 and len(runs) == 3 + 3 * 3 * 2

"""``augur bench --suite``: the shipped prompt suite, and the bench run end to end against real servers
(the tiny demo pair): Augur started by the bench itself (speculative vs plain), and ``--url`` servers
in this process, one of which cannot do a category and one of which is not there at all."""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import shutil
import socket
import sys
from pathlib import Path

import httpx
import matplotlib.image
import pytest
from transformers import AutoTokenizer

from loadtest.prompts import load_prompts
from loadtest.report import counter_acceptance_length
from loadtest.suite import CATEGORIES, PER_CATEGORY, _problem, by_category, math_prompts, read_suite
from loadtest.suite_bench import _is_augur, parse_command, parse_url, run_keys
from server.app import ServerSettings, create_app
from server.cli import add_engine_args, build_parser, engine_argv, main
from servers import engine_factory, processes_mentioning, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


def rows_of(report: dict) -> dict[tuple[str, str, int], dict]:
    return {(r["label"], r["category"], r["concurrency"]): r for s in report["servers"] for r in s["rows"]}


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 100 and width > 100


# -- the suite ------------------------------------------------------------------------------------------
def test_suite_has_every_category_and_its_answers_are_in_its_prompts():
    groups = by_category(load_prompts("suite"))
    assert list(groups) == list(CATEGORIES)
    assert all(len(ps) == PER_CATEGORY for ps in groups.values())
    assert all(p.messages is not None for p in groups["chat"])
    assert any(len(p.messages) > 2 for p in groups["chat"])  # some conversations are multi-turn
    assert all(p.text is not None and p.messages is None for c in CATEGORIES if c != "chat" for p in groups[c])

    lines = read_suite()
    retrieval = [line for line in lines if line["category"] == "retrieval"]
    for line in retrieval:
        prompt, answer = line["prompt"], line["answer"]
        opening = prompt.rsplit("\n", 1)[-1]
        assert answer.startswith(opening) and len(opening) < len(answer)
        assert prompt.count(answer) == 1  # the whole answer is there to copy, and only once
        assert prompt.index(answer) < len(prompt) - len(opening)
    for line in (line for line in lines if line["category"] == "math"):
        assert line["prompt"].count("Let's think step by step.") == 2 and line["answer"].isdigit()
    for line in (line for line in lines if line["category"] == "summarization"):
        assert line["prompt"].startswith("Text:\n") and line["prompt"].endswith("Summary:")
    for line in (line for line in lines if line["category"] == "code"):
        assert line["prompt"].endswith("\n") and line["prompt"].startswith(("def ", "class "))


def test_math_problems_are_right_and_seeded():
    for seed in range(20):
        for kind in range(5):
            question, steps, answer = _problem(kind, random.Random(seed))
            equations = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", steps)
            assert equations, steps
            for a, op, b, result in equations:
                exact = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) / int(b)}[op]
                assert exact == int(result), steps
            assert int(equations[-1][3]) == answer > 0
            assert question.endswith("?")
    first = math_prompts(random.Random(3))
    assert first == math_prompts(random.Random(3)) and first != math_prompts(random.Random(4))
    assert all(line["prompt"].endswith("A: Let's think step by step.") for line in first)


def test_prompts_fit_the_tiny_demo_context(tiny_demo):
    """The tiny demo (512 positions, a 512-id vocabulary: many tokens per character) is the tightest
    context the suite runs on; every prompt leaves room for 32 output tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_demo / "target")
    positions = json.loads((tiny_demo / "target" / "config.json").read_text())["max_position_embeddings"]
    for p in load_prompts("suite"):
        if p.messages is not None:
            ids = tok.apply_chat_template(p.as_messages(), add_generation_prompt=True, tokenize=False)
            n = len(tok.encode(ids, add_special_tokens=False))
        else:
            n = len(tok.encode(p.text))
        assert n + 32 <= positions, (p.category, n)


# -- the command line ---------------------------------------------------------------------------------------
def engine_dests() -> list[str]:
    scratch = argparse.ArgumentParser(add_help=False)
    add_engine_args(scratch)
    return [a.dest for a in scratch._actions if a.option_strings]


def test_engine_flags_round_trip_from_bench_to_serve():
    parser = build_parser()
    bench = parser.parse_args(
        ["bench", "--suite", "--model", "/m/target", "--draft-model", "/m/draft", "--dtype", "float32",
         "--device", "cpu", "--no-prefix-caching", "--num-speculative-tokens", "3", "--spec-early-stop", "0.5",
         "--compile", "off", "--seed", "7", "--max-num-seqs", "8", "--speculative-method", "draft"]
    )  # fmt: skip
    argv = engine_argv(bench)
    serve = parser.parse_args(["serve", *argv])
    for dest in engine_dests():
        assert getattr(serve, dest) == getattr(bench, dest), dest
    assert "--no-prefix-caching" in argv and "--block-size" not in argv  # only what differs from defaults
    assert engine_argv(parser.parse_args(["bench", "--suite"])) == []
    assert engine_argv(bench, skip=("model", "seed"))[:2] == ["--dtype", "float32"]


def test_server_names():
    vllm = parse_url("vllm=http://127.0.0.1:8001")
    assert (vllm.name, vllm.url, vllm.command) == ("vllm", "http://127.0.0.1:8001", None)
    assert parse_url("http://127.0.0.1:8001/v1").name == "127.0.0.1:8001"
    with pytest.raises(ValueError):
        parse_url("vllm=localhost:8001")
    started = parse_command("mine=python -m http.server {port}")
    assert (started.name, started.command, started.url) == ("mine", "python -m http.server {port}", None)
    assert "--speculative-method ngram" in parse_command("augur-ngram").command
    with pytest.raises(ValueError):
        parse_command("no-such-preset")


def counters(prefix: str, labels: str, drafts: float, accepted: float) -> str:
    return (
        f"# TYPE {prefix}num_drafts_total counter\n{prefix}num_drafts_total{{{labels}}} {drafts}\n"
        f"{prefix}num_accepted_tokens_total{{{labels}}} {accepted}\n"
    )


def test_acceptance_from_augur_or_vllm_counters():
    def augur(drafts, accepted):
        return counters("augur_spec_decode_", 'method="draft"', drafts, accepted)

    def vllm(drafts, accepted):
        return counters("vllm:spec_decode_", 'engine="0",model_name="demo"', drafts, accepted)

    assert counter_acceptance_length(augur(10, 5), augur(30, 45)) == (3.0, "augur")
    assert counter_acceptance_length(vllm(0, 0), vllm(4, 6)) == (2.5, "vllm")
    assert counter_acceptance_length("", vllm(4, 2)) == (1.5, "vllm")  # counters born during the run
    both = augur(10, 10) + vllm(10, 10), augur(20, 20) + vllm(20, 30)
    assert counter_acceptance_length(*both) == (2.0, "augur")  # Augur's own names win
    assert counter_acceptance_length(augur(10, 5), augur(10, 5)) == (None, None)  # no drafts in between
    assert counter_acceptance_length(None, augur(1, 1)) == (None, None)
    assert counter_acceptance_length("", "# nothing\n") == (None, None)


def test_only_augur_servers_count_as_reading_the_speculative_field():
    """``--plain-baseline`` gives the plain run to Augur servers only: the answers of llama.cpp's and vLLM's
    ``GET /v1/models`` (their documented shapes) are not Augur's, nor is an error or a non-JSON body.
    (Augur's own answer is checked against a served Augur in the ``--url`` test below.)"""

    def models(status: int, body) -> httpx.Response:
        return httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)

    llamacpp = {"object": "list", "data": [{"id": "demo", "object": "model", "created": 1, "owned_by": "llamacpp",
                                            "meta": {"n_vocab": 4096}}]}  # fmt: skip
    vllm = {"object": "list", "data": [{"id": "demo", "object": "model", "owned_by": "vllm", "root": "demo"}]}
    assert not _is_augur(models(200, llamacpp)) and not _is_augur(models(200, vllm))
    assert not _is_augur(models(200, {"object": "list", "data": []}))
    assert not _is_augur(models(401, {"error": {"message": "no key"}})) and not _is_augur(models(200, "<html>"))
    assert _is_augur(models(200, {"object": "list", "data": [{"id": "demo", "owned_by": "augur"}]}))


# -- end to end ------------------------------------------------------------------------------------------------
def test_bench_suite_starts_augur_and_compares_speculative_with_plain(tiny_demo, tmp_path, capsys):
    target = tiny_demo / "target"
    out, plots = tmp_path / "suite.json", tmp_path / "plots"
    rc = main(
        ["bench", "--suite", "--model", str(target), "--draft-model", str(tiny_demo / "draft"),
         "--speculative-method", "draft", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
         "--block-size", "4", "--num-prompts", "2", "--max-tokens", "8", "--warmup", "1", "--startup-timeout", "120",
         "--no-progress", "--output", str(out), "--plots", str(plots)]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert rc == 0, stdout

    report = json.loads(out.read_text())
    assert report["machine"]["cores"] >= 1 and report["date"]
    assert report["categories"] == {c: 2 for c in CATEGORIES}
    assert report["baseline"] == "augur plain"
    (server,) = report["servers"]
    assert server["status"] == "ok" and server["model"] == "target" and "--draft-model" in server["command"]
    assert "serving" in Path(server["log"]).read_text()
    rows = rows_of(report)
    assert len(rows) == 2 * len(CATEGORIES)
    for category in CATEGORIES:
        spec, plain = rows["augur", category, 1], rows["augur plain", category, 1]
        for row in (spec, plain):
            assert row["status"] == "ok" and row["error"] is None
            assert row["completed"] == row["total"] == 2 and row["output_tokens"] == 2 * 8  # ignore_eos
            assert row["output_tok_s"] > 0 and row["ttft_p50_s"] > 0 and row["tpot_p50_s"] > 0
            assert row["api"] == ("chat" if category == "chat" else "completions")
        assert plain["ratio"] == 1.0 and spec["ratio"] == pytest.approx(spec["output_tok_s"] / plain["output_tok_s"])
        # Augur says in every response how many tokens each verify step gained (1.0: nothing drafted).
        assert spec["acceptance_source"] == "usage" and spec["mean_acceptance_length"] >= 1.0
        assert plain["mean_acceptance_length"] == pytest.approx(1.0, abs=0.2)
        assert plain["acceptance"]["counters"] is None and plain["note"] is None  # plain really drafted nothing

    for category in CATEGORIES:
        assert f"### {category} (2 prompts" in stdout
    assert "| augur plain | 1 |" in stdout and "geometric mean" in stdout
    for name in ("suite_tokens_per_s.png", "suite_acceptance.png"):
        assert_png(plots / name)
    assert processes_mentioning(str(target)) == []  # the started server is gone


def test_bench_suite_url_reports_a_failed_category_and_an_absent_server(tiny_demo, tmp_path, capsys, monkeypatch):
    """A copy of the tiny target without a chat template: its chat category fails with the server's
    message while its other categories complete; a server that is not listening fails as a whole, and
    a peer preset that is not installed is skipped."""
    monkeypatch.setenv("AUGUR_PEERS_SCRIPTS", str(tmp_path / "no-such-scripts"))
    target = tmp_path / "no-chat-target"
    shutil.copytree(tiny_demo / "target", target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    gone = f"http://127.0.0.1:{closed_port()}"

    app = create_app(ServerSettings(served_model_name="tiny"), engine_factory(target, speculative_method="ngram"))
    with serve(app) as served:
        assert _is_augur(httpx.get(f"{served.base}/v1/models"))  # so it gets the plain run
        out = tmp_path / "url.json"
        rc = main(
            ["bench", "--suite", "--url", f"tiny={served.base}", "--url", f"gone={gone}", "--server", "vllm-draft",
             "--plain-baseline",
             "--categories", "retrieval", "chat", "--num-prompts", "2", "--max-tokens", "8", "--warmup", "0",
             "--no-progress", "--output", str(out), "--concurrency", "1", "2"]
        )  # fmt: skip
    stdout = capsys.readouterr().out
    assert rc == 0, stdout  # something completed: the report is the result, failures are in it

    report = json.loads(out.read_text())
    tiny, absent, vllm = report["servers"]
    assert vllm["name"] == "vllm-draft" and vllm["status"] == "skipped" and "no-such-scripts" in vllm["reason"]
    assert tiny["status"] == "ok" and tiny["model"] == "tiny"
    assert absent["status"] == "failed" and "cannot reach" in absent["reason"] and absent["rows"] == []
    assert report["baseline"] == "tiny plain"
    rows = rows_of(report)
    assert list(report["categories"]) == ["retrieval", "chat"]
    for c in (1, 2):
        for label in ("tiny", "tiny plain"):
            ok, failed = rows[label, "retrieval", c], rows[label, "chat", c]
            assert ok["status"] == "ok" and ok["completed"] == 2 and ok["ratio"] > 0
            assert failed["status"] == "failed" and failed["completed"] == 0 and failed["ratio"] is None
            assert "http_400" in failed["error"] and "chat template" in failed["error"]
        assert rows["tiny", "retrieval", c]["acceptance_source"] == "usage"
    assert "### chat (2 prompts, chat API)" in stdout
    assert "tiny / chat c=1: failed: http_400" in stdout and "gone: failed: cannot reach" in stdout

    # Nothing measured at all: exit status 1, and still a report.
    rc = main(["bench", "--suite", "--url", gone, "--categories", "math", "--num-prompts", "1", "--no-progress"])
    assert rc == 1
    assert "failed: cannot reach" in capsys.readouterr().out


def test_bench_suite_rounds_keep_servers_up_alternate_them_and_give_each_run_fresh_stores(tiny_demo, tmp_path, capsys):
    """``--rounds 2``. On the Augur the bench starts (suffix decoding): it starts once, round 1 runs
    speculative then plain and round 2 the reverse, and every run goes under its own API key, which the
    server (started with them all) accepts, so no run's drafting store holds another run's answers to
    the same prompts (the store's isolation by key: test_suffix). Then two ``--server`` commands and
    one ``--api-key``: both start once, round 1 runs them in command-line order and round 2 in reverse.
    The summary is the median of each round's own ratio."""
    target = tiny_demo / "target"
    flags = ["--categories", "code", "--num-prompts", "2", "--max-tokens", "16", "--warmup", "1", "--no-progress",
             "--startup-timeout", "120", "--rounds", "2"]  # fmt: skip
    fresh_out = tmp_path / "fresh.json"
    rc = main(
        ["bench", "--suite", "--model", str(target), "--speculative-method", "suffix", "--device", "cpu",
         "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "4", *flags, "--output", str(fresh_out)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert captured.err.count("bench: starting augur") == 1  # resident: one start for both rounds
    fresh = json.loads(fresh_out.read_text())
    assert fresh["load"]["rounds"] == 2 and fresh["load"]["run_keys"] is True
    (server,) = fresh["servers"]
    rows = {(r["round"], r["label"]): r for r in server["rows"]}
    assert len(rows) == len(server["rows"]) == 2 * 2
    assert all(r["completed"] == r["total"] == 2 for r in rows.values())  # every run's key was accepted
    args = argparse.Namespace(rounds=2, concurrency=[1, 8])
    assert len(set(run_keys(args, ["default", "plain"]))) == 1 + 2 + 2 * 2 * 2  # the warm-up, two primes, eight runs
    assert rows[1, "augur"]["started_at"] < rows[1, "augur plain"]["started_at"]
    assert rows[2, "augur plain"]["started_at"] < rows[2, "augur"]["started_at"]  # every other round in reverse
    assert rows[1, "augur plain"]["ratio"] == rows[2, "augur plain"]["ratio"] == 1.0
    (summary,) = [r for r in fresh["across_rounds"] if r["label"] == "augur"]
    ratios = sorted(rows[rnd, "augur"]["ratio"] for rnd in (1, 2))
    assert summary["ratio"] == pytest.approx(sum(ratios) / 2) and summary["ratio_range"] == ratios
    assert summary["rounds"] == 2 and summary["completed"] == summary["total"] == 4
    assert "2 rounds, servers resident" in captured.out and "ratio range" in captured.out
    assert "its own API key" in captured.out

    serve = (
        f"{shlex.quote(sys.executable)} -m server.cli serve --port {{port}} --model {shlex.quote(str(target))} "
        "--device cpu --dtype float32 --num-kv-blocks 256 --block-size 4 --speculative-method"
    )
    shared_out = tmp_path / "shared.json"
    rc = main(
        ["bench", "--suite", "--server", f"suffix={serve} suffix", "--server", f"plain={serve} none",
         "--api-key", "one-key", *flags, "--output", str(shared_out)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert captured.err.count("bench: starting suffix") == 1 and captured.err.count("bench: starting plain") == 1
    shared = json.loads(shared_out.read_text())
    assert shared["load"]["run_keys"] is False and shared["baseline"] == "suffix"
    both = {(r["round"], r["label"]): r for s in shared["servers"] for r in s["rows"]}
    assert both[1, "suffix"]["started_at"] < both[1, "plain"]["started_at"]
    assert both[2, "plain"]["started_at"] < both[2, "suffix"]["started_at"]
    assert "its own API key" not in captured.out
    assert processes_mentioning(str(target)) == []

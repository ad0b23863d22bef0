"""Grammar engines for structured outputs, side by side: xgrammar and llguidance.

``python -m loadtest.bench_grammar [--json OUT] [--reps N]`` measures each importable engine, in one
process so that both see the same machine load, on two tokenizers: the demo pair's (byte-level BPE,
4096 tokens) and a byte-level BPE of 128256 tokens (Llama-3's size) trained here on Python source
and cached under ``$AUGUR_HOME/bench_grammar`` (else /tmp/augur/bench_grammar):

- setup: building the engine's tokenizer info from the Hugging Face tokenizer;
- compile, per grammar (small object, nested tool-call schema, json_object, regex, choice, GBNF): cold
  (median of N; xgrammar's cache cleared) and again at once (xgrammar caches per compiler; llguidance
  has no cache: its compiled grammar is an ``LLMatcher``, kept as a template and copied per request);
- mask / advance: walking a valid output (the HF tokenizer's tokens of a matching document, then
  EOS), timing at each position the fill of a torch int32 bitmask and the advance by one token, each
  token checked against the mask; p50 and p99 per token (over 5-300 positions p99 is about the max),
  on the same matcher after a reset (medians of N-1 walks) and on a fresh one (first walk);
- forced tokens (jump-forward) along the nested walk; mid-walk, the primitives a speculative draft
  tree needs: fork (copy), consume k + rollback k tokens (k = 1..8), the masks along an 8-token chain;
- applying a bitmask to [rows, vocab] float32 logits with each engine's torch helper;
- 128k tokenizer only: how long another Python thread stalls during a long compile and a slow mask
  (the GIL), hostile inputs (each compiled and masked once in a forked child killed after
  ``--timeout`` s), and the errors for invalid input.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import multiprocessing as mp
import os
import statistics
import sysconfig
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

DEMO = Path(__file__).resolve().parents[1] / "engine" / "assets" / "demo" / "target"
BIG_VOCAB = 128256
now = time.perf_counter


def obj(required, **props):
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props}


S, INT, BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
PERSON = obj(["email"], email=S, role={"enum": ["chair", "member", "guest"]}, optional=BOOL)
NESTED = obj(
    ["title", "priority", "attendees"],
    title=S,
    priority={"type": "string", "enum": ["low", "normal", "high", "urgent"]},
    attendees={"type": "array", "items": PERSON, "maxItems": 20},
    location=obj(["room"], room=S, building=S, floor=INT),
    reminders_min={"type": "array", "items": INT},
    notes={"type": ["string", "null"]},
    recurring=BOOL,
)
PEOPLE = [("ada", "chair", False), ("grace", "member", False), ("alan", "member", True), ("edsger", "guest", True)]
EVENT = {
    "title": "Quarterly planning review",
    "priority": "high",
    "attendees": [{"email": f"{n}@example.org", "role": r, "optional": o} for n, r, o in PEOPLE],
    "location": {"room": "4.12", "building": "North", "floor": 4},
    "reminders_min": [10, 30, 1440],
    "notes": None,
    "recurring": False,
}
ANY = {
    "id": 48213,
    "user": {"name": "Kim Lee", "tags": ["admin", "beta", "eu-west"], "score": -12.75},
    "items": [{"sku": "A-100", "qty": 2, "price": 19.99}, {"sku": "B-7", "qty": 1, "price": 5e2}],
    "active": True,
    "deleted_at": None,
    "notes": 'line one\nline "two"',
    "ratios": [0.5, 1.25, 3],
}
DATE = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
ARITH = """root ::= expr
expr ::= term (ws ("+" | "-") ws term)*
term ::= factor (ws ("*" | "/") ws factor)*
factor ::= number | "(" ws expr ws ")"
number ::= [0-9]+ ("." [0-9]+)?
ws ::= " "?"""
CASES = {  # name -> (kind, spec, a valid output)
    "small object": ("json", obj(["name", "age"], name=S, age=INT), json.dumps({"name": "Ada", "age": 36}, indent=2)),
    "nested tool schema": ("json", NESTED, json.dumps(EVENT, indent=2)),
    "json_object": ("any_json", None, json.dumps(ANY, indent=2)),
    "regex (ISO dates)": ("regex", f"{DATE}(, {DATE})*", ", ".join(f"2024-{m:02d}-{m + 9}" for m in range(1, 13))),
    "choice (4 strings)": ("choice", ["positive", "negative", "neutral", "mixed"], "neutral"),
    "GBNF arithmetic": ("gbnf", ARITH, " + ".join(f"({i}.5 * {i + 3} - {i * 7})" for i in range(1, 9))),
}


def wide(n):  # an object of n optional string properties
    return {"type": "object", "properties": {f"p{i}": S for i in range(n)}}


HOSTILE = {  # name -> (kind, spec)
    "schema nested 100 deep": ("json", '{"type":"object","properties":{"a":' * 100 + '{"type":"string"}' + "}}" * 100),
    "object, 300 optional properties": ("json", wide(300)),
    "object, 5000 optional properties": ("json", wide(5000)),
    "enum of 50000 strings": ("json", {"enum": [f"value_{i}" for i in range(50000)]}),
    "regex (a|b)*a(a|b){20}": ("regex", "(a|b)*a(a|b){20}"),
    "regex ((a|b){1,50}){1,50}c": ("regex", "((a|b){1,50}){1,50}c"),
    "regex (a{1,1000}){1,1000}": ("regex", "(a{1,1000}){1,1000}"),
}
INVALID = {
    "schema: not JSON": ("json", '{"type": '),
    "schema: type strng": ("json", {"type": "strng"}),
    "regex [a-": ("regex", "[a-"),
    "GBNF undefined rule": ("gbnf", "root ::= foo"),
}


def load_xgrammar():
    import xgrammar as xgr

    e = SimpleNamespace(name="xgrammar", version=importlib.metadata.version("xgrammar"))

    def setup(hf):
        e.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        e.compiler = xgr.GrammarCompiler(e.info)  # cache_enabled=True, max_threads=8
        return e.info.vocab_size

    def compile(kind, spec):
        c = e.compiler
        if kind == "json":
            return c.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
        if kind == "any_json":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)

    def chain_masks(m, draft, bitmask):  # a tree of one chain; node 0 is the last accepted token
        n = len(draft)
        nxt = torch.tensor([*range(1, n + 1), -1], dtype=torch.int64)
        sibling = torch.full((n + 1,), -1, dtype=torch.int64)
        m.traverse_draft_tree(nxt, sibling, torch.tensor([0, *draft], dtype=torch.int64), bitmask)

    def probe():  # one long compile on one thread, so that it does not compete for the CPUs
        c = xgr.GrammarCompiler(e.info, max_threads=1, cache_enabled=False)
        return lambda: c.compile_json_schema(json.dumps(wide(100)))

    vars(e).update(
        setup=setup,
        compile=compile,
        probe=probe,
        slow_mask="regex (a{1,1000}){1,1000}",
        clear_cache=lambda: e.compiler.clear_cache(),
        matcher=xgr.GrammarMatcher,
        fill=lambda m, bitmask: m.fill_next_token_bitmask(bitmask),
        advance=lambda m, token: m.accept_token(token),
        fork=lambda m: m.fork(),
        forced=lambda m: m.find_jump_forward_string(),
        text=str,
        done=lambda m: m.is_terminated(),
        apply=xgr.apply_token_bitmask_inplace,
        chain_masks=chain_masks,
    )
    return e


def load_llguidance():
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch

    e = SimpleNamespace(name="llguidance", version=importlib.metadata.version("llguidance"), lib=llg, limits=None)
    executor, fill_draft = llg.LLExecutor(), llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens
    formats = {"json": "json_schema", "any_json": "json_schema", "regex": "regex", "choice": "choice", "gbnf": "gbnf"}

    def setup(hf):
        e.tok = llguidance.hf.from_tokenizer(hf)
        return e.tok.vocab_size

    def compile(kind, spec):
        text = '{"type": "object"}' if kind == "any_json" else spec if isinstance(spec, str) else json.dumps(spec)
        m = llg.LLMatcher(e.tok, llg.grammar_from(formats[kind], text), log_level=0, limits=e.limits)
        if m.is_error():  # grammar errors and limits never raise: the matcher is left in an error state
            raise ValueError(m.get_error().split("\n")[0])
        return m  # the template: each request takes a deep_copy()

    vars(e).update(
        setup=setup,
        compile=compile,
        probe=lambda: lambda: compile("json", wide(2000)),
        slow_mask="object, 5000 optional properties",
        clear_cache=lambda: None,
        matcher=lambda template: template.deep_copy(),
        fill=llguidance.torch.fill_next_token_bitmask,
        advance=lambda m, token: m.consume_token(token),
        fork=lambda m: m.deep_copy(),
        forced=lambda m: m.compute_ff_tokens(),
        text=lambda tokens: e.tok.decode_str(tokens),
        done=lambda m: m.is_stopped() and not m.is_error(),
        apply=llguidance.torch.apply_token_bitmask_inplace,
        chain_masks=lambda m, draft, bitmask: fill_draft(executor, [(m, 0, draft)], bitmask),
    )
    return e


def big_tokenizer():
    """A byte-level BPE of 128256 tokens on the stdlib's *.py, then site-packages' up to 64 MB (the
    stdlib's 31 MB gives only ~123k merges); trained once (~15 s on 2 cores) and cached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(os.environ.get("AUGUR_HOME") or "/tmp/augur") / "bench_grammar" / f"bpe{BIG_VOCAB}.json"
    if not path.is_file():
        files = glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)
        total, keep = 0, []
        for f in sorted(files, key=lambda f: ("site-packages" in f, f)):
            if total > 64e6:
                break
            total += os.path.getsize(f)
            keep.append(f)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=BIG_VOCAB, special_tokens=["<|eos|>"], initial_alphabet=alphabet, show_progress=False
        )
        tok.train_from_iterator((Path(f).read_text("utf-8", "replace") for f in keep), trainer, length=len(keep))
        assert tok.get_vocab_size() == BIG_VOCAB, f"{tok.get_vocab_size()} tokens from {total / 1e6:.0f} MB"
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), eos_token="<|eos|>")


def p99(xs):
    return sorted(xs)[round(0.99 * (len(xs) - 1))]


def timed(fn, n=1):
    """Seconds per call of fn, one entry per call."""
    out = []
    for _ in range(n):
        t = now()
        fn()
        out.append(now() - t)
    return out


def walk(eng, m, ids, bitmask, forced=None):
    """Mask then advance at each position (seconds); each token must be allowed and accepted."""
    mask, adv = [], []
    for t in ids:
        t0 = now()
        eng.fill(m, bitmask)
        mask.append(now() - t0)
        if forced is not None:
            t0 = now()
            f = eng.forced(m)
            forced.append((now() - t0, f))
        assert (int(bitmask[0, t >> 5]) >> (t & 31)) & 1, f"{eng.name}: token {t} masked out"
        t0 = now()
        ok = eng.advance(m, t)
        adv.append(now() - t0)
        assert ok, f"{eng.name}: token {t} rejected"
    assert eng.done(m), f"{eng.name}: not terminated after EOS"
    return mask, adv


def gil_stall(fn):
    """Longest gap (s) between the wake-ups of this thread, sleeping 1 ms at a time, while fn runs on
    another: about fn's duration if fn holds the GIL, a few ms if it releases it."""
    th = threading.Thread(target=fn)
    last, worst = now(), 0.0
    th.start()
    while th.is_alive():
        time.sleep(0.001)
        worst, last = max(worst, now() - last), now()
    return worst


def _hostile_child(eng, spec, vocab, conn):
    try:
        eng.clear_cache()
        t = now()
        m = eng.matcher(eng.compile(*spec))
        t1 = now()
        eng.fill(m, torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32))
        msg = f"compile {(t1 - t) * 1e3:.0f} ms, first mask {(now() - t1) * 1e3:.1f} ms"
        if eng.name == "llguidance" and m.is_error():
            msg += "; error: " + m.get_error().split("\n")[0]
        conn.send(msg)
    except Exception as e:
        conn.send(f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:110]}")


def hostile(eng, spec, vocab, timeout):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(False)
    p = ctx.Process(target=_hostile_child, args=(eng, spec, vocab, child))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return f"not done after {timeout:.0f} s (killed)"
    return parent.recv() if parent.poll() else f"child died, exit {p.exitcode}"


def bench(eng, tname, hf, reps, timeout):
    """The rows for one engine on one tokenizer."""
    rows = []

    def row(measure, value, p=None, note=""):
        rows.append(dict(engine=eng.name, tokenizer=tname, measure=measure, value=value, p99=p, note=note))

    t = now()
    vocab = eng.setup(hf)
    row("setup: tokenizer info (ms)", (now() - t) * 1e3, note=f"vocab {vocab}")
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    for name, (kind, spec, doc) in CASES.items():
        cold = []
        for _ in range(reps):
            eng.clear_cache()
            t = now()
            compiled = eng.compile(kind, spec)
            cold.append(now() - t)
        again = timed(lambda: eng.compile(kind, spec))[0]  # noqa: B023
        row(f"compile {name} (ms)", statistics.median(cold) * 1e3, note=f"again at once: {again * 1e3:.3f} ms")
        ids = hf.encode(doc, add_special_tokens=False) + [hf.eos_token_id]
        m = eng.matcher(compiled)
        first = walk(eng, m, ids, bitmask)
        walks = []
        for _ in range(max(1, reps - 1)):
            m.reset()
            walks.append(walk(eng, m, ids, bitmask))
        mask, adv = ([statistics.median(w[j][i] for w in walks) * 1e6 for i in range(len(ids))] for j in (0, 1))
        mask0, adv0 = ([x * 1e6 for x in first[j]] for j in (0, 1))
        note = f"{len(ids)} tokens; first walk p50 {statistics.median(mask0):.1f}, p99 {p99(mask0):.1f}"
        row(f"mask {name} (us/token)", statistics.median(mask), p99(mask), note)
        row(
            f"advance {name} (us/token)",
            statistics.median(adv),
            p99(adv),
            f"first walk p50 {statistics.median(adv0):.1f}",
        )
        if name == "nested tool schema":
            nested = (compiled, ids)
    bench_speculation(eng, *nested, bitmask, row)
    bench_apply(eng, vocab, row)
    if vocab == BIG_VOCAB:
        bench_safety(eng, vocab, bitmask, timeout, row)
    return rows


def bench_speculation(eng, compiled, ids, bitmask, row):
    forced = []
    walk(eng, eng.matcher(compiled), ids, bitmask, forced)
    us = [s * 1e6 for s, _ in forced]
    longest = eng.text(max((f for _, f in forced), key=len))
    note = f"non-empty at {sum(bool(f) for _, f in forced)}/{len(ids)} positions; longest {longest!r}"
    row("forced tokens, nested walk (us/call)", statistics.median(us), p99(us), note)
    mid = len(ids) // 2
    m = eng.matcher(compiled)
    assert all(eng.advance(m, t) for t in ids[:mid])
    row("fork/copy matcher mid-walk (us)", statistics.median(timed(lambda: eng.fork(m), 200)) * 1e6)
    ks = []
    for k in range(1, 9):

        def step(k=k):
            for t in ids[mid : mid + k]:
                assert eng.advance(m, t)
            m.rollback(k)

        ks.append(statistics.median(timed(step, 200)) * 1e6)
    row("consume k + rollback k (us)", ks[0], None, "k=1..8: " + " ".join(f"{x:.1f}" for x in ks))
    draft, rows9 = ids[mid : mid + 8], torch.zeros((9, bitmask.shape[1]), dtype=torch.int32)

    def by_hand():
        for i, t in enumerate(draft):
            eng.fill(m, rows9[i : i + 1])
            eng.advance(m, t)
        eng.fill(m, rows9[8:])
        m.rollback(8)

    native = statistics.median(timed(lambda: eng.chain_masks(m, draft, rows9), 200)) * 1e6
    assert all((int(rows9[i, t >> 5]) >> (t & 31)) & 1 for i, t in enumerate(ids[mid : mid + 9]))
    hand = statistics.median(timed(by_hand, 200)) * 1e6
    note = f"the engine's draft helper; by hand (fill + advance x8, fill, rollback 8): {hand:.1f}"
    row("masks along an 8-token draft chain (us)", native, None, note)


def bench_apply(eng, vocab, row):
    for r in (1, 8, 64):
        logits = torch.randn(r, vocab)
        bits = torch.randint(-(2**31), 2**31 - 1, (r, (vocab + 31) // 32), dtype=torch.int32)
        try:
            first_call = timed(lambda: eng.apply(logits, bits))[0]  # noqa: B023
            us = statistics.median(timed(lambda: eng.apply(logits, bits), 50)) * 1e6  # noqa: B023
            row(f"apply bitmask rows={r} (us)", us, note=f"first call {first_call * 1e3:.0f} ms")
        except Exception as e:
            row(f"apply bitmask rows={r} (us)", None, note=f"{type(e).__name__}: {e}"[:150])


def bench_safety(eng, vocab, bitmask, timeout, row):
    probe = eng.probe()
    note = f"one compile of {timed(probe)[0] * 1e3:.0f} ms; a stall that long would mean the GIL is held"
    row("compile: longest stall of a Python thread (ms)", gil_stall(probe) * 1e3, note=note)
    compiled = eng.compile(*HOSTILE[eng.slow_mask])
    note = f"first mask of {eng.slow_mask}: {timed(lambda: eng.fill(eng.matcher(compiled), bitmask))[0] * 1e3:.0f} ms"
    row(
        "mask: longest stall of a Python thread (ms)",
        gil_stall(lambda: eng.fill(eng.matcher(compiled), bitmask)) * 1e3,
        note=note,
    )
    for name, spec in HOSTILE.items():
        row(f"hostile: {name}", None, note=hostile(eng, spec, vocab, timeout))
    if eng.name == "llguidance":  # the same with a limit of its own
        eng.limits = eng.lib.LLParserLimits(max_grammar_size=20_000)
        note = hostile(eng, HOSTILE["object, 5000 optional properties"], vocab, timeout)
        row("hostile: 5000 optional properties, max_grammar_size=20000", None, note=note)
        eng.limits = None
    for name, spec in INVALID.items():
        try:
            eng.compile(*spec)
            note = "accepted"
        except Exception as e:
            note = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:110]}"
        row(f"invalid: {name}", None, note=note)


def fmt(v):
    return "" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--reps", type=int, default=5, help="repeats for compiles and walks (medians)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds allowed per hostile input")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    engines = []
    for name, load in (("xgrammar", load_xgrammar), ("llguidance", load_llguidance)):
        try:
            engines.append(load())
        except ImportError as e:
            print(f"skipping {name}: not importable here ({e})")
    toks = {"demo 4k": AutoTokenizer.from_pretrained(DEMO), "BPE 128k": big_tokenizer()}
    load = os.getloadavg()[0]
    rows = [r for tn, hf in toks.items() for eng in engines for r in bench(eng, tn, hf, args.reps, args.timeout)]
    versions = ", ".join(f"{e.name} {e.version}" for e in engines)
    print(f"{versions}; torch {torch.__version__} on 1 thread; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("\n| engine | tokenizer | measure | value (p50) | p99 | note |\n|---|---|---|---|---|---|")
    for r in rows:
        note = r["note"].replace("|", "/")
        print(f"| {r['engine']} | {r['tokenizer']} | {r['measure']} | {fmt(r['value'])} | {fmt(r['p99'])} | {note} |")
    if args.json:
        args.json.write_text(json.dumps({"engines": {e.name: e.version for e in engines}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

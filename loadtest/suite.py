"""The benchmark suite: prompts in five categories with the shape of Spec-Bench.

Spec-Bench (Xia et al., 2024) measures speculative decoding per task because speedups differ by task:
a draft that guesses free text poorly can still copy well, and prompt-lookup drafting only helps where
the answer repeats the input. The categories here:

* ``code``: code prefixes cut at a line end; the model continues the program.
* ``chat``: conversations (some multi-turn), sent through ``/v1/chat/completions``.
* ``summarization``: a long passage (a docstring from the standard library) and an instruction to
  summarise it; summaries reuse the passage's phrases.
* ``retrieval``: a context of several source functions and a request to quote one of them; the answer
  is copied from the context, the case where n-gram and suffix drafting shine.
* ``math``: arithmetic word problems after one worked example ("Let's think step by step").

``loadtest/prompts/suite.jsonl`` is generated, deterministically, by ``python -m loadtest.suite
--write`` from text every Python install has: the standard library's sources (preferring the files
the demo pair holds out of its training set) and arithmetic with numbers from a seeded generator. The
file is committed, so every machine measures the same prompts; regenerating on another Python version
may pick other files (``--check`` says whether the shipped file still matches).

Each line is ``{"category", "prompt" | "messages", "source"}``, plus ``"answer"`` where the category
has one (retrieval: the quoted definition, which occurs in the prompt; math: the number).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sys
import textwrap
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from loadtest.prompts import Prompt, load_prompts

CATEGORIES = ("code", "chat", "summarization", "retrieval", "math")
PER_CATEGORY = 10
MAX_PROMPT_CHARS = 850  # ~260 tokens of the demo tokenizer; the tiny test demo (512 positions) needs ~480
SUITE_FILE = Path(__file__).resolve().parent / "prompts" / "suite.jsonl"
SEED = 0

MULTI_TURN = [  # written for this suite; the follow-ups revise the first answer, so replies reuse it
    [
        {"role": "user", "content": "Write a Python function that returns the largest value in a list."},
        {
            "role": "assistant",
            "content": "def largest(values):\n    best = values[0]\n    for v in values[1:]:\n"
            "        if v > best:\n            best = v\n    return best",
        },
        {"role": "user", "content": "Change it so that it returns None for an empty list, and add a docstring."},
    ],
    [
        {"role": "user", "content": "Explain what a context manager is."},
        {
            "role": "assistant",
            "content": "A context manager is an object that sets something up when a `with` block starts and "
            "tears it down when the block ends, even if an exception is raised. Files are the usual example: "
            "`with open(path) as f:` closes the file for you.",
        },
        {"role": "user", "content": "Now show how to write my own with contextlib, in the same style."},
    ],
    [
        {"role": "user", "content": "Give me a shell one-liner that counts the lines of every .py file in a folder."},
        {"role": "assistant", "content": "find . -name '*.py' | xargs wc -l"},
        {"role": "user", "content": "Make it handle file names with spaces, and sort the result by line count."},
    ],
]


def _stable(key: str) -> str:
    return hashlib.md5(key.encode()).hexdigest()


def _by_hash(items: Iterable[tuple[str, str]], salt: str) -> list[tuple[str, str]]:
    """(name, text) pairs in an order fixed by their names alone (not by the file system's)."""
    return sorted(items, key=lambda item: _stable(f"{salt}:{item[0]}"))


def _in_order(heldout: list[tuple[str, str]], train: list[tuple[str, str]], salt: str) -> list[tuple[str, str]]:
    """The demo pair's held-out files first (text its models never saw), then the training files."""
    return _by_hash(heldout, salt) + _by_hash(train, salt)


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


# -- the categories -----------------------------------------------------------------------------------
def code_prompts(files: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    """From a top-level ``def`` or ``class`` line, 250-600 characters cut at a line end."""
    out = []
    for name, text in files:
        if name.startswith("encodings/") or len(text) < 1500:
            continue  # codec tables are not code anyone completes
        starts = [i + 1 for i in range(len(text)) if text.startswith(("\ndef ", "\nclass "), i)]
        starts = [s for s in starts if len(text) - s > 800]
        if not starts:
            continue
        start = rng.choice(starts)
        cut = text.rfind("\n", start, start + rng.randint(250, 600))
        if cut - start < 200:
            continue
        out.append({"category": "code", "prompt": text[start : cut + 1], "source": name})
        if len(out) == PER_CATEGORY:
            break
    return out


def chat_prompts(shipped: list[Prompt]) -> list[dict]:
    """Single-turn conversations from the shipped chat set, plus multi-turn ones written for the suite."""
    keyed = [(json.dumps(p.as_messages()), p) for p in shipped]
    picked = [p for _, p in sorted(keyed, key=lambda kp: _stable(f"chat:{kp[0]}"))]
    picked = picked[: PER_CATEGORY - len(MULTI_TURN)]
    out = [{"category": "chat", "messages": p.as_messages(), "source": "chat.jsonl"} for p in picked]
    out += [{"category": "chat", "messages": m, "source": "suite"} for m in MULTI_TURN]
    return out


def _trim(passage: str, limit: int) -> str:
    """The longest run of whole paragraphs (else sentences) within ``limit`` characters."""
    if len(passage) <= limit:
        return passage
    for sep in ("\n\n", ". "):
        kept = ""
        for part in passage.split(sep):
            longer = f"{kept}{sep}{part}" if kept else part
            if len(longer) > limit:
                break
            kept = longer
        if len(kept) >= limit // 2:
            return kept + ("." if sep == ". " else "")
    return passage[:limit].rsplit(" ", 1)[0]


def summarization_prompts(files: list[tuple[str, str]]) -> list[dict]:
    """A docstring of 400+ characters (trimmed to ~650) and an instruction to summarise it."""
    out = []
    for name, text in files:
        tree = _parse(text)
        if tree is None:
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)))]
        docs = [d for d in (ast.get_docstring(n) for n in nodes) if d and len(d) >= 400]
        if not docs:
            continue
        passage = _trim(max(docs, key=len).strip(), 650)
        prompt = (
            f"Text:\n{passage}\n\nSummarize the text above in two or three sentences, keeping its key terms.\nSummary:"
        )
        out.append({"category": "summarization", "prompt": prompt, "source": name})
        if len(out) == PER_CATEGORY:
            break
    return out


def _small_functions(text: str) -> list[tuple[str, str]]:
    """(name, dedented source) of the functions and methods of 60-200 characters, in file order."""
    tree = _parse(text)
    if tree is None:
        return []
    lines = text.splitlines()
    found, seen = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in seen:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        if 60 <= len(source) <= 200 and source.startswith(("def ", "async def ")):
            seen.add(node.name)
            found.append((node.lineno, node.name, source))
    return [(name, source) for _, name, source in sorted(found)]


def retrieval_prompts(files: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    """Three functions of one file as context, then a request to quote one of them, answered up to
    its name: the rest of the answer occurs verbatim in the prompt."""
    out = []
    for name, text in files:
        functions = _small_functions(text)
        if len(functions) < 3:
            continue
        context = rng.sample(functions, 3)
        fname, answer = rng.choice(context)
        opening = answer[: answer.index(fname) + len(fname)]
        body = "\n\n".join(source for _, source in context)
        prompt = (
            f"Here are three functions from {name}:\n\n{body}\n\n"
            f"Quote the definition of `{fname}` exactly as it appears above.\n\n{opening}"
        )
        out.append({"category": "retrieval", "prompt": prompt, "answer": answer, "source": name})
        if len(out) == PER_CATEGORY:
            break
    return out


def _problem(kind: int, rng: random.Random) -> tuple[str, str, int]:
    """(question, worked steps, answer) of one arithmetic word problem."""
    if kind == 0:
        price, count = rng.randint(12, 95), rng.randint(2, 9)
        cost = price * count
        paid_cents = (cost // 100 + rng.randint(1, 3)) * 100
        return (
            f"A pencil costs {price} cents. Sam buys {count} pencils and pays with {paid_cents} cents. "
            "How many cents of change does he get?",
            f"The pencils cost {count} * {price} = {cost} cents. The change is {paid_cents} - {cost} = "
            f"{paid_cents - cost} cents.",
            paid_cents - cost,
        )
    if kind == 1:
        rows, per_row, eaten = rng.randint(3, 9), rng.randint(4, 12), rng.randint(1, 9)
        total = rows * per_row
        return (
            f"A tray holds {rows} rows of {per_row} cookies. The children eat {eaten} cookies. "
            "How many cookies are left?",
            f"The tray holds {rows} * {per_row} = {total} cookies. After eating, {total} - {eaten} = "
            f"{total - eaten} cookies are left.",
            total - eaten,
        )
    if kind == 2:
        speed, hours, extra = rng.randint(40, 90), rng.randint(2, 6), rng.randint(10, 60)
        first = speed * hours
        return (
            f"A train travels at {speed} km per hour for {hours} hours, then {extra} km more. "
            "How many km does it travel in all?",
            f"In {hours} hours it travels {speed} * {hours} = {first} km. In all it travels {first} + {extra} = "
            f"{first + extra} km.",
            first + extra,
        )
    if kind == 3:
        start, gift, share = rng.randint(20, 60), rng.randint(5, 30), rng.randint(2, 5)
        total = start + gift
        total -= total % share
        gift = total - start
        return (
            f"Mia has {start} stickers and her aunt gives her {gift} more. She shares them equally among "
            f"{share} friends. How many stickers does each friend get?",
            f"Mia has {start} + {gift} = {total} stickers. Each friend gets {total} / {share} = {total // share} "
            "stickers.",
            total // share,
        )
    width, length, cost = rng.randint(3, 12), rng.randint(4, 15), rng.randint(2, 9)
    area = width * length
    return (
        f"A garden is {width} m wide and {length} m long. Grass seed costs {cost} dollars per square metre. "
        "How many dollars does seed for the whole garden cost?",
        f"The garden's area is {width} * {length} = {area} square metres. The seed costs {area} * {cost} = "
        f"{area * cost} dollars.",
        area * cost,
    )


def math_prompts(rng: random.Random) -> list[dict]:
    """One worked example of another kind, then the question, answered "step by step"."""
    out = []
    for i in range(PER_CATEGORY):
        kind = i % 5
        q0, steps0, a0 = _problem((kind + 1) % 5, rng)
        q, steps, answer = _problem(kind, rng)
        prompt = (
            f"Q: {q0}\nA: Let's think step by step. {steps0} The answer is {a0}.\n\n"
            f"Q: {q}\nA: Let's think step by step."
        )
        out.append({"category": "math", "prompt": prompt, "answer": str(answer), "source": "arithmetic"})
    return out


# -- the whole suite --------------------------------------------------------------------------------------
def build_suite(seed: int = SEED) -> list[dict]:
    """Every line of the suite, category by category. Imports the demo module (and torch) to learn
    which standard-library files the demo pair held out of its training."""
    from engine.offline.demo import DemoRecipe, split_corpus

    train, heldout = split_corpus(DemoRecipe())
    lines = [
        *code_prompts(_in_order(heldout, train, "code"), random.Random(f"{seed}:code")),
        *chat_prompts(load_prompts("chat")),
        *summarization_prompts(_in_order(heldout, train, "summarization")),
        *retrieval_prompts(_in_order(heldout, train, "retrieval"), random.Random(f"{seed}:retrieval")),
        *math_prompts(random.Random(f"{seed}:math")),
    ]
    for line in lines:
        size = len(line.get("prompt") or "") + sum(len(m["content"]) for m in line.get("messages") or [])
        if size > MAX_PROMPT_CHARS:
            raise AssertionError(f"a {line['category']} prompt from {line['source']} has {size} characters")
    return lines


def to_jsonl(lines: list[dict]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def read_suite(path: str | Path | None = None) -> list[dict]:
    """The raw lines (with their answers) of ``path``, default the shipped suite."""
    if path is None:
        text = resources.files("loadtest").joinpath("prompts", "suite.jsonl").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def by_category(prompts: list[Prompt]) -> dict[str, list[Prompt]]:
    """Prompts grouped by category: the suite's categories first, in their order, then any others."""
    missing = sum(p.category is None for p in prompts)
    if missing:
        raise ValueError(f"{missing} prompt(s) have no 'category'; a suite file needs one on every line")
    groups: dict[str, list[Prompt]] = {c: [] for c in CATEGORIES}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    return {c: ps for c, ps in groups.items() if ps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.suite", description="Generate the benchmark suite.")
    p.add_argument("--write", nargs="?", const=str(SUITE_FILE), metavar="PATH", help=f"default {SUITE_FILE}")
    p.add_argument("--check", action="store_true", help="exit 1 if the shipped file differs from a fresh build")
    args = p.parse_args(argv)
    text = to_jsonl(build_suite())
    if args.check:
        same = SUITE_FILE.read_text(encoding="utf-8") == text
        print("suite.jsonl is up to date" if same else "suite.jsonl differs from a fresh build (python version?)")
        return 0 if same else 1
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

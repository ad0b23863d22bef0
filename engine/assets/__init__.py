"""Files shipped inside the package.

``demo/``: the embedded demo pair, trained once by ``augur demo build`` (engine/offline/demo.py) and
committed: ``target/`` and ``draft/`` (Hugging Face directories, bf16 safetensors, with their
tokenizer), ``recipe.json`` (the recipe that made them), ``report.json`` (what the build measured)
and ``prompts.jsonl`` (held-out prompts). ``augur serve`` with no ``--model`` serves it as it is:
nothing to build or download. This module only names the files, so serving it imports no training code.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"


def shipped_demo() -> Path | None:
    """The shipped demo pair's directory, or None where a checkout or an install lacks it."""
    complete = all((DEMO_DIR / part / "config.json").is_file() for part in ("target", "draft"))
    return DEMO_DIR if complete else None

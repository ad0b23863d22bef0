"""The house's floors hold (docs/architecture.md): the import-linter contracts in pyproject.toml are
kept, and a process that serves a model of one's own never imports the offline tools' dependencies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (make install installs it with the test extra)")
    return subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept():
    done = lint_imports()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout


def test_a_serving_process_imports_no_offline_tool(llama_dir):
    """Build the engine and the app for a model of one's own, as `augur serve --model` does, serve one
    request, and look at what the process imported."""
    code = f"""
import sys
from fastapi.testclient import TestClient
from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from server.app import ServerSettings, create_app
from server import cli  # the command line itself, whose offline subcommands load their tools lazily

cfg = EngineConfig(model={str(llama_dir)!r}, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
app = create_app(ServerSettings(served_model_name="m"), lambda: AsyncEngine(LLMEngine(cfg)))
with TestClient(app) as c:
    import time
    while c.get("/health").status_code != 200:
        time.sleep(0.05)
    assert c.post("/v1/completions", json={{"prompt": "hi", "max_tokens": 2}}).status_code == 200
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("optuna", "scipy", "matplotlib", "loadtest")
             or m.startswith("engine.offline"))
print("IMPORTED", bad)
"""
    env = {**os.environ, "AUGUR_COMPILE": "off", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "IMPORTED []" in done.stdout, done.stdout

"""Every file under configs/ is checked against what it configures, and a server that cannot load its
engine exits non-zero with the reason.

A shipped layer-skip config once named layers the shipped demo target no longer had, and ``augur
serve`` then sat at 503 forever (issue 34). Here:

- each file under configs/ must be claimed by a check (this module's, or test_deploy's and
  test_kubernetes' for the presets and deployment files), so a new file cannot slip in unchecked;
- the configs written for the demo pair are loaded into an engine with the shipped pair and serve a
  request: a preset or a skip set that no longer fits the shipped model fails here, not on a user's
  machine;
- ``augur serve`` whose engine fails to load logs why and exits 1 (a real process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.assets import DEMO_DIR
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.layer_skip import LayerSkip
from engine.offline.demo import DemoRecipe
from engine.request.sampling_params import SamplingParams
from server.cli import apply_config_file, build_parser

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
LAYER_SKIP = sorted(CONFIGS.glob("layer-skip-*.json"))
RECIPE = DemoRecipe()


def claimed_by(path: Path) -> str | None:
    """Which tests check a file under configs/ (None: nothing does)."""
    rel = path.relative_to(CONFIGS)
    if rel.parts[0] == "deploy":
        return "test_deploy.py / test_kubernetes.py (compose, Prometheus, nginx, Grafana, Helm, Kubernetes)"
    if path in PRESETS:
        return "test_deploy.py (parse, validate) and test_configs.py (the demo presets served)"
    if path in LAYER_SKIP:
        return "test_configs.py (against the demo target's shape)"
    return None


def test_every_file_under_configs_is_checked():
    files = [p for p in CONFIGS.rglob("*") if p.is_file()]
    assert files and {p.name for p in LAYER_SKIP} == {"layer-skip-demo.json"}
    unchecked = [str(p.relative_to(ROOT)) for p in files if claimed_by(p) is None]
    assert not unchecked, f"no test checks {unchecked}: add one (tests/test_configs.py says how)"


def test_the_claim_can_fail(tmp_path):
    assert claimed_by(CONFIGS / "layer-skip-other-model.txt") is None


# -- the shipped demo pair ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_shapes() -> tuple[Path, Path]:
    """The shipped demo pair (engine/assets/demo), which these configs are written for."""
    return DEMO_DIR / "target", DEMO_DIR / "draft"


def engine_for(args, target: Path, draft: Path | None, **overrides) -> LLMEngine:
    """The engine ``augur serve`` would build from ``args``, on the shipped demo pair, with a small KV
    pool (the preset's memory fraction would size it from this machine's RAM)."""
    fields = set(EngineConfig.field_names())
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(model=str(target), device="cpu", dtype="float32", num_kv_blocks=256, **overrides)
    if values.get("speculative_method") in (None, "auto", "draft") and not values.get("draft_model"):
        values["draft_model"] = str(draft)
    return LLMEngine(EngineConfig(**values))


def greedy_ids(engine: LLMEngine, prompts: list[list[int]], **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **kw)
    return [list(o.outputs[0].delta_token_ids) for o in engine.generate(prompts, params)]


PROMPTS = [list(range(40, 60)), list(range(100, 107))]


@pytest.mark.parametrize("path", LAYER_SKIP, ids=lambda p: p.name)
def test_layer_skip_config_fits_the_demo_target(path, demo_shapes):
    data = json.loads(path.read_text())
    skip = LayerSkip.load(path).check(RECIPE.target.layers)  # names only layers the target has
    assert skip.attn or skip.mlp, "a skip set that skips nothing drafts at the target's full cost"
    assert data["tuned"]["model"].endswith("demo/target"), "tuned on something other than the demo target"
    target, draft = demo_shapes
    args = apply_config_file(
        build_parser(), ["serve", "--speculative-method", "layer-skip", "--layer-skip-config", str(path)]
    )
    # A fixed depth, no early stop: every request drafts, whatever its acceptance.
    engine = engine_for(args, target, draft, spec_early_stop=0.0)
    plain = greedy_ids(engine, PROMPTS, speculative=False)
    assert greedy_ids(engine, PROMPTS, num_draft_tokens=4) == plain
    assert engine.spec_stats.num_draft_tokens > 0, "the layer-skip draft never drafted"


@pytest.mark.parametrize(
    "path", [p for p in PRESETS if "model" not in yaml.safe_load(p.read_text())], ids=lambda p: p.name
)
def test_demo_presets_serve_the_demo_pair(path, demo_shapes):
    """A preset without a model serves the demo pair: it loads at the pair's shapes and speculates."""
    target, draft = demo_shapes
    args = apply_config_file(build_parser(), ["serve", "--config", str(path)])
    assert args.model is None
    engine = engine_for(args, target, draft)
    assert engine.spec_method == args.speculative_method
    plain = greedy_ids(engine, PROMPTS, speculative=False)
    assert greedy_ids(engine, PROMPTS) == plain


# -- a failed load ends the process --------------------------------------------------------------------------
def test_a_server_whose_engine_cannot_load_exits_non_zero(llama_dir, tmp_path):
    """The tiny model has 2 layers; a skip set for layers 6 and 7 cannot load. ``augur serve`` must say
    so and exit 1 (not stay up answering 503), so Docker, Kubernetes and ``make serve`` see it."""
    bad = tmp_path / "layer-skip.json"
    bad.write_text(json.dumps({"attention": [6, 7], "mlp": []}))
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(llama_dir), "--port", "0"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4"]
    cmd += ["--speculative-method", "layer-skip", "--layer-skip-config", str(bad)]
    env = {**os.environ, "AUGUR_COMPILE": "off", "PYTHONPATH": str(ROOT)}
    # The timeout turns a server that stays up into a failure; it is no timing claim.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "engine failed to load" in done.stderr
    assert "layer-skip config names layers [6, 7], but the model has 2" in done.stderr.splitlines()[-1]


def test_a_cache_scoped_by_api_key_needs_a_key(llama_dir):
    """``--prefix-cache-scope api-key`` on a server without keys would scope nothing: it is refused
    before the model loads, naming the flag; an unknown scope is refused by the engine's config."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(llama_dir), "--port", "0", "--device", "cpu"]
    cmd += ["--prefix-cache-scope", "api-key"]
    env = {k: v for k, v in os.environ.items() if k != "AUGUR_API_KEY"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode != 0 and "--prefix-cache-scope api-key" in done.stderr and "--api-key" in done.stderr
    with pytest.raises(ValueError, match="prefix_cache_scope must be one of"):
        EngineConfig(model=str(llama_dir), prefix_cache_scope="per-user")

"""Shared fixtures: tiny random-weight Hugging Face model directories, built locally (no downloads)."""

from __future__ import annotations

import gc
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

if not torch.cuda.is_available():
    # Triton kernels (the triton attention backend) run in Triton's interpreter, on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs in two pytest-xdist workers on 2 cores: an engine process of each on both cores
# would only spin its OpenMP threads against the other worker's (see one_torch_thread).
os.environ.setdefault("AUGUR_ENGINE_THREADS", "1")
# Inductor's pool of compile processes only contends with the other worker on 2 cores (each compiling
# process started one, 2-3 s of CPU); servers and engine processes the tests start inherit this.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

VOCAB = 384
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in ["textwrap.py", "string.py", "bisect.py", "heapq.py", "colorsys.py"]:
        p = stdlib / name
        if p.exists():
            texts.append(p.read_text(encoding="utf-8"))
    texts.append("The future of artificial intelligence is bright. Ünïcödé ✓ 你好 🙂")
    return texts


@pytest.fixture(autouse=True, scope="session")
def _a_share_of_the_cpus():
    """Each pytest-xdist worker's torch threads fit its share of the cores (2 workers on 2 cores: one
    each; a second thread only spins against the other worker's), and the objects alive after collection
    (some 750k in a worker) are frozen out of the garbage collector's passes: a sampling test's many small
    steps spent a quarter of their time re-scanning them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    before = torch.get_num_threads()
    if workers * before > cpus:
        torch.set_num_threads(max(1, cpus // workers))
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _isolated_augur_home(tmp_path_factory):
    """Nothing in the tests may build into (or read from) the user's real Augur cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AUGUR_HOME", str(tmp_path_factory.mktemp("augur-home-session")))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _float32_by_default():
    """Tests compare with transformers in float32: keep ``dtype=auto`` at float32 even on CPUs whose
    bf16 units would make it bfloat16 (tests of that choice patch it back)."""
    import engine.config

    mp = pytest.MonkeyPatch()
    mp.setattr(engine.config, "cpu_has_bf16_units", lambda: False)
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _a_gpu_shared_by_workers():
    """In several pytest-xdist workers on one GPU (loadtest/gpu_checks.sh), an engine that sizes its KV
    pool from the free memory would take most of the GPU and leave the other workers' engines none:
    each worker's engines size theirs from a share of it, as several servers on one GPU are set up."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    mp = pytest.MonkeyPatch()
    if torch.cuda.is_available() and workers > 1:
        import engine.runner.model_runner as model_runner

        free = model_runner.available_memory_bytes
        share = lambda device: free(device) // (2 * workers) if device.type == "cuda" else free(device)  # noqa: E731
        mp.setattr(model_runner, "available_memory_bytes", share)
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _eager_by_default():
    """Compiling every test engine would take minutes: ``compile=auto`` means eager in the tests
    (servers they start inherit it); the compiled path has tests of its own that ask for it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AUGUR_COMPILE", "off")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module that runs servers (or many tiny steps) on this 2-core box: a second OpenMP thread
    only spins against the first, the event loop and the engine thread, making every step many times
    slower. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


def tiny_config(arch: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        architectures=[arch],
    )
    common.update(overrides)
    if arch == "LlamaForCausalLM":
        common.setdefault(
            "rope_parameters",
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        return transformers.LlamaConfig(**common)
    if arch == "Qwen2ForCausalLM":
        common.setdefault("tie_word_embeddings", True)
        return transformers.Qwen2Config(**common)
    if arch == "Qwen3ForCausalLM":
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    if arch == "MistralForCausalLM":
        common.setdefault("sliding_window", 24)
        return transformers.MistralConfig(**common)
    raise ValueError(arch)


def hf_causal_lm(model_dir, **kw):
    """transformers' causal LM of a checkpoint: AutoModelForCausalLM's, or the class its config names where
    that mapping has none (Mistral 4's)."""
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
    arch = transformers.AutoConfig.from_pretrained(model_dir).architectures[0]
    return getattr(transformers, arch).from_pretrained(model_dir, **kw)


def build_model_dir(path: Path, tokenizer_dir: Path, arch: str, seed: int = 0, std: float = 0.08, **overrides) -> Path:
    """Save a random-weight model with the test tokenizer as a standard Hugging Face directory."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.normal_(
                    1.0 if p.shape[0] == config.hidden_size or p.shape[0] == getattr(config, "head_dim", -1) else 0.0,
                    0.05,
                )
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """One tiny model directory per supported architecture."""
    return {arch: build_model_dir(tmp_path_factory.mktemp(arch), tokenizer_dir, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory) -> Path:
    """The embedded demo pair, built at its tiny size through the real build path (about 20 s)."""
    from engine.offline.demo import DemoRecipe, build_demo

    return build_demo(tmp_path_factory.mktemp("augur-home") / "demo", DemoRecipe.tiny(), device="cpu")


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["LlamaForCausalLM"]


def pytest_runtest_logreport(report):
    """With ``AUGUR_FAILURE_LOG=FILE``, each failure's traceback is appended to FILE as it happens: a run
    cut short by an outer time limit (a lent GPU's minutes, loadtest/gpu_checks.sh) keeps what failed
    and why, where pytest's summary comes only at the end."""
    path = os.environ.get("AUGUR_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")


# The slowest files, slowest first (from a full run's junit XML on 2 cores of an AVX2-only EPYC, kernels
# and compiler caches cold, 2026-12-02): the workers take them first, so the run does not end with one
# worker on a long file and the other idle (pytest-xdist would order the files by their number of tests;
# the Makefile asks it not to).
SLOWEST_FIRST = (
    "test_batch_invariance", "test_tensor_parallel", "test_compile", "test_eagle", "test_first_run", "test_dflash",
    "test_chain_levels", "test_spec", "test_cuda_graphs", "test_attention_backends", "test_moe", "test_ouroboros",
    "test_fused", "test_structured", "test_peers", "test_bench_suite", "test_engine_process", "test_lora",
    "test_nextn", "test_staging", "test_mtp", "test_auto", "test_bench_gpu", "test_early_stop", "test_bench_quant",
    "test_medusa", "test_run_ahead", "test_gemma2", "test_loading", "test_tune_layer_skip", "test_configs",
    "test_layer_skip",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # (stable: a file's own order holds)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- clients of a module's live server (a module that uses them defines its own ``srv``) ------------------
@pytest.fixture(scope="module")
def client(srv) -> Iterator[openai.OpenAI]:
    """The official SDK against the module's server."""
    with openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(srv) -> Iterator[httpx.Client]:
    """Raw HTTP against the module's server."""
    with httpx.Client(base_url=srv.base, timeout=120) as c:
        yield c

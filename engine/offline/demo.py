"""The embedded demo pair: a target and a draft model Augur trains itself, with nothing downloaded.

Machines without internet access can still run Augur, and tests and benchmarks need a target/draft
pair whose draft really predicts the target (random weights accept nothing). So Augur trains one,
deterministically, on text every Python installation has: the standard library's own source files.

Recipe (one :class:`DemoRecipe`; its hash keys the cache, so a second build is instant):

1. *Corpus*: every ``*.py`` under ``sysconfig``'s stdlib path, split by file (a stable hash of the
   relative path) into train and held-out sets, so held-out numbers are on code the models never saw.
2. *Tokenizer*: byte-level BPE (``tokenizers``), with bos/eos/pad and chat-role special tokens and a
   chat template, saved in Hugging Face format.
3. *Target*: a Llama-architecture model pretrained on the train split (next-token cross-entropy),
   optionally fine-tuned against repeating itself (``unlikelihood_steps``). Its pretraining is cached
   (:func:`pretrain_cache`): a recipe that changes only later phases starts from it.
4. *Draft*: a Llama model with fewer layers and at least 4x fewer parameters (at this size the
   embedding table is most of a draft's parameters, while on a CPU its forward costs by the layer),
   distilled from the target: trained to
   minimize KL(target || draft) on the train split, so its predictions follow the target's (which is
   what the acceptance rate of speculative decoding measures), not just the data.
5. *Report*: parameter counts, held-out perplexities, and the draft's greedy top-1 agreement with the
   target on held-out text (an upper bound on the greedy acceptance rate).

Everything is saved as standard Hugging Face directories under ``$AUGUR_HOME/demo`` (default
``~/.cache/augur/demo``): ``target/``, ``draft/``, ``prompts.jsonl`` and ``report.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.assets import shipped_demo
from engine.offline.draft_training import lr_at
from engine.offline.muon import optimizers
from engine.platform import CpuThreads, cpu_has_bf16_units

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the demo pair. Changing any field changes the cache key."""

    seed: int = 0
    vocab_size: int = 4096
    heldout_every: int = 20  # one file in N (by a stable hash of its path) is held out
    max_train_chars: int = 32_000_000  # of the train split, in stable-hash order; bounds tokenization time
    # Generated files, not written code: codec tables (thousands of near-identical table lines) and
    # pydoc's topic strings. Left out of both splits.
    exclude: tuple[str, ...] = ("encodings/", "pydoc_data/")
    tokenizer_train_chars: int = 3_000_000
    seq_len: int = 512
    batch_size: int = 8
    target: ModelShape = ModelShape(hidden=320, layers=6, heads=5, kv_heads=1, ffn=864)
    draft: ModelShape = ModelShape(hidden=192, layers=2, heads=3, kv_heads=1, ffn=512)
    target_steps: int = 2200
    target_lr: float = 3e-3  # AdamW: embeddings (tied with the output head) and norm gains
    target_muon_lr: float = 0.04  # Muon: the blocks' weight matrices (engine/offline/muon.py)
    # Unlikelihood fine-tune of the target (Welleck et al., 2019, at the sequence level): it continues
    # train-text prefixes greedily, and tokens of 4-grams the continuation repeats have their
    # probability pushed down (loss -log(1 - p)), beside the usual next-token loss; fewer greedy loops.
    unlikelihood_steps: int = 300  # docs/demo.md has what 150 and 300 steps of each variant did
    unlikelihood_alpha: float = 1.0  # weight of the unlikelihood term against next-token cross-entropy
    unlikelihood_lr_scale: float = 0.1  # of the target's peak learning rates (warm-up, then cosine decay)
    unlikelihood_prefix: int = 96  # tokens of train text each continuation starts from
    unlikelihood_tokens: int = 64  # tokens continued greedily
    # Weight of KL(pretrained target || target) beside the next-token loss: the fine-tune pushes down
    # what the continuations repeat and keeps the rest of the pretrained distribution (0: no anchor).
    unlikelihood_kl: float = 0.3
    # Every other step continues the first 2-16 tokens of a train file instead of a window from its
    # middle: file heads (a lone `import os`) are where a small model loops most.
    unlikelihood_file_heads: bool = False
    draft_steps: int = 1600
    draft_lr: float = 3e-3
    draft_muon_lr: float = 0.03
    warmup_frac: float = 0.06
    eval_seqs: int = 32  # held-out windows of seq_len for perplexity and agreement
    quality_prompts: int = 16  # held-out prompts continued greedily for the degenerate-output rate
    quality_tokens: int = 128
    num_prompts: int = 64
    prompt_chars: tuple[int, int] = (100, 320)  # a prompt plus 128 generated tokens stays near seq_len
    max_position_embeddings: int = 2048
    notes: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def tiny(cls) -> DemoRecipe:
        """The same code path at a size that builds in well under a minute (tests, CI)."""
        return cls(
            vocab_size=512,
            max_train_chars=400_000,
            tokenizer_train_chars=200_000,
            seq_len=64,
            batch_size=8,
            target=ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256),
            draft=ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64),
            target_steps=30,
            unlikelihood_steps=4,
            unlikelihood_prefix=16,
            unlikelihood_tokens=8,
            unlikelihood_kl=0.5,
            unlikelihood_file_heads=True,  # off in the shipped recipe: tested here
            draft_steps=30,
            eval_seqs=8,
            quality_prompts=4,
            quality_tokens=16,
            num_prompts=8,
            prompt_chars=(40, 120),
            max_position_embeddings=512,
        )

    @classmethod
    def from_dict(cls, d: dict) -> DemoRecipe:
        """The recipe a build's ``recipe.json`` records (its ``recipe`` object)."""
        d = dict(d)
        for shape in ("target", "draft"):
            d[shape] = ModelShape(**d[shape])
        for pair in ("exclude", "prompt_chars"):
            d[pair] = tuple(d[pair])
        return cls(**d)

    def cache_key(self) -> str:
        """Hash of the recipe, the Python version (whose stdlib is the corpus) and the torch version."""
        d = dataclasses.asdict(self)
        d.pop("notes")
        d["python"] = platform.python_version()
        d["torch"] = torch.__version__.split("+")[0]
        d["format"] = 2
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def augur_home() -> Path:
    return Path(os.environ.get("AUGUR_HOME") or Path.home() / ".cache" / "augur").expanduser()


def demo_dir() -> Path:
    return augur_home() / "demo"


PRETRAIN_FIELDS = ("seed", "vocab_size", "heldout_every", "max_train_chars", "exclude", "tokenizer_train_chars",
                   "seq_len", "batch_size", "target", "target_steps", "target_lr", "target_muon_lr", "warmup_frac",
                   "max_position_embeddings")  # fmt: skip


def pretrain_cache(recipe: DemoRecipe) -> Path:
    """Where the target's pretraining (its first and longest phase, bf16-rounded) is kept, keyed by
    the recipe fields that determine it: a recipe that changes only later phases starts from it."""
    d = dataclasses.asdict(recipe)
    d = {k: d[k] for k in PRETRAIN_FIELDS}
    d["python"] = platform.python_version()
    d["torch"] = torch.__version__.split("+")[0]
    key = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return augur_home() / "demo-pretrained" / key


def save_pretrained_phase(target, path: Path, phase: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # A bf16 copy is saved: rounding the model itself would round its float32 buffers too (RoPE's
    # inverse frequencies), which a model loaded from the cache does not have.
    copy.deepcopy(target).to(SHIPPED_DTYPE).save_pretrained(tmp)
    (tmp / "phase.json").write_text(json.dumps(phase) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def is_built(out: Path, recipe: DemoRecipe) -> bool:
    marker = out / "recipe.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("cache_key") == recipe.cache_key()
    except (OSError, ValueError):
        return False


# -- corpus -----------------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def split_corpus(recipe: DemoRecipe) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(name, text) pairs of the train and held-out files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in stdlib_files():
        name = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or name.startswith(recipe.exclude):
            continue
        bucket = int(hashlib.md5(name.encode()).hexdigest(), 16) % recipe.heldout_every
        (heldout if bucket == 0 else train).append((name, text))
    # The train budget is taken in a stable pseudo-random file order, so it covers the whole library
    # (alphabetical order stopped in test/, while the held-out files are drawn from everywhere).
    train.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
    total = 0
    kept = []
    for name, text in train:
        if total >= recipe.max_train_chars:
            break
        kept.append((name, text))
        total += len(text)
    return kept, heldout


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and joined, each file followed by EOS: [N] int64."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    flat = [t for seq in ids for t in (*seq, eos)]
    return torch.tensor(flat, dtype=torch.int64)


# -- models ---------------------------------------------------------------------------------------------
def llama_config(shape: ModelShape, tokenizer, recipe: DemoRecipe):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


# The draft has at least this many times fewer parameters than its target. At the demo's size the
# vocabulary's embedding table is half of the shipped draft's parameters, and on a CPU a forward
# costs by the layer more than by the width, so the ratio of layers matters more (docs/demo.md).
MIN_PARAM_RATIO = 4
SHIPPED_DTYPE = torch.bfloat16  # the pair is saved (and shipped in the repository) in bf16


@torch.no_grad()
def round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round a model's weights to ``dtype``'s precision in place (kept in their own dtype), so what is
    measured is what is saved."""
    for p in model.parameters():
        p.copy_(p.to(dtype))


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weights_sha256(out: Path) -> dict[str, str]:
    """The SHA-256 of each model's weights file in a built pair: the report names the weights it measured."""
    return {
        name: hashlib.sha256((out / name / "model.safetensors").read_bytes()).hexdigest()
        for name in ("target", "draft")
    }


def _bf16_autocast_ok(device: torch.device) -> bool:
    """bf16 autocast pays on GPUs and on CPUs with bf16 matrix units; elsewhere it is slower."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_bf16_units()


def _batches(stream: torch.Tensor, recipe: DemoRecipe, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = stream.numel() - recipe.seq_len - 1
    starts = torch.randint(0, n, (steps, recipe.batch_size), generator=g)
    offsets = torch.arange(recipe.seq_len + 1)
    return [stream[s[:, None] + offsets] for s in starts]


def _train(
    model, batches, lrs: tuple[float, float], recipe: DemoRecipe, device, loss_fn, desc: str, progress
) -> list[float]:
    """``lrs``: the peak learning rates of AdamW (embeddings, norms) and Muon (the blocks' matrices)."""
    autocast = _bf16_autocast_ok(device)
    opts = optimizers(model, *lrs, ns_dtype=torch.bfloat16 if autocast else torch.float32)
    losses = []
    model.train()
    cpu_threads = CpuThreads() if device.type == "cpu" else None  # threads follow the CPUs left free
    for step, batch in enumerate(batches):
        if cpu_threads is not None and (threads := cpu_threads.poll()) is not None:
            torch.set_num_threads(threads)
        for opt, peak in opts:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, len(batches), peak, recipe.warmup_frac)
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt, _ in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
        progress.update(1)
        progress.set_postfix_str(f"{desc} loss {losses[-1]:.3f}")
    model.eval()
    return losses


def _lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _distill_loss(target):
    def loss(model, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            p_log = torch.log_softmax(target(input_ids=inputs).logits.float(), -1)  # p: target
        q_log = torch.log_softmax(model(input_ids=inputs).logits.float(), -1)  # q: draft
        return torch.nn.functional.kl_div(q_log, p_log, log_target=True, reduction="batchmean") / inputs.shape[1]

    return loss


UNLIKELIHOOD_NGRAM = 4  # a continuation's token is penalised where it completes a 4-gram seen before it


def repeated_ngrams(rows: list[list[int]], start: int, n: int = UNLIKELIHOOD_NGRAM) -> torch.Tensor:
    """``[B, L]`` bool: the positions from ``start`` on that belong to an ``n``-gram which occurred
    earlier in the same row (the prefix included)."""
    mask = torch.zeros(len(rows), len(rows[0]), dtype=torch.bool)
    for b, row in enumerate(rows):
        seen: set[tuple[int, ...]] = set()
        for i in range(n - 1, len(row)):
            gram = tuple(row[i - n + 1 : i + 1])
            if i >= start and gram in seen:
                mask[b, max(start, i - n + 1) : i + 1] = True
            seen.add(gram)
    return mask


def _anchored_lm_loss(model, batch: torch.Tensor, reference, weight: float) -> torch.Tensor:
    """Next-token cross-entropy, plus ``weight`` times KL(reference || model) on the same positions."""
    inputs = batch[:, :-1]
    logits = model(input_ids=inputs).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    if reference is None or not weight:
        return ce
    with torch.no_grad():
        p_log = torch.log_softmax(reference(input_ids=inputs).logits.float(), -1)  # p: the pretrained target
    q_log = torch.log_softmax(logits, -1)  # q: the target being fine-tuned
    kl = torch.nn.functional.kl_div(q_log, p_log, log_target=True, reduction="batchmean") / inputs.shape[1]
    return ce + weight * kl


HEAD_TOKENS = 16  # the longest file head the unlikelihood phase continues


def file_heads(stream: torch.Tensor, eos_token_id: int, min_len: int = HEAD_TOKENS) -> torch.Tensor:
    """Where each file of ``stream`` (files joined by EOS) starts, for files of at least ``min_len``
    tokens: [F] int64."""
    ends = (stream == eos_token_id).nonzero().flatten()
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1] + 1])
    return starts[ends - starts >= min_len]


def _unlikelihood_loss(stream: torch.Tensor, recipe: DemoRecipe, pad_token_id: int, eos_token_id: int, seed: int,
                       reference=None):  # fmt: skip
    """Next-token cross-entropy on the train batch (anchored to ``reference``, the pretrained target,
    by ``unlikelihood_kl``) plus ``alpha`` times the unlikelihood of the tokens the model's own greedy
    continuations of 8 train prefixes repeat (windows, and with ``unlikelihood_file_heads`` every other
    step the first tokens of files)."""
    g = torch.Generator().manual_seed(seed)
    P, T = recipe.unlikelihood_prefix, recipe.unlikelihood_tokens
    file_starts = file_heads(stream, eos_token_id)
    steps = [0]

    def loss(model, batch: torch.Tensor) -> torch.Tensor:
        heads = recipe.unlikelihood_file_heads and steps[0] % 2 == 1 and len(file_starts) > 0
        steps[0] += 1
        if heads:  # the first n tokens of 8 files
            n = int(torch.randint(2, HEAD_TOKENS + 1, (1,), generator=g))
            starts = file_starts[torch.randint(0, len(file_starts), (8,), generator=g)]
        else:  # windows from anywhere
            n = P
            starts = torch.randint(0, stream.numel() - P - 1, (8,), generator=g)
        prefix = torch.stack([stream[int(s) : int(s) + n] for s in starts]).to(batch.device)
        model.eval()
        with torch.no_grad():
            out = model.generate(
                prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=T, min_new_tokens=T,
                do_sample=False, pad_token_id=pad_token_id,
            )  # fmt: skip
        model.train()
        repeated = repeated_ngrams(out.tolist(), n)[:, 1:].to(batch.device)
        logp = torch.log_softmax(model(input_ids=out[:, :-1]).logits.float(), -1)
        p = logp.gather(-1, out[:, 1:, None])[..., 0].exp().clamp(max=1 - 1e-5)
        unlikely = -(torch.log1p(-p) * repeated).sum() / repeated.sum().clamp(min=1)
        base = _anchored_lm_loss(model, batch, reference, recipe.unlikelihood_kl)
        return base + recipe.unlikelihood_alpha * unlikely

    return loss


@torch.no_grad()
def evaluate(target, draft, windows: torch.Tensor, device) -> dict:
    """Held-out perplexities and the draft's greedy top-1 agreement with the target."""
    nll_t = nll_d = 0.0
    agree = total = 0
    for i in range(0, windows.shape[0], 8):
        batch = windows[i : i + 8].to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        lt = target(input_ids=inputs).logits.float()
        ld = draft(input_ids=inputs).logits.float()
        nll_t += torch.nn.functional.cross_entropy(lt.flatten(0, 1), labels.flatten(), reduction="sum").item()
        nll_d += torch.nn.functional.cross_entropy(ld.flatten(0, 1), labels.flatten(), reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        total += labels.numel()
    return {
        "target_perplexity": math.exp(nll_t / total),
        "draft_perplexity": math.exp(nll_d / total),
        "draft_target_top1_agreement": agree / total,
        "eval_tokens": total,
    }


LOOP_MAX_PERIOD = 8  # tokens in the longest repeating unit the degenerate-output check looks for
LOOP_MIN_FRACTION = 0.25  # of the continuation a loop must cover to make it degenerate


def loop_coverage(tokens: list[int], max_period: int = LOOP_MAX_PERIOD) -> int:
    """The most tokens covered by one back-to-back repetition of a unit of at most ``max_period``
    tokens (``x x x x``, ``self. self. self.``): 0 when nothing repeats."""
    best = 0
    for period in range(1, max_period + 1):
        run = 0  # positions i with tokens[i] == tokens[i - period], consecutively
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run:
                best = max(best, run + period)
    return best


def is_degenerate(tokens: list[int]) -> bool:
    """A continuation collapsed into a short loop: one unit of at most 8 tokens, repeated back to back,
    covers at least a quarter of it."""
    return bool(tokens) and loop_coverage(tokens) >= LOOP_MIN_FRACTION * len(tokens)


@torch.no_grad()
def greedy_quality(target, tokenizer, prompts: list[dict], max_tokens: int, device) -> dict:
    """Greedy continuations of held-out prompts: how many collapse into a loop, and a few examples
    (what a newcomer's first request shows)."""
    degenerate, samples = 0, []
    for p in prompts:
        ids = torch.tensor([tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]], device=device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = out[0, ids.shape[1] :].tolist()
        degenerate += is_degenerate(new)
        if len(samples) < 3:
            samples.append({"prompt": p["prompt"], "continuation": tokenizer.decode(new)})
    return {
        "greedy_degenerate_rate": degenerate / max(1, len(prompts)),
        "greedy_prompts": len(prompts),
        "greedy_tokens": max_tokens,
        "greedy_samples": samples,
    }


def make_prompts(heldout: list[tuple[str, str]], recipe: DemoRecipe) -> list[dict]:
    """Code prefixes from held-out files: a file's opening lines, cut at a line end."""
    g = torch.Generator().manual_seed(recipe.seed + 1)
    lo, hi = recipe.prompt_chars
    prompts = []
    order = torch.randperm(len(heldout), generator=g).tolist()
    for idx in order:
        name, text = heldout[idx]
        if len(text) < hi * 2:
            continue
        want = int(torch.randint(lo, hi + 1, (1,), generator=g))
        start = 0
        # Skip the module docstring / license header when there is one, so prompts are code.
        for marker in ("\nimport ", "\nfrom ", "\ndef ", "\nclass "):
            pos = text.find(marker)
            if 0 <= pos < len(text) - hi:
                start = pos + 1
                break
        cut = text.rfind("\n", start, start + want)
        if cut <= start:
            continue
        prompts.append({"prompt": text[start : cut + 1], "source": name})
        if len(prompts) == recipe.num_prompts:
            break
    return prompts


# -- the build ------------------------------------------------------------------------------------------
def build_demo(
    out: Path | None = None,
    recipe: DemoRecipe | None = None,
    device: str = "auto",
    force: bool = False,
    reuse_pretraining: bool = True,
):
    """Build (or find cached) the demo pair in ``out``; returns ``out``. ``reuse_pretraining``: start
    from this recipe's pretrained target if an earlier build on this machine left it
    (:func:`pretrain_cache`)."""
    out = Path(out) if out is not None else demo_dir()
    recipe = recipe or DemoRecipe()
    if not force and is_built(out, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same pair
        if not force and is_built(out, recipe):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            _build_into(tmp, recipe, device, reuse_pretraining)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_into(out: Path, recipe: DemoRecipe, device_name: str, reuse_pretraining: bool = True) -> None:
    import transformers
    from tqdm import tqdm

    t_start = time.perf_counter()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device_name == "auto" else device_name)
    total = recipe.target_steps + recipe.unlikelihood_steps + recipe.draft_steps
    progress = tqdm(total=total, desc="augur demo build", unit="step", file=sys.stderr, dynamic_ncols=True)
    progress.set_postfix_str("tokenizer")

    train, heldout = split_corpus(recipe)
    tok_texts, n = [], 0
    for _, text in train:
        if n >= recipe.tokenizer_train_chars:
            break
        tok_texts.append(text)
        n += len(text)
    tokenizer = train_tokenizer(tok_texts, recipe.vocab_size)
    train_stream = token_stream(tokenizer, [t for _, t in train])
    heldout_stream = token_stream(tokenizer, [t for _, t in heldout])

    torch.manual_seed(recipe.seed)
    target = transformers.LlamaForCausalLM(llama_config(recipe.target, tokenizer, recipe)).to(dev)
    torch.manual_seed(recipe.seed + 1)
    draft = transformers.LlamaForCausalLM(llama_config(recipe.draft, tokenizer, recipe)).to(dev)
    if num_params(target) < MIN_PARAM_RATIO * num_params(draft) or recipe.draft.layers >= recipe.target.layers:
        raise ValueError(
            f"the recipe's draft must have fewer layers and {MIN_PARAM_RATIO}x fewer parameters than its target"
        )

    t0 = time.perf_counter()
    pretrained = pretrain_cache(recipe)
    if reuse_pretraining and (pretrained / "phase.json").is_file():  # done before on this machine
        phase = json.loads((pretrained / "phase.json").read_text())
        state = transformers.LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32).state_dict()
        target.load_state_dict(state)
        progress.update(recipe.target_steps)
    else:
        losses = _train(
            target,
            _batches(train_stream, recipe, recipe.target_steps, recipe.seed + 2),
            (recipe.target_lr, recipe.target_muon_lr),
            recipe,
            dev,
            _lm_loss,
            "target",
            progress,
        )
        round_to(target, SHIPPED_DTYPE)
        phase = {"final_train_loss": sum(losses[-5:]) / len(losses[-5:]), "seconds": time.perf_counter() - t0}
        save_pretrained_phase(target, pretrained, phase)
    target_pretrain_seconds = time.perf_counter() - t0
    if recipe.unlikelihood_steps:  # from the rounded weights, with fresh optimizers
        ul = recipe.unlikelihood_lr_scale
        reference = copy.deepcopy(target).requires_grad_(False).eval() if recipe.unlikelihood_kl else None
        mle = dataclasses.replace(recipe, batch_size=4)  # the next-token half of each step: 4 windows
        _train(
            target,
            _batches(train_stream, mle, recipe.unlikelihood_steps, recipe.seed + 5),
            (recipe.target_lr * ul, recipe.target_muon_lr * ul),
            recipe,
            dev,
            _unlikelihood_loss(
                train_stream, recipe, tokenizer.pad_token_id, tokenizer.eos_token_id, recipe.seed + 6, reference
            ),  # fmt: skip
            "unlikelihood",
            progress,
        )
    t1 = time.perf_counter()
    target.requires_grad_(False)
    round_to(target, SHIPPED_DTYPE)  # the draft distils from, and the report measures, the weights shipped
    draft_losses = _train(
        draft,
        _batches(train_stream, recipe, recipe.draft_steps, recipe.seed + 3),
        (recipe.draft_lr, recipe.draft_muon_lr),
        recipe,
        dev,
        _distill_loss(target),
        "draft",
        progress,
    )
    t2 = time.perf_counter()
    round_to(draft, SHIPPED_DTYPE)
    progress.set_postfix_str("evaluating")
    windows = _batches(heldout_stream, dataclasses.replace(recipe, batch_size=recipe.eval_seqs), 1, recipe.seed + 4)[0]
    metrics = evaluate(target, draft, windows, dev)
    prompts = make_prompts(heldout, recipe)
    quality = greedy_quality(target, tokenizer, prompts[: recipe.quality_prompts], recipe.quality_tokens, dev)
    progress.close()

    for name, model in (("target", target), ("draft", draft)):
        d = out / name
        model.to(SHIPPED_DTYPE).cpu().save_pretrained(d)
        tokenizer.save_pretrained(d)
        transformers.GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(d)
    with open(out / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")

    report = {
        "cache_key": recipe.cache_key(),
        "target_params": num_params(target),
        "draft_params": num_params(draft),
        "param_ratio": num_params(target) / num_params(draft),
        **metrics,
        **quality,
        "target_final_train_loss": phase["final_train_loss"],
        "draft_final_distill_kl": sum(draft_losses[-5:]) / len(draft_losses[-5:]),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_tokens": int(train_stream.numel()),
        "tokens_seen_by_target": recipe.target_steps * recipe.batch_size * recipe.seq_len,
        "device": str(dev),
        "bf16_autocast": _bf16_autocast_ok(dev),
        "weights_dtype": str(SHIPPED_DTYPE).removeprefix("torch."),
        "weights_sha256": weights_sha256(out),
        "seconds": {
            "data_and_tokenizer": round(t0 - t_start, 1),
            # Pretraining as it ran when it was done (this build may have found it done: cached).
            "target_pretraining": round(phase["seconds"], 1),
            "target_pretraining_cached": target_pretrain_seconds < 0.5 * phase["seconds"],
            "target": round(t1 - t0, 1),
            "draft": round(t2 - t1, 1),
            "evaluation": round(time.perf_counter() - t2, 1),
            "total": round(time.perf_counter() - t_start, 1),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "recipe.json").write_text(
        json.dumps({"cache_key": recipe.cache_key(), "recipe": dataclasses.asdict(recipe)}, indent=2) + "\n"
    )


def format_report(report: dict) -> str:
    return "\n".join(
        [
            f"target: {report['target_params'] / 1e6:.1f}M parameters, held-out perplexity "
            f"{report['target_perplexity']:.2f}",
            f"draft:  {report['draft_params'] / 1e6:.2f}M parameters ({report['param_ratio']:.1f}x fewer), "
            f"held-out perplexity {report['draft_perplexity']:.2f}",
            f"draft/target greedy top-1 agreement on held-out text: {report['draft_target_top1_agreement']:.3f}",
            f"built in {report['seconds']['total']:.0f}s on {report['device']}",
        ]
    )


def ensure_demo(recipe: DemoRecipe | None = None) -> Path:
    """The demo pair's directory: the pair shipped in the package (engine/assets/demo), or where a
    checkout lacks it, a build of ``recipe`` (with a progress bar; cached)."""
    shipped = shipped_demo()
    if shipped is not None and recipe is None:
        return shipped
    out = demo_dir()
    recipe = recipe or DemoRecipe()
    if not is_built(out, recipe):
        print("The shipped demo pair is missing: building it (about an hour on a 2-core CPU)...", file=sys.stderr)
        build_demo(out, recipe)
        print(format_report(json.loads((out / "report.json").read_text())), file=sys.stderr)
    return out


# -- does a build reproduce the shipped pair? -------------------------------------------------------------
# How far a rebuild's numbers may be from the reference's and still match it. A rebuild on another CPU
# (another thread count, bf16 units or not, another Python's standard library as corpus) is not
# bit-identical; these bounds are wider than that noise, and far narrower than a broken recipe's miss.
CHECK_TOLERANCES: dict[str, tuple[str, float]] = {
    "target_params": ("exact", 0),
    "draft_params": ("exact", 0),
    "target_perplexity": ("relative", 0.05),
    "draft_perplexity": ("relative", 0.05),
    "draft_target_top1_agreement": ("absolute", 0.03),
    "greedy_degenerate_rate": ("absolute", 0.1875),  # 3 of the 16 held-out prompts
}


def compare_reports(reference: dict, built: dict) -> list[str]:
    """Each of :data:`CHECK_TOLERANCES`' numbers on which ``built`` misses ``reference``, as a line
    naming both values; empty when the build reproduces the reference."""
    misses = []
    for key, (kind, tol) in CHECK_TOLERANCES.items():
        want, got = reference[key], built[key]
        off = abs(got - want) / abs(want) if kind == "relative" else abs(got - want)
        if off > tol:
            bound = (
                "must be equal" if kind == "exact" else f"allowed {tol:g}{' relative' if kind == 'relative' else ''}"
            )
            misses.append(f"{key}: built {got:.4g}, reference {want:.4g} ({bound})")
    return misses


def check_build(reference: Path, device: str = "auto", force: bool = False) -> tuple[Path, list[str], list[str]]:
    """Rebuild the pair in ``reference`` from its own ``recipe.json`` (into the cache, under
    :func:`demo_dir`'s parent as ``demo-check``) and compare the two reports: (the build's
    directory, the misses, notes on what differs about the machine)."""
    recorded = json.loads((reference / "recipe.json").read_text())
    recipe = DemoRecipe.from_dict(recorded["recipe"])
    # Every phase runs again: the check is of the whole recipe, pretraining included.
    out = build_demo(demo_dir().parent / "demo-check", recipe, device=device, force=force, reuse_pretraining=False)
    ref_report = json.loads((reference / "report.json").read_text())
    built_report = json.loads((out / "report.json").read_text())
    notes = [
        f"{key}: built with {built_report.get(key)}, reference with {ref_report.get(key)}"
        for key in ("python", "torch", "device", "bf16_autocast")
        if built_report.get(key) != ref_report.get(key)
    ]
    return out, compare_reports(ref_report, built_report), notes

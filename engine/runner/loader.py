"""Finding and loading Hugging Face checkpoints: a local directory, or a hub id already in the local cache.

Nothing is ever downloaded: a hub id that is not cached is a clear error naming it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.attention.cpu_kernel import load_cpu_kernel
from engine.models import TEXT_TOWERS, model_class_for
from engine.models.invariant import load_invariant_kernels
from engine.models.moe import has_experts
from engine.models.packed import MIN_PACKED_BYTES, linear_weight_bytes, packing_supported
from engine.models.small_linear import SmallRowsLinear, small_rows_serve
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel
from engine.quant import QUANTIZATIONS
from engine.quant.checkpoint import checkpoint_format
from engine.quant.fp8 import fp8_layer, install_checkpoint_fp8, quantize_linears_fp8
from engine.quant.int4 import install_checkpoint_int4, int4_layer, quantize_linears_int4
from engine.quant.nf4 import (
    BNB_SUFFIXES,
    QUANT_STATE_PREFIX,
    NF4Linear,
    bnb_quantization_kind,
    fuse_nf4,
    nf4_from_bnb,
    quantize_nf4,
)
from engine.quant.streamed import StreamedLayers


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(model: str) -> Path:
    """A local directory as is; otherwise a hub id looked up offline in the Hugging Face cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory?")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model directory not found: {model}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # Read the cache location now, not when huggingface_hub was imported.
    cache_dir = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(model, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"model {model!r} is neither a local directory nor in the local Hugging Face cache ({cache_dir}); "
            "Augur never downloads weights: download it first or pass a directory"
        ) from e


def load_config(path: Path):
    """The checkpoint's config. A multimodal checkpoint served as text only (its architecture one of
    ``engine.models.TEXT_TOWERS``) gives its text model's config, so that what the engine reads
    (vocabulary, hidden size, heads, positions, EOS ids) is the decoder's; it keeps the checkpoint's ``architectures``
    (the registry serves them with a text-tower class, which knows the checkpoint's weight names)
    and its top-level ``eos_token_id`` where it sets one (the chat turn's end, for instance)."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = list(getattr(config, "architectures", None) or [])
    if TEXT_TOWERS.isdisjoint(archs):
        return config
    text = config.get_text_config()
    text.architectures = archs
    if getattr(config, "eos_token_id", None) is not None:
        text.eos_token_id = config.eos_token_id
    if getattr(config, "quantization_config", None) and not getattr(text, "quantization_config", None):
        text.quantization_config = config.quantization_config  # (an FP8 or GPTQ checkpoint's, at its top level)
    if _weight_files(path):  # the output layer is the embedding's unless the checkpoint has its own, as
        # transformers loads it (the top level's tie_word_embeddings, True by default, is dropped where
        # the checkpoint carries a head: Mistral Small 3.1's; a text config's own flag is not read)
        text.tie_word_embeddings = not any(k in TextTower.head_names for k in checkpoint_keys(path))
    return text


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eos_token_ids(path: Path, config, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, the model config and the tokenizer, merged."""
    ids: list[int] = []

    def add(v) -> None:
        if v is None:
            return
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if int(x) not in ids:
                ids.append(int(x))

    if (path / "generation_config.json").is_file():
        add(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


# generation_config.json's sampling fields, by the request field each is a default for (vLLM's set).
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(path: Path) -> dict:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets (by request field name):
    those present in the file itself, not transformers' class defaults."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key, field in GENERATION_DEFAULTS.items():
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    return out


def _weight_files(path: Path, tensor: str | None = None) -> list[Path]:
    """The checkpoint's safetensors files (a sharded one's from its index), or the one that holds
    ``tensor`` where the index says which."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():  # (Mistral's repositories also carry their own layout's consolidated.safetensors)
        return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))
    weight_map = json.loads(index.read_text())["weight_map"]
    return [path / weight_map[tensor]] if tensor is not None else [path / f for f in sorted(set(weight_map.values()))]


def iter_safetensors(
    path: Path, select: Callable[[str], object] | None = None, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one file at a time (sharded checkpoints follow their index).
    ``select(name)`` (a tensor-parallel rank's ``checkpoint_slice``) may ask for a slice of a tensor,
    ``(dim, start, length)``, read alone from the file, or ``"zeros"`` in its shape. A tensor that
    ``skip(name)`` names is not read (a model's ``checkpoint_skips``: parts of a checkpoint it does not
    serve, such as GLM-4.5's multi-token-prediction layer)."""
    files = _weight_files(path)
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path}")
    seen: dict[str, str] = {}  # tensor → its file: a stray second copy of the weights is an error, not a reload
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in seen:
                    raise ValueError(
                        f"{path}: tensor {key} is in both {seen[key]} and {file.name}; without a "
                        "model.safetensors.index.json every *.safetensors file is read as part of the weights"
                    )
                seen[key] = file.name
                if skip is not None and skip(key):
                    continue
                part = select(key) if select is not None else None
                if part is None:
                    yield key, f.get_tensor(key)
                elif part == "zeros":
                    yield key, f.get_tensor(key).zero_()
                else:
                    dim, start, length = part
                    yield key, f.get_slice(key)[(slice(None),) * dim + (slice(start, start + length),)]


def take_slice(tensor: torch.Tensor, part) -> torch.Tensor:
    """A tensor already in memory cut as ``iter_safetensors`` cuts one read from a file (``part``: a
    rank's ``checkpoint_slice``)."""
    if part is None:
        return tensor
    if part == "zeros":
        return torch.zeros_like(tensor)
    dim, start, length = part
    return tensor.narrow(dim, start, length)


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of the checkpoint, whole (a tensor-parallel rank 0's copy of a sharded table)."""
    for file in _weight_files(path, name):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"{path}: no tensor {name}")


def batch_invariant_serves(config) -> bool:
    """Whether an engine of ``config`` (an EngineConfig) runs the batch-invariant operators: what
    ``config.batch_invariant_enabled`` says, except that ``auto`` gives way where their C++ kernels or the
    attention kernel cannot be built here (no compiler): the batch-variant path serves then, with a
    warning. ``on`` there fails at load, naming the missing kernel."""
    if not config.batch_invariant_enabled:
        return False
    if config.torch_device.type == "cuda":  # its kernels are Triton's (engine/models/invariant_cuda.py)
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("the batch-invariant mode on a GPU needs Triton")
        return True
    # A first start builds both (about half a minute each on two cores): side by side, the compilers
    # are other processes.
    with ThreadPoolExecutor(2) as pool:
        built = all(pool.map(lambda load: load(), (load_invariant_kernels, load_cpu_kernel)))
    if config.batch_invariant == "auto" and not built:
        logging.getLogger(__name__).warning(
            "--batch-invariant auto: its kernels could not be built here; serving without the mode"
        )
        return False
    return True


def load_model(
    path: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    pack: bool = True,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    batch_invariant: bool = False,
    cls: type[torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """Build the model without initializing weights (meta device), then fill it from the checkpoint.
    ``cls``: the model class, where not the one the config's architecture names (a part of the
    checkpoint served as a model of its own: a multi-token-prediction layer).
    ``pack``: prepack large CPU models' linears (not for a compiled model: inductor packs its own).
    ``batch_invariant``: the model on the batch-invariant operators instead (engine/models/invariant.py),
    compiled or not (they are opaque to inductor).
    ``quantization="nf4"``: quantize the linear layers as they load (see :class:`_NF4Loading`); a
    checkpoint saved by bitsandbytes in NF4 (config.json ``quantization_config``) loads as NF4 either way.
    ``quantization="int4"``: once loaded, each linear but the LM head becomes an int4 layer on PyTorch's
    int4 kernels (:mod:`engine.quant.int4`), one at a time: the load peaks at the full-precision model.
    On a 4-bit integer checkpoint (GPTQ, AWQ, compressed-tensors) the layers get the checkpoint's own
    groups instead (:func:`engine.quant.int4.install_checkpoint_int4`), where the kernels take them.
    ``quantization="fp8"``: each linear but the LM head on FP8 products (:mod:`engine.quant.fp8`), an
    FP8 checkpoint's own e4m3 weights where their scales are per tensor or row, else quantized per row.
    ``tp``: build this rank's shard and read only its slices of the checkpoint (``checkpoint_slice``)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
    cls = cls or model_class_for(config)
    qconfig = getattr(config, "quantization_config", None)
    own = dict(qconfig or {}).get("quant_method") in getattr(cls, "checkpoint_quantizations", ())
    try:  # GPTQ, AWQ, compressed-tensors, FP8: dequantized as they load (engine/quant/checkpoint.py)
        reader = None if own else checkpoint_format(qconfig)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    # --quantization int4 on a 4-bit integer checkpoint serves its own groups on the int4 kernels, and
    # --quantization fp8 on an FP8 checkpoint its own e4m3 weights on FP8 products
    serves_stored = reader is not None and quantization in ("int4", "fp8") and getattr(reader, quantization)
    if (own or reader) and quantization is not None and not serves_stored:  # (gpt-oss's MXFP4: read by its family)
        raise ValueError(f"{path}: a {qconfig['quant_method']} checkpoint cannot be re-quantized to {quantization}")
    try:
        prequantized = None if own or reader else bnb_quantization_kind(qconfig)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if prequantized and quantization in ("int4", "fp8"):
        raise ValueError(f"{path}: a bitsandbytes NF4 checkpoint cannot be re-quantized to {quantization}")
    if prequantized and tp.size > 1:
        raise ValueError(
            f"{path}: a bitsandbytes NF4 checkpoint cannot be sharded (its 4-bit blocks span the rows of "
            "a whole matrix); serve the full-precision checkpoint with --quantization nf4 instead"
        )
    with torch.device("meta"):
        model = cls(config, max_positions, tp=tp) if tp.size > 1 else cls(config, max_positions)
    nf4 = _NF4Loading(model, path, quantize=quantization == "nf4") if prequantized or quantization == "nf4" else None
    select = model.checkpoint_slice if tp.size > 1 else None
    stored: dict[str, dict] = {}  # layer path → the stored form of each of its checkpoint modules, where served
    if serves_stored:
        install = install_checkpoint_int4 if quantization == "int4" else install_checkpoint_fp8
        more = () if quantization == "int4" else (reader.fp8_block_k,)

        def convert(layer: str, linear: torch.nn.Linear) -> torch.nn.Module | None:
            forms = stored.pop(layer, None)
            return model.get_submodule(layer) if forms and install(model, forms, select, *more) else None
    else:
        convert = int4_layer if quantization == "int4" else fp8_layer
    # --quantization int4 / fp8: each linear converted the moment its weight has loaded (engine/quant/
    # streamed.py), so the load never holds the full-precision model; other families after the load
    streamed = quantization in ("int4", "fp8") and getattr(model, "streams_linear_weights", False)
    layers = StreamedLayers(model, convert, dtype) if streamed else None
    model = model.to_empty(device=device).to(dtype)
    model.init_buffers(max_positions)
    skip = getattr(model, "checkpoint_skips", None)
    aliases = getattr(model, "checkpoint_aliases", lambda name: ())
    if reader is None:
        weights = ((k, v.to(device)) for k, v in iter_safetensors(path, select, skip))
    else:  # whole tensors read and dequantized, then cut: a rank's slice of a packed tensor is no slice of it

        def keep(module: str, got: dict) -> None:
            form = reader.int4_groups(got) if quantization == "int4" else reader.fp8_weights(got)
            if form is None:
                return
            for name in (module, *aliases(module)):  # (Gemma 4's keys-as-values k_proj fills v_proj too)
                layer = model.weight_target(model.checkpoint_name(f"{name}.weight"))[0].removesuffix(".weight")
                stored.setdefault(layer, {})[name] = form

        plain = reader.read(iter_safetensors(path, skip=skip), keep if serves_stored else None)
        weights = ((k, take_slice(v, select(k) if select else None).to(device)) for k, v in plain)
    # The model's own changes to the stream (Gemma 4: one tensor filling two slots, tensors it never
    # reads), before any layer takes its weights from it
    weights = getattr(model, "checkpoint_stream", lambda w: w)(weights)
    if nf4:
        weights = nf4.intercept(weights)
    elif layers:
        weights = layers.intercept(weights)
    model.load_weights(weights)
    if nf4:
        nf4.install()
    if layers:
        layers.finish()
        replaced = layers.converted
    elif serves_stored:  # a family that reads its linears its own way: converted after its load
        replaced = install(model, {m: f for forms in stored.values() for m, f in forms.items()}, select, *more)
    elif quantization in ("int4", "fp8"):
        replaced = (quantize_linears_int4 if quantization == "int4" else quantize_linears_fp8)(model)
    if quantization in ("int4", "fp8"):
        what = "serve the checkpoint's own weights" if serves_stored else "quantized"
        logging.getLogger(__name__).info("%s: %d layers %s", quantization, replaced, what)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None and has_experts(model):
        import engine.models.moe_triton  # noqa: F401  (the mixture's GPU kernels: no host sync, graph-capturable)
    # Both replace plain nn.Linear layers only; quantized layers are not nn.Linear and stay as they are.
    # Small-rows layers keep their weights and a packed copy, as a compiled model's frozen graph did;
    # a large eager model keeps only the packed weights (half the memory), as before.
    # The batch-invariant operators (engine/models/invariant.py), quantized layers included.
    if batch_invariant:
        if device.type == "cuda":
            if quantization or prequantized:
                raise ValueError(f"the batch-invariant mode on a GPU is built for full-precision weights, not "
                                 f"{quantization or prequantized}: serve with --batch-invariant off")  # fmt: skip
            if tp.size > 1:  # NCCL picks its reduction's algorithm by the message's size: by the batch
                raise ValueError("the batch-invariant mode on GPUs is built for one GPU: serve with --batch-invariant "
                                 "off or without tensor parallelism")  # fmt: skip
            from engine.models import invariant_cuda  # noqa: F401  (registers its CUDA kernels)
        elif device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the batch-invariant mode is built for float32 and bfloat16 on CPUs and for CUDA, not "
                             f"{dtype} on {device.type}: serve with --batch-invariant off")  # fmt: skip
        elif not load_invariant_kernels():
            raise RuntimeError("the batch-invariant kernels could not be built (a C++ compiler is needed)")
        model.use_invariant_ops()
        return model.eval()
    if fused_ops_serve(device, dtype):  # RoPE, norms, residual sums and activations in one kernel each
        model.use_fused_ops()
    packs = pack and packing_supported(dtype, device) and linear_weight_bytes(model) >= MIN_PACKED_BYTES
    if small_rows_serve(dtype, device) and not packs:  # a decode's few rows at the memory's speed
        model.pack_for_cpu(SmallRowsLinear)
    elif packs:
        model.pack_for_cpu()
    return model.eval()


def fused_ops_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` runs the fused GPU kernels (engine/models/fused.py):
    on CUDA, in bfloat16 or float16, where Triton imports."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return importlib.util.find_spec("triton") is not None


def checkpoint_keys(path: Path) -> list[str]:
    """The names of every tensor of the checkpoint, read from the files' headers (no tensor data)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    keys: list[str] = []
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as f:
            keys += list(f.keys())
    return keys


class _NF4Loading:
    """NF4 linear layers for one model load.

    Before the weights are allocated, every linear to be held in NF4 is swapped for an empty
    :class:`NF4Linear` (so no full-precision copy of it is ever allocated, and the model's own loader
    no longer expects its weight). Those are: the linears whose checkpoint weights are in bitsandbytes'
    NF4 layout, and with ``quantize`` every other linear but ``lm_head`` (kept in full precision as
    transformers keeps it: it is one matrix, and the one whose errors reach the logits directly).
    :meth:`intercept` takes their tensors out of the stream the model loads (quantizing plain ones,
    each checkpoint matrix on its own), and :meth:`install` gives each layer its weight: the parts of a
    fused layer (q/k/v, gate/up) are stacked in 4 bits (:func:`engine.quant.nf4.fuse_nf4`), without
    re-quantizing."""

    def __init__(self, model: torch.nn.Module, path: Path, quantize: bool) -> None:
        self.model = model
        self.quantize = quantize
        self.fused = getattr(model, "_fused", {})
        self.stats: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint module name → its bnb tensors
        self.parts: dict[str, dict[object, object]] = {}  # our module name → {shard: NF4Weight}
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        marker = ".weight." + QUANT_STATE_PREFIX
        self.prequantized = {k[: k.index(marker)] for k in checkpoint_keys(path) if marker in k}
        targets = {self.target(name)[0] for name in self.prequantized}
        unknown = sorted(targets - set(linears))
        if unknown:
            raise ValueError(f"{path}: quantized weight for {unknown[0]}, which is not a linear layer of the model")
        if quantize:
            targets |= {n for n in linears if n != "lm_head"}
        self.layers: dict[str, NF4Linear] = {}
        for name in sorted(targets):
            lin = linears[name]
            layer = NF4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, layer)
            self.layers[name] = layer

    def target(self, checkpoint_module: str) -> tuple[str, object]:
        """Our module for a checkpoint module, and which shard of it (None: all of it): named as the
        model names it (``checkpoint_name``: a family's renames), then fused."""
        name = self.model.checkpoint_name(checkpoint_module + ".weight")
        for piece, (fused, shard) in self.fused.items():
            if piece in name:
                return name.replace(piece, fused).removesuffix(".weight"), shard
        return name.removesuffix(".weight"), None

    def intercept(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in weights:
            module, sep, suffix = key.partition(".weight")
            if sep and module in self.prequantized:
                suffix = suffix.removeprefix(".") or "weight"
                if suffix != "weight" and suffix not in BNB_SUFFIXES and not suffix.startswith("quant_state."):
                    raise ValueError(f"unexpected tensor {key} of a bitsandbytes-quantized weight")
                self.stats.setdefault(module, {})[suffix] = tensor
                continue
            if sep and not suffix and self.target(module)[0] in self.layers:
                target, shard = self.target(module)
                if not self.quantize:
                    raise ValueError(f"{key} is in full precision but other weights of {target} are NF4")
                if tensor.dim() != 2:
                    raise ValueError(f"{key}: expected a matrix, got shape {tuple(tensor.shape)}")
                self.parts.setdefault(target, {})[shard] = quantize_nf4(tensor)
                continue
            yield key, tensor

    def install(self) -> None:
        for module, tensors in self.stats.items():
            target, shard = self.target(module)
            self.parts.setdefault(target, {})[shard] = nf4_from_bnb(module, tensors)
        self.stats.clear()
        for name, layer in self.layers.items():
            parts = self.parts.pop(name, {})
            stacked = []
            for shard in self.shards(name):
                if shard not in parts:
                    which = "" if shard is None else f" (shard {shard})"
                    raise ValueError(f"checkpoint is missing the weight of {name}{which}")
                start, rows = (0, layer.out_features)
                if shard is not None:
                    start, rows = self.model._shard_range(name + ".weight", shard)
                if tuple(parts[shard].shape) != (rows, layer.in_features):
                    raise ValueError(
                        f"shape mismatch for {name} ({shard}): checkpoint {tuple(parts[shard].shape)}, "
                        f"model {(rows, layer.in_features)}"
                    )
                stacked.append((start, parts[shard]))
            layer.set_weight(fuse_nf4([q for _, q in sorted(stacked, key=lambda x: x[0])]))

    def shards(self, name: str) -> list[object]:
        """The shards a fused layer is loaded from, in the model's fusion table's order: those the model
        expects of this layer (Gemma 4's K/V-sharing layers fill only the q rows of their q/k/v)."""
        fused = [shard for piece, (f, shard) in self.fused.items() if f.strip(".") == name.rsplit(".", 1)[-1]]
        expected = self.model.expected_slots(f"{name}.weight")
        return [s for s in fused if f"{name}.weight:{s}" in expected] or fused or [None]


def read_state_file(path: Path, names: tuple[str, ...]) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tensors of the first of ``names`` present in ``path`` (safetensors, or a torch pickle of
    tensors only): draft heads ship as one such file."""
    files = [path / n for n in names if (path / n).is_file()]
    if not files:
        raise ValueError(f"{path} has none of {', '.join(names)}")
    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        return files[0], load_file(files[0])
    return files[0], torch.load(files[0], map_location="cpu", weights_only=True)


def check_state(file: Path, state: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]], why: str = "") -> None:
    """A start-up error naming the first missing, unexpected or misshapen tensor (``why``: what the
    expected tensors follow from, added to an unexpected or shape error)."""
    missing = sorted(set(want) - set(state))
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        raise ValueError(f"{file}: missing tensor {missing[0]}{more}")
    unexpected = sorted(set(state) - set(want))
    if unexpected:
        raise ValueError(f"{file}: unexpected tensor {unexpected[0]}" + (f" ({why})" if why else ""))
    for name, shape in want.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(
                f"{file}: tensor {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}"
                + (f" ({why})" if why else "")
            )

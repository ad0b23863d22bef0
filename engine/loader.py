"""Finding and loading Hugging Face checkpoints: a local directory, or a hub id already in the local cache.

Nothing is ever downloaded: a hub id that is not cached is a clear error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.models import model_class_for
from engine.models.packed import MIN_PACKED_BYTES, linear_weight_bytes, packing_supported


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
    return AutoConfig.from_pretrained(path, local_files_only=True)


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


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one file at a time (sharded checkpoints follow their index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path}")
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(
    path: Path, config, dtype: torch.dtype, device: torch.device, max_positions: int, pack: bool = True
) -> torch.nn.Module:
    """Build the model without initializing weights (meta device), then fill it from the checkpoint.
    ``pack``: prepack large CPU models' linears (not for a compiled model: inductor packs its own)."""
    cls = model_class_for(config)
    with torch.device("meta"):
        model = cls(config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.init_buffers(max_positions)
    model.load_weights((k, v.to(device)) for k, v in iter_safetensors(path))
    if pack and packing_supported(dtype, device) and linear_weight_bytes(model) >= MIN_PACKED_BYTES:
        model.pack_for_cpu()
    return model.eval()


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

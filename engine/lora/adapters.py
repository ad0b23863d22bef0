"""LoRA adapters in PEFT's format, read and checked against the model they adapt.

An adapter directory holds ``adapter_config.json`` (PEFT's ``LoraConfig``: ``r``, ``lora_alpha``,
``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ``target_modules``, ...) and
``adapter_model.safetensors`` (or PEFT's older ``adapter_model.bin``), whose tensors are named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), where
``<module>`` is the module's name in the transformers model (``model.layers.3.self_attn.q_proj``).
A module's output becomes ``W x + s * B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA),
``r`` and ``alpha`` the module's own where the patterns name it.

:func:`read_adapter` returns each adapted module's pair with its scale folded into ``B`` (the form the
served layers hold), keyed by the checkpoint module name the model's loader reads
(``checkpoint_name`` / ``weight_target`` place it, as they place the base weights). Everything we do not
serve is an :class:`AdapterError` that says why, never a silently different model: DoRA, trained
biases, ``modules_to_save`` (full copies of modules), embedding or LM-head adapters, trainable tokens,
Conv1D (``fan_in_fan_out``) layouts, a rank over ``max_rank``, a module the model does not have, a
shape that is not the model's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that cannot be served: the message says why (a 400 at the API)."""


@dataclass
class LoraPair:
    """One adapted module: ``a [r, in]`` and ``b [out, r]`` with the scale folded into ``b``."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class Adapter:
    name: str
    path: Path
    rank: int  # the largest of its modules' ranks
    pairs: dict[str, LoraPair]  # checkpoint module name (``model.layers.0.self_attn.q_proj``) → its pair
    base: str | None  # the base model it was trained on, as its config names it


def _pattern_value(name: str, patterns: dict, module: str, default):
    """PEFT's rule: the first pattern key that matches the end of the module's name, after a dot."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise AdapterError(
                f"adapter {name!r}: {key!r} of its rank_pattern / alpha_pattern is no regular expression ({e})"
            ) from None
    return default


def read_adapter(name: str, path: str | Path, max_rank: int) -> Adapter:
    """Read and check the adapter at ``path`` (a directory in PEFT's format)."""
    path = Path(path).expanduser()
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json (is it a PEFT LoRA adapter?)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {config_file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_file} holds no JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {kind!r} is not served (LORA is)")
    refused = {
        "use_dora": "DoRA (use_dora) adapters are not served",
        "modules_to_save": "modules_to_save (full copies of modules, e.g. an LM head or embedding) is not served",
        "trainable_token_indices": "trainable tokens (trainable_token_indices) are not served",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts) is not served",
        "lora_bias": "adapters that train a bias on lora_B (lora_bias) are not served",
        "target_parameters": "adapters on parameters (target_parameters) are not served",
    }
    for key, why in refused.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={config['bias']!r} trains the base biases, which is not served")
    tensors = _read_tensors(name, path)
    r0, alpha0 = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(PREFIX)
        found = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", stem)
        if "lora_embedding" in key or re.search(r"(^|\.)(lm_head|embed_tokens|wte)(\.|$)", stem):
            raise AdapterError(
                f"adapter {name!r}: {key} is part of an embedding or LM-head adapter, which is not served "
                "(LoRA is served on the attention and MLP linear layers)"
            )
        if found is None:
            raise AdapterError(f"adapter {name!r}: {key} is no tensor of LoRA's; only lora_A / lora_B are served")
        halves.setdefault(found[1], {})[found[2]] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: no lora_A / lora_B tensors in {path}")
    pairs: dict[str, LoraPair] = {}
    for module, got in sorted(halves.items()):
        if set(got) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_{next(iter(got))} without its pair")
        a, b = got["A"], got["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are no pair"
            )
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"adapter {name!r}: {module} has rank {rank}, over --max-lora-rank {max_rank}")
        want = int(_pattern_value(name, rank_pattern, module, r0))
        if want != rank:
            raise AdapterError(f"adapter {name!r}: {module} has rank {rank} where its config says {want}")
        alpha = float(_pattern_value(name, alpha_pattern, module, alpha0))
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        pairs[module] = LoraPair(a.float(), b.float() * scale)
    return Adapter(name, path, max(p.rank for p in pairs.values()), pairs, config.get("base_model_name_or_path"))


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(st)
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: the reader's own words
        raise AdapterError(f"adapter {name!r}: cannot read its weights ({type(e).__name__}: {e})") from None
    raise AdapterError(f"adapter {name!r}: {path} has no adapter_model.safetensors (or adapter_model.bin)")

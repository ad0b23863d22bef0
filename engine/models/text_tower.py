"""The language model of a multimodal checkpoint, served as text only (Gemma 3's, Mistral 3's and Kimi
K2.5's).

Such a checkpoint's ``config.json`` names the multimodal architecture; the loader hands the model
its ``text_config`` (``engine.runner.loader.load_config``, for the architectures in
``engine.models.TEXT_TOWERS``), so the rest of the engine sees an ordinary decoder. Only the weight
names differ from a text-only checkpoint's. Two layouts are read: the one ``save_pretrained`` writes
and the released checkpoints use (``language_model.model.…``, ``language_model.lm_head.weight`` where
untied, ``vision_tower.…``, ``multi_modal_projector.…``) and the one transformers 5 builds in memory
(``model.language_model.…``, ``lm_head.weight``, ``model.vision_tower.…``,
``model.multi_modal_projector.…``). Vision and projector tensors are skipped; the API refuses image
content parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.quant import NF4Linear


class TextTower:
    """A mixin before a decoder's class: its weights read from a multimodal checkpoint's names."""

    architecture = ""  # the checkpoint's (for errors)
    streams_linear_weights = False  # its names are read by text_name in load_weights
    _text_prefixes = ("language_model.model.", "model.language_model.")
    head_names = ("language_model.lm_head.weight", "lm_head.weight")
    _skipped_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def text_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as a text-only checkpoint spells it, or None for a vision or
        projector tensor (left out). Other names pass as they are (the loader names the unexpected)."""
        if name.startswith(self._skipped_prefixes):
            return None
        if name in self.head_names:
            return "lm_head.weight"
        for prefix in self._text_prefixes:
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        return name

    def checkpoint_skips(self, name: str) -> bool:
        """The vision tower's and the projector's tensors: never read; nor what the decoder's class leaves
        unread in a text-only checkpoint (DeepSeek-V3's prediction layers)."""
        text = self.text_name(name)
        skips = getattr(super(), "checkpoint_skips", None)
        return text is None or (skips is not None and skips(text))

    def checkpoint_name(self, name: str) -> str:
        """As the decoder names a tensor of a text-only checkpoint (a quantized checkpoint's stored forms
        are filed by it)."""
        return super().checkpoint_name(self.text_name(name) or name)

    def _text_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            text = self.text_name(name)
            if text is not None:
                yield text, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if any(isinstance(m, NF4Linear) for m in self.modules()):
            # The NF4 loader picks the tensors it quantizes by name before they reach this method, and
            # does not know this checkpoint's prefixes: the layers it swapped in would never be filled.
            raise ValueError(
                f"--quantization nf4 cannot load a {self.architecture} checkpoint (the NF4 loader does not read "
                "its language model's prefixed weight names): serve it in full precision or with --quantization int4"
            )
        super().load_weights(self._text_weights(weights))

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        text = self.text_name(name)
        return None if text is None else super().checkpoint_slice(text)

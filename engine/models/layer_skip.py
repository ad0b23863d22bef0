"""Which sublayers a forward leaves out: self-speculative drafting runs the target itself with some
attention and MLP sublayers skipped (sharing its weights and its KV cache)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LayerSkip:
    attn: frozenset[int] = frozenset()  # layers whose attention is skipped
    mlp: frozenset[int] = frozenset()  # layers whose MLP is skipped

    @classmethod
    def middle(cls, num_layers: int) -> LayerSkip:
        """The untuned default: both sublayers of the middle half of the layers (the first and last
        layers matter most to the output; `augur tune-layer-skip` finds a better set per model)."""
        edge = max(1, num_layers // 4)
        mid = frozenset(range(edge, num_layers - edge))
        return cls(mid, mid)

    def check(self, num_layers: int) -> LayerSkip:
        bad = sorted(i for i in self.attn | self.mlp if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"layer-skip config names layers {bad}, but the model has {num_layers}")
        if len(self.attn) == len(self.mlp) == num_layers:
            raise ValueError("layer-skip config skips every sublayer: the draft would compute nothing")
        return self

    def to_dict(self) -> dict:
        return {"attention": sorted(self.attn), "mlp": sorted(self.mlp)}

    @classmethod
    def from_dict(cls, d: dict) -> LayerSkip:
        return cls(frozenset(int(i) for i in d.get("attention", [])), frozenset(int(i) for i in d.get("mlp", [])))

    @classmethod
    def load(cls, path: str | Path) -> LayerSkip:
        return cls.from_dict(json.loads(Path(path).read_text()))

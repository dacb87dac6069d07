"""RankLayout: what one rank holds once its model is laid out, for people to read (``strategy.describe()``).

The degrees say how many ranks share each axis; this says what a given rank ended up with: its mesh coordinates,
its pipeline stages and their blocks, the tensor-parallel style applied to each module, and the FSDP2 units.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_dist.parallel_dims import ParallelDims


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds after the strategy laid its model out.

    Attributes:
        rank: Global rank.
        coordinates: Its coordinate on each mesh axis (``{"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 0}``).
        stages: Pipeline stage indices this rank runs (``(0,)`` without a pipeline).
        blocks: Per stage, the names of the blocks it holds (the whole model's, e.g. ``("layers.0", "layers.1")``);
            empty without a pipeline (the rank holds its shards of every block).
        tp_styles: Module name (the LightningModule's) -> tensor-parallel style applied; empty without TP.
        fsdp_units: The FSDP2 units, in the order they were wrapped; empty without data parallelism.
        experts: What expert parallelism runs (the experts' split and the tokens' dispatch), in words; empty without.
        context: What context parallelism runs (the sequence split and the attention across cp), in words; empty at
            ``cp=1``.
        float8: What float8 training runs (the recipe and the converted layers), in words; empty without it.
        sync: How its ``dp_replicate`` replicas agree when not every step (``DiLoCo over dp_replicate: H=50 ...``);
            empty for gradients averaged every step.
        parallelized_by: ``"lightning-dist"``, or ``"configure_model"`` when the module laid itself out (its DTensor
            parameters say nothing about stages or styles here).
    """

    rank: int
    coordinates: dict[str, int]
    stages: tuple[int, ...] = (0,)
    blocks: tuple[tuple[str, ...], ...] = ()
    tp_styles: dict[str, str] = field(default_factory=dict)
    fsdp_units: tuple[str, ...] = ()
    context: str = ""
    experts: str = ""
    float8: str = ""
    sync: str = ""
    parallelized_by: str = "lightning-dist"

    @classmethod
    def of(cls, dims: ParallelDims, rank: int, **fields: Any) -> RankLayout:
        """This rank's layout with its coordinates read from ``dims``."""
        return cls(rank=rank, coordinates=dims.coordinates(rank), **fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (lists, not tuples): as the run report stores it."""
        return json.loads(json.dumps(asdict(self)))

    def lines(self) -> list[str]:
        """A short human-readable description, one fact per line."""
        coords = " ".join(f"{axis}={index}" for axis, index in self.coordinates.items())
        out = [f"rank {self.rank}: {coords}"]
        if self.sync:
            out.append(f"  {self.sync}")
        if self.parallelized_by != "lightning-dist":
            return [*out, f"  laid out by the module's own {self.parallelized_by}"]
        if self.blocks:
            held = "; ".join(f"stage {s}: {', '.join(b) or '(no blocks)'}" for s, b in zip(self.stages, self.blocks))
            out.append(f"  pipeline {held}")
        if self.tp_styles:
            by_style: dict[str, list[str]] = {}
            for name, style in self.tp_styles.items():
                by_style.setdefault(style, []).append(name)
            for style, names in sorted(by_style.items()):
                out.append(f"  {style}: {_abbreviate(names)}")
        if self.context:
            out.append(f"  {self.context}")
        if self.experts:
            out.append(f"  {self.experts}")
        if self.float8:
            out.append(f"  {self.float8}")
        if self.fsdp_units:
            out.append(f"  FSDP2 units ({len(self.fsdp_units)}): {_abbreviate(list(self.fsdp_units))}")
        return out


def _abbreviate(names: list[str], limit: int = 6) -> str:
    """Names with block indices folded (``layers.0.mlp`` and ``layers.1.mlp`` -> ``layers.*.mlp``), at most
    ``limit`` of them, and how many modules they stand for."""
    patterns = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) for name in names))
    shown = ", ".join(patterns[:limit]) + (", ..." if len(patterns) > limit else "")
    return f"{shown} ({len(names)})"

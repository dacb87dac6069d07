"""What ``parallelism.float8`` and ``parallelism.loss_chunks`` change for the best layout: the same layout estimated
with each option the other way, one line each (``lightning-dist-plan`` prints them under the table)."""

from __future__ import annotations

from dataclasses import replace

from lightning_dist.config.schema import HardwareConfig
from lightning_dist.models.gpt import GPTConfig
from lightning_dist.plan.cost import Estimate, estimate
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.memory import GIB

#: The pieces the plan suggests when the run's loss is not chunked.
SUGGESTED_CHUNKS = 8


def option_effects(cfg: GPTConfig, hw: HardwareConfig, seq_len: int, global_batch: int, best: Estimate) -> list[str]:
    """One line per option: the best layout with float8 (tensorwise) and with the chunked loss, against without."""
    lay, lines = best.layout, []
    if hw.float8_tflops != 0:
        float8 = "off" if lay.options.float8 != "off" else "tensorwise"
        other = _estimate(cfg, hw, seq_len, global_batch, lay, float8=float8)
        on, off = (best, other) if float8 == "off" else (other, best)
        lines.append(
            f"parallelism.float8={on.layout.options.float8} (vs off): {_speed(on, off)}, "
            f"{on.memory.total / GIB:.1f} GiB vs {off.memory.total / GIB:.1f} GiB per rank"
        )
    chunks = 0 if lay.options.loss_chunks else SUGGESTED_CHUNKS
    other = _estimate(cfg, hw, seq_len, global_batch, lay, loss_chunks=chunks)
    on, off = (best, other) if chunks == 0 else (other, best)
    lines.append(
        f"parallelism.loss_chunks={on.layout.options.loss_chunks} (vs 0): logits {on.memory.logits / GIB:.2f} GiB vs "
        f"{off.memory.logits / GIB:.2f} GiB, {on.memory.total / GIB:.1f} GiB vs {off.memory.total / GIB:.1f} GiB per "
        f"rank; {_speed(on, off)}"
    )
    return lines


def _estimate(cfg: GPTConfig, hw: HardwareConfig, seq_len: int, batch: int, lay: Layout, **fields: object) -> Estimate:
    return estimate(cfg, replace(lay, options=lay.options.with_fields(**fields)), hw, seq_len, batch)


def _speed(on: Estimate, off: Estimate) -> str:
    ratio = on.tokens_per_sec_per_device / off.tokens_per_sec_per_device - 1
    return f"{on.tokens_per_sec_per_device:,.0f} vs {off.tokens_per_sec_per_device:,.0f} tok/s/dev ({ratio:+.1%})"

"""The planner under DiLoCo and slow links: bytes on the replica axis by hand, the cost curve's arithmetic, and the
link speed where DiLoCo overtakes synchronous training."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from helpers import compose_config

from lightning_dist.config.schema import HardwareConfig, PlanConfig
from lightning_dist.parallel.compression import INT8_BLOCK, chunk_numel
from lightning_dist.parallel.options import DiLoCoOptions
from lightning_dist.plan.collectives import fragment_elements, outer_collectives, per_axis, step_collectives
from lightning_dist.plan.cost import estimate, stage_params
from lightning_dist.plan.cost_curve import cost_curve, gpu_counts
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.published import H100_GRAND_TETON, LLAMA3_8B
from lightning_dist.plan.search import rank

SEQ, BATCH = 8192, 64
HSDP = {
    "dp_replicate": 4,
    "dp_shard": 2,
    "activation_checkpointing": {"mode": "selective"},
}  # 8 ranks: replicas across nodes
HW = HardwareConfig(gpus_per_node=2, inter_node_gbps=1.25)


def _diloco(**fields) -> Layout:
    return Layout.of(2, 4, sync="diloco", **HSDP, **fields)


def test_diloco_moves_the_sync_bytes_once_per_h_steps_compressed_as_sent() -> None:
    sync = estimate(LLAMA3_8B, Layout.of(2, 4, **HSDP), HW, SEQ, BATCH)
    every_step = sync.comm["dp_replicate"]["bytes"]  # the fp32 gradient shard all-reduced every step
    shard = stage_params(LLAMA3_8B, 1) // 2  # dp_shard=2 halves every tensor exactly
    assert every_step == 4 * shard
    for h in (1, 10, 50):
        fp32 = estimate(LLAMA3_8B, _diloco(every=h), HW, SEQ, BATCH)
        assert fp32.comm["dp_replicate"]["bytes"] == every_step / h  # the same elements, once per H steps
        assert fp32.comm["dp_shard"]["bytes"] == sync.comm["dp_shard"]["bytes"]  # the inner step is unchanged
    # bf16 / int8 travel as an all-to-all of chunk payloads then an all-gather of the chunk means (4 replicas: each
    # op's telemetry size is 4 chunk payloads, a chunk a quarter of the shard rounded up to whole int8 blocks)
    chunk = chunk_numel(shard, 4)
    bf16 = estimate(LLAMA3_8B, _diloco(every=10, compression="bf16"), HW, SEQ, BATCH)
    assert bf16.comm["dp_replicate"]["bytes"] == 2 * 4 * 2 * chunk / 10
    int8 = estimate(LLAMA3_8B, _diloco(every=10, compression="int8"), HW, SEQ, BATCH)
    assert int8.comm["dp_replicate"]["bytes"] == 2 * 4 * (chunk + 4 * chunk // INT8_BLOCK) / 10
    # on the wire (nccl-tests bus bytes) per rank: fp32 2(n-1)/n x 4N; compressed 2 (n-1)/n x the payload: the wire
    # time falls by the compression ratio (the padding to whole blocks aside)
    fp32 = estimate(LLAMA3_8B, _diloco(every=10), HW, SEQ, BATCH).comm["dp_replicate"]["seconds"]
    assert bf16.comm["dp_replicate"]["seconds"] / fp32 == pytest.approx(1 / 2, rel=1e-6)
    assert int8.comm["dp_replicate"]["seconds"] / fp32 == pytest.approx((1 + 4 / INT8_BLOCK) / 4, rel=1e-6)


def test_inner_steps_send_nothing_over_the_replicas() -> None:
    planned = per_axis(step_collectives(LLAMA3_8B, _diloco(), SEQ))
    synced = per_axis(step_collectives(LLAMA3_8B, Layout.of(2, 4, **HSDP), SEQ))
    # telemetry reports both data axes as dp: only the replicas' gradient all-reduce is gone
    assert synced["dp"]["bytes"] - planned["dp"]["bytes"] == 4 * stage_params(LLAMA3_8B, 1) // 2
    assert [c.op for c in outer_collectives(LLAMA3_8B, _diloco())] == ["all_reduce"]
    assert outer_collectives(LLAMA3_8B, Layout.of(2, 4, **HSDP)) == []


def test_streaming_spreads_the_same_bytes_over_f_fragments_and_tau_hides_them() -> None:
    plain = estimate(LLAMA3_8B, _diloco(every=40), HW, SEQ, BATCH)
    streamed = _diloco(every=40, fragments=4)
    fragments = fragment_elements(LLAMA3_8B, streamed)
    assert len(fragments) == 4 and sum(fragments) == stage_params(LLAMA3_8B, 1) // 2
    assert max(fragments) < 1.1 * sum(fragments) / 4  # the peak exchange is about 1/F of the model
    stream = estimate(LLAMA3_8B, streamed, HW, SEQ, BATCH)
    assert stream.comm["dp_replicate"]["bytes"] == plain.comm["dp_replicate"]["bytes"]  # same average per step
    assert stream.comm["dp_replicate"]["calls"] == 4 / 40
    delayed = estimate(LLAMA3_8B, _diloco(every=40, fragments=4, delay=5), HW, SEQ, BATCH)
    host = delayed.comm["dp_replicate"]["host_s"]
    assert stream.comm["dp_replicate"]["exposed_s"] > host  # blocking: the exchange and the host work
    assert delayed.comm["dp_replicate"]["exposed_s"] == pytest.approx(host)  # tau = 5 inner steps hide the wire
    assert delayed.tokens_per_sec_per_device > stream.tokens_per_sec_per_device


@dataclass
class _Plan(PlanConfig):
    """PlanConfig with the cost curve's fields (until the schema has them)."""

    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    gpus: list[int] = field(default_factory=list)


def test_the_cost_curve_prices_time_and_gpus() -> None:
    plan = _Plan(gpus=[16, 64], micro_batches=[2])
    rows = cost_curve(LLAMA3_8B, HardwareConfig(inter_node_gbps=1.25), SEQ, 256, plan, 1e11, 2.5,
                      DiLoCoOptions(every=50))  # fmt: skip
    assert [row.gpus for row in rows] == [16, 64]
    for row in rows:
        for point in (row.sync, row.diloco):
            assert point.estimate.fits and point.estimate.layout.diloco == (point is row.diloco)
            assert point.tokens_per_sec == point.estimate.tokens_per_sec_per_device * row.gpus
            assert point.hours == pytest.approx(1e11 / point.tokens_per_sec / 3600)
            assert point.cost == pytest.approx(point.hours * 2.5 * row.gpus)
    assert gpu_counts(PlanConfig(), 8) == [8, 16, 32, 64, 128, 256, 512, 1024]
    with pytest.raises(ValueError, match=r"plan\.tokens"):
        cost_curve(LLAMA3_8B, HardwareConfig(), SEQ, 256, plan, 0, 2.5)


def test_diloco_wins_on_ethernet_and_sync_on_infiniband() -> None:
    """Llama 3 8B on 64 H100s (8 nodes), 256 x 8192 tokens per step: the crossover exists between the links."""
    ethernet = compose_config(["hardware=h100_ethernet_100gbps"]).hardware
    assert ethernet.inter_node_gbps == 1.25  # GB/s per GPU: 100 Gb/s per node shared by 8 GPUs, at 80%

    def best(gbps: float) -> tuple[float, float]:
        found = [e for e in rank(LLAMA3_8B, replace(ethernet, inter_node_gbps=gbps), 64, SEQ, 256,
                                 PlanConfig(), DiLoCoOptions(every=50)) if e.fits]  # fmt: skip
        sync = next(e for e in found if not e.layout.diloco).tokens_per_sec_per_device
        return sync, next(e for e in found if e.layout.diloco).tokens_per_sec_per_device

    sync, diloco = best(1.25)
    assert diloco > 1.2 * sync  # 1.38x: the replicas' gradient all-reduce no longer crosses a 10 Gb/s link per step
    sync, diloco = best(40.0)  # InfiniBand: the all-reduce hides under the backward; DiLoCo only adds its host work
    assert sync >= diloco


def test_the_hbm2e_profile_matches_its_yaml_and_stays_inside_the_stated_bounds() -> None:
    yaml = compose_config(["hardware=h100_hbm2e_500w"]).hardware
    assert yaml.peak_tflops == H100_GRAND_TETON.peak_tflops
    assert 835 <= H100_GRAND_TETON.peak_tflops <= 989.4  # between the H100 NVL and SXM datasheet peaks
    assert (yaml.memory_gib, yaml.inter_node_gbps) == (H100_GRAND_TETON.memory_gib, H100_GRAND_TETON.inter_node_gbps)


def test_the_report_measures_a_diloco_cycle_from_the_logged_mean_exchange(tmp_path) -> None:
    """The planner's bytes per outer cycle has its measured side: the telemetry's mean exchange x the F fragments."""
    from lightning_dist.config.validate import validate
    from lightning_dist.plan.estimate_run import predicted_and_measured

    cfg = compose_config(["parallelism=diloco", "parallelism.diloco.every=20", "parallelism.diloco.fragments=2",
                          "cluster.devices=2"], tmp_path)  # fmt: skip
    valid = validate(cfg)
    key = "DiLoCo bytes per outer cycle (H steps) on dp_replicate, rank 0"
    before = [{"step": 10.0, "diloco/outer_steps": 0.0, "diloco/bytes_per_outer_step": 0.0}]
    predicted, measured = predicted_and_measured(valid.cfg, valid.dims, {"history": before})[key]
    assert predicted > 0 and measured is None  # nothing exchanged yet
    logged = [*before, {"step": 20.0, "diloco/outer_steps": 2.0, "diloco/bytes_per_outer_step": predicted / 2}]
    assert predicted_and_measured(valid.cfg, valid.dims, {"history": logged})[key] == [predicted, predicted]

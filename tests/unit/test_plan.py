"""The planner: its formulas on small cases against numbers worked out by hand, the search, and the console app."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import compose_config

from lightning_dist.config.schema import HardwareConfig, PlanConfig
from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.plan.cost import estimate, flops_per_token_of, rank_params, stage_params
from lightning_dist.plan.layout import Layout
from lightning_dist.plan.search import layouts, rank

# d_model 64, 2 layers, vocab 256, llama: a block = q,o (64x64 each) + k,v (64x64 each: 4 heads, no GQA)
# + MLP 3 x 64 x 192 (hidden 8/3 * 64 -> 192) + 2 norms = 16384 + 36864 + 128 = 53376 parameters.
TINY = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4)
BLOCK = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
HW = HardwareConfig(peak_tflops=100.0, compute_efficiency=0.5, intra_node_gbps=100.0, inter_node_gbps=10.0)


def test_stage_parameters_by_hand() -> None:
    assert BLOCK == 53376
    assert stage_params(TINY, 1) == 2 * BLOCK + 2 * 256 * 64 + 64  # blocks, embedding, head, final norm
    assert stage_params(TINY, 2) == BLOCK + 256 * 64 + 64  # the last stage: a block, the norm and the head
    # 8 blocks on 4 stages with an embedding and a head of ~5 blocks each: the end stages get one block each
    wide = GPTConfig(vocab_size=4096, n_layers=8, d_model=64, n_heads=4)
    per_rank = rank_params(wide, 4)
    assert (per_rank[0], per_rank[-1], sum(per_rank)) == (
        BLOCK + 4096 * 64,
        BLOCK + 4096 * 64 + 64,
        stage_params(wide, 1),
    )
    assert stage_params(wide, 4) == BLOCK + 4096 * 64 + 64
    with torch.device("meta"):
        assert stage_params(TINY, 1) == sum(p.numel() for p in GPT(TINY).parameters())
    for cfg in (TINY, GPTConfig(arch="gpt2"), GPTConfig(n_kv_heads=2, tie_embeddings=True)):
        with torch.device("meta"):
            assert flops_per_token_of(cfg, 128) == GPT(cfg).flops_per_token(128)


def test_fsdp_tp_and_pipeline_costs_by_hand() -> None:
    seq, batch = 32, 8
    loop = 4 + 4 + 4  # per (logging) step: the preemption flag, the loss sync, the loss history
    flag = 4  # tp / pp peers hold the same loss: at dp=1 only the preemption flag is reduced (strategies/metrics.py)
    fsdp = estimate(TINY, Layout.of(4, 1, dp_shard=2), HW, seq, batch)
    params = stage_params(TINY, 1)
    grads = 3 + 2 * 9  # tensors: embedding, norm, head; 9 per block
    # bf16 gathers (forward + backward; the last block's and the root's (embedding, norm, head) only in the
    # forward), fp32 reduce-scatter, the stacked fp32 gradient norms
    gathered = (params + BLOCK) * 2
    assert fsdp.comm["dp_shard"]["bytes"] == gathered + params * 4 + 4 * grads + loop
    assert fsdp.comm["dp_shard"]["calls"] == 3 * 3 - 2 + 1 + 3  # 3 units x (2 gathers + 1 reduce), norm, loop (3)
    bus = (gathered + params * 4) / 2 + 4 * grads + loop  # nccl-tests bus factors on 2 ranks
    assert fsdp.comm["dp_shard"]["seconds"] == pytest.approx(bus / 100e9)
    flops = flops_per_token_of(TINY, seq) * batch * seq / 2  # per rank
    assert fsdp.compute_s == pytest.approx(flops / (100e12 * 0.5))
    assert fsdp.tokens_per_sec_per_device == pytest.approx(batch * seq / fsdp.step_s / 2)
    assert fsdp.mfu == pytest.approx(flops_per_token_of(TINY, seq) * fsdp.tokens_per_sec_per_device / 100e12)

    tp = estimate(TINY, Layout.of(2, 2, tp=2), HW, seq, batch)  # 2 accumulated steps
    activation = 2 * seq * 64 * 2  # a whole bf16 (micro batch, seq, d_model) tensor
    # Without FSDP2, autocast keeps the residual stream fp32: per micro batch the norm outputs' all-gathers (2 per
    # block, the head's input) and their gradients' reduce-scatters (and the embedding's) move fp32; the matmul
    # outputs' reduce-scatters and their gradients' all-gathers (2 per block each) bf16.
    sequence = 2 * ((2 * 2 + 2) * 2 * activation * 2 + 2 * 2 * 2 * activation)
    loss = 3 * 2 * (2 * seq * 4)  # three fp32 per token, 2 micro batches
    norms = 5 * 64 * 4  # the sequence-parallel norm weights' partial gradients, summed once
    assert tp.comm["tp"]["bytes"] == sequence + loss + norms + 4 * grads + flag  # per step, not per batch
    assert tp.comm["tp"]["exposed_s"] == tp.comm["tp"]["seconds"]

    one_f_one_b = estimate(TINY, Layout.of(2, 4, pp=2), HW, seq, batch)
    assert one_f_one_b.bubble_fraction == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    # stage 0: 4 activations sent and 4 gradients received; the loss broadcast, the norm, the loop
    fp32 = 2 * activation  # no FSDP2: the stages pass the fp32 residual stream
    assert one_f_one_b.comm["pp"]["bytes"] == 2 * 4 * fp32 + 4 + 4 + flag
    four = GPTConfig(vocab_size=256, n_layers=4, d_model=64, n_heads=4)  # 4 stages need 4 blocks
    interleaved = estimate(four, Layout.of(2, 4, pp=2, schedule="Interleaved1F1B", stages_per_rank=2), HW, seq, batch)
    assert interleaved.bubble_fraction == pytest.approx(1 / 9)  # (p - 1) / (v m + p - 1)
    assert interleaved.comm["pp"]["bytes"] == 3 * 2 * 4 * fp32 + 4 + 4 + flag  # stage 0: 3 boundaries
    zbv = estimate(four, Layout.of(2, 4, pp=2, schedule="ZBVZeroBubble", stages_per_rank=2), HW, seq, batch)
    assert zbv.bubble_fraction == pytest.approx((1 / 3) / (8 + 1 / 3))  # weight gradients fill 2/3 of the idle
    assert zbv.comm["pp"]["bytes"] == 2 * 2 * 4 * fp32 + 4 + 4 + flag  # the V's tip stays on rank 1
    full = estimate(TINY, Layout.of(4, 1, dp_shard=2, activation_checkpointing={"mode": "full"}), HW, seq, batch)
    assert full.compute_s == pytest.approx(fsdp.compute_s * 4 / 3)
    assert full.memory.activations < fsdp.memory.activations


def test_the_search_covers_the_layouts_the_model_allows() -> None:
    found = list(layouts(GPTConfig(n_layers=4, n_heads=4), world=8, global_batch=8, gpus_per_node=4, plan=PlanConfig()))
    assert all(lay.world == 8 and 4 % lay.tp == 0 for lay in found)  # tp inside a node of 4
    assert {(lay.pp, lay.tp) for lay in found} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)}
    assert all(lay.microbatches >= lay.pp for lay in found if lay.schedule == "1F1B" and lay.pp > 1)
    assert {lay.schedule for lay in found if lay.pp == 2} == {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    }
    assert {lay.ac for lay in found} == {"none", "selective", "full"}


def test_llama_70b_on_256_h100_ranks_sensible_layouts() -> None:
    cfg = compose_config(["model=llama_70b", "cluster=slurm", "cluster.num_nodes=32", "data.seq_len=8192",
                          "data.global_batch_size=256"])  # fmt: skip
    found = rank(cfg.model, cfg.hardware, 256, 8192, 256, cfg.plan)
    assert found[0].fits and found[0].layout.tp >= 2  # 70B needs model parallelism on 80 GB
    assert 0.25 < found[0].mfu < 0.6
    replicated = [e for e in found if e.layout.dp_shard == 1 and e.layout.tp == 1 and e.layout.pp == 1]
    assert replicated and not any(e.fits for e in replicated)  # 70B x 16 bytes per parameter on one GPU: no


def test_the_console_app_prints_json_for_every_layout(tmp_path) -> None:
    command = [sys.executable, "-m", "lightning_dist.plan.cli", "model=llama_8b", "cluster=slurm",
               "cluster.num_nodes=2", "data.seq_len=4096", "data.global_batch_size=64", "plan.format=json"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    keys = {"layout", "memory_gib", "tokens_per_sec_per_device", "mfu", "comm_bytes", "bubble_fraction", "fits"}
    assert found and all(keys <= set(item) for item in found)
    assert not list(tmp_path.iterdir())  # a plan writes no run folder

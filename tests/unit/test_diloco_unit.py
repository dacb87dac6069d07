"""DiLoCo without a process group: compression error bounds and bytes, fragments, the schedule, options' errors, a
mid-cycle state_dict round trip (one replica: the outer step still moves the parameters), and which checkpoints a
resume can continue."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dist.parallel.compression import chunk_numel, exchange_sizes, start_mean
from lightning_dist.parallel.diloco import (
    INT8_BLOCK,
    DiLoCo,
    build_fragments,
    compress,
    decompress,
    dequantize_int8,
    payload_bytes,
    quantize_int8,
)
from lightning_dist.parallel.options import Parallelism
from lightning_dist.parallel_dims import ParallelDims
from lightning_dist.strategies.outer_sync import replica_key


def _replicas(numel: int = 1000, n: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes: a per-tensor scale would lose the small ones
    scales = torch.logspace(-4, 1, numel)
    return [torch.randn(numel, generator=generator) * scales for _ in range(n)]


def _mean(values: list[torch.Tensor], compression: str) -> torch.Tensor:
    payloads = [compress(v.clone(), compression) for v in values]
    return sum(decompress(p, v.numel(), compression) for p, v in zip(payloads, values)) / len(values)


def test_bf16_mean_within_its_bound() -> None:
    values = _replicas()
    exact = torch.stack(values).double().mean(0)
    err = (_mean(values, "bf16").double() - exact).abs()
    bound = 2.0**-8 * torch.stack(values).double().abs().mean(0)
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all())
    assert float(err.max()) > 0  # it is lossy: the bound is what matters


def test_int8_per_block_mean_within_its_bound() -> None:
    values = _replicas(numel=1000)  # 4 blocks of 256, the last partial
    exact = torch.stack(values).double().mean(0)
    err = (_mean(values, "int8").double() - exact).abs()
    scales = []
    for v in values:
        padded = torch.nn.functional.pad(v, (0, 4 * INT8_BLOCK - v.numel())).view(4, INT8_BLOCK)
        scales.append((padded.abs().amax(1) / 127).repeat_interleave(INT8_BLOCK)[: v.numel()])
    bound = torch.stack(scales).double().amax(0) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
    # one replica's round trip: |x - dequant(quant(x))| <= scale / 2 elementwise
    one = (dequantize_int8(quantize_int8(values[0]), 1000) - values[0]).abs()
    assert bool((one <= scales[0] * (0.5 + 1e-5)).all())


def test_int8_all_zero_block_and_exact_values() -> None:
    x = torch.zeros(300)
    x[260] = 127.0  # second block: scale 1, integers are exact
    x[261] = -3.0
    assert torch.equal(dequantize_int8(quantize_int8(x), 300), x)


@pytest.mark.parametrize("compression, per_element", [("fp32", 4), ("bf16", 2), ("int8", 1)])
def test_bytes_on_the_wire_are_counted_analytically(compression: str, per_element: int) -> None:
    numel = 1000
    expected = numel * per_element + (4 * math.ceil(numel / INT8_BLOCK) if compression == "int8" else 0)
    payload = compress(torch.randn(numel), compression)
    assert payload.numel() * payload.element_size() == payload_bytes(numel, compression) == expected
    model = nn.Linear(10, 100)  # 1100 elements
    diloco = DiLoCo(list(model.named_parameters()), None, every=2, compression=compression, nesterov=False)
    for _ in range(4):
        _sgd_step(model)
        diloco.after_inner_step()
    assert diloco.bytes_last_sync == diloco.bytes_total == 0  # one replica: nothing crosses a link


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_compressed_exchange_sends_the_all_reduce_bytes_at_the_compressed_size(ranks: int) -> None:
    """fp32: one all-reduce of 4 bytes per element. Compressed: an all-to-all and an all-gather of ``ranks`` chunk
    payloads, i.e. 2 (n-1)/n payloads on the wire per rank (bus bytes), as a ring all-reduce: the wire bytes fall by
    the compression ratio at any replica count (an all-gather of whole payloads would send n-1 of them)."""
    numel = 1_000_000
    assert exchange_sizes(numel, "fp32", ranks) == [("all_reduce", 4 * numel)]
    fp32_wire = 2 * (ranks - 1) / ranks * 4 * numel
    for compression, ratio in (("bf16", 2.0), ("int8", 4 / (1 + 4 / INT8_BLOCK))):
        chunk = chunk_numel(numel, ranks)
        assert chunk % INT8_BLOCK == 0 and 0 <= ranks * chunk - numel < ranks * INT8_BLOCK
        sizes = exchange_sizes(numel, compression, ranks)
        assert [op for op, _ in sizes] == ["all_to_all", "all_gather"]
        assert all(size == ranks * payload_bytes(chunk, compression) for _, size in sizes)
        wire = sum((ranks - 1) / ranks * size for _, size in sizes)  # both ops' bus factor is (n-1)/n
        assert fp32_wire / wire == pytest.approx(ratio, rel=2e-3)


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_a_compressed_mean_rounds_twice_within_its_bound(compression: str) -> None:
    x = torch.randn(5000) * torch.logspace(-3, 1, 5000)
    mean = start_mean(x, None, compression).result()
    assert mean.shape == x.shape
    if compression == "bf16":
        assert torch.all((mean - x).abs() <= 2**-8 * 2 * x.abs() + 1e-12)
    else:
        scale = torch.nn.functional.pad(x, (0, 120)).abs().view(-1, INT8_BLOCK).amax(1) / 127  # per block
        # scale / 2 for each rank's chunk, then scale / 2 again for the chunk mean (one rank: the same block)
        assert torch.all((mean - x).abs() <= scale.repeat_interleave(INT8_BLOCK)[:5000] * 1.01)


def test_fragments_are_contiguous_balanced_and_follow_blocks() -> None:
    sizes = [("embed.w", 100), ("layers.0.a", 50), ("layers.0.b", 50), ("layers.1.a", 100), ("layers.2.a", 100),
             ("layers.3.a", 100), ("norm.w", 10), ("head.w", 100)]  # fmt: skip
    blocks = ["layers.0", "layers.1", "layers.2", "layers.3"]
    fragments = build_fragments(sizes, 2, blocks)
    assert fragments == [["embed.w", "layers.0.a", "layers.0.b", "layers.1.a"],
                         ["layers.2.a", "layers.3.a", "norm.w", "head.w"]]  # fmt: skip
    assert build_fragments(sizes, 1, blocks) == [[name for name, _ in sizes]]  # F=1: the plain DiLoCo fragment
    assert [len(f) for f in build_fragments(sizes, 4, blocks)] == [3, 1, 1, 3]
    assert [len(f) for f in build_fragments(sizes, 8)] == [1] * 8  # no blocks: parameters are the units
    with pytest.raises(ValueError, match=r"^parallelism.diloco.fragments=5 but the model has 4 blocks"):
        build_fragments(sizes, 5, blocks)


def test_streaming_schedule_staggers_fragments() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fragments = build_fragments([(n, p.numel()) for n, p in model.named_parameters()], 2)
    diloco = DiLoCo(list(model.named_parameters()), None, fragments=fragments, every=4, nesterov=False)
    assert [diloco.syncs_at(step) for step in range(1, 9)] == [[], [1], [], [0], [], [1], [], [0]]
    plain = DiLoCo(list(model.named_parameters()), None, every=4, nesterov=False)
    assert [plain.syncs_at(step) for step in range(1, 9)] == [[], [], [], [0], [], [], [], [0]]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"sync": "sometimes"}, r"^parallelism.sync='sometimes' is unknown"),
        ({"compression": "int4"}, r"^parallelism.diloco.compression='int4' is unknown"),
        ({"every": 4, "fragments": 2, "delay": 2}, r"^parallelism.diloco.delay=2 must be in \[0, .* = 2\)"),
        ({"every": 2, "fragments": 3}, r"^parallelism.diloco.fragments=3 must be in \[1, parallelism.diloco.every=2\]"),
        ({"outer_momentum": 0.0}, r"^parallelism.diloco.nesterov=true needs parallelism.diloco.outer_momentum > 0"),
        ({"alpha": 1.5}, r"^parallelism.diloco.alpha=1.5 must be in \[0, 1\]"),
    ],
)
def test_option_errors_are_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        Parallelism().with_fields(**fields)
    assert "\n" not in str(err.value)


def test_diloco_needs_replicas() -> None:
    options = Parallelism(sync="diloco")
    with pytest.raises(ValueError, match=r"sync=diloco averages replicas on dp_replicate .*dp_replicate >= 2") as e:
        options.check(ParallelDims(world_size=2, dp_shard=2))
    assert "\n" not in str(e.value) and "parallelism.dp_replicate" in str(e.value)
    options.check(ParallelDims(world_size=4, dp_replicate=2, dp_shard=2))  # fine


def _sgd_step(model: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * torch.randn(p.shape, generator=generator))


def _run(model: nn.Module, diloco: DiLoCo, steps: range) -> None:
    for step in steps:
        _sgd_step(model, seed=step)
        diloco.after_inner_step()


def _make(model: nn.Module) -> DiLoCo:
    fragments = build_fragments([(n, p.numel()) for n, p in model.named_parameters()], 2)
    return DiLoCo(list(model.named_parameters()), None, fragments=fragments, every=4, delay=1, alpha=0.25,
                  outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression="int8")  # fmt: skip


def _fill(targets: dict, saved: dict) -> None:
    """What DCP's load does: the saved tensors' values into the targets, in place."""
    for key, value in targets.items():
        if isinstance(value, dict):
            _fill(value, saved[key])
        else:
            value.copy_(saved[key])


def test_state_dict_round_trip_mid_cycle_with_an_exchange_in_flight() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    whole = _make(model)
    _run(model, whole, range(1, 11))
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(start)
    diloco = _make(model)
    _run(model, diloco, range(1, 7))  # fragment 1 started at step 6, due at 7: in flight
    assert list(diloco._in_flight) == [1] and not diloco.replicas_equal
    state = diloco.state_dict()
    assert set(state["average"]) == set(diloco.fragments[1]) and state["in_flight"] == {1: 7}
    moved = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # other initial values
    fresh.load_state_dict(moved)  # the replica's parameters: the strategy loads them with the model's
    resumed = _make(fresh)
    targets = resumed.empty_state(list(state["in_flight"]), momentum=True)
    _fill(targets, state)
    resumed.load_state_dict({"step": state["step"], "in_flight": state["in_flight"], **targets})
    _run(fresh, resumed, range(7, 11))
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, uninterrupted[key]), key
    assert (resumed.step, resumed.bytes_total) == (whole.step, whole.bytes_total)


def test_replicas_equal_right_after_a_whole_outer_step_only() -> None:
    model = nn.Linear(4, 2)
    for delay, equal in ((0, [False, True, False, True]), (1, [False, False, True, False])):
        diloco = DiLoCo(list(model.named_parameters()), None, every=2, delay=delay, nesterov=False)
        assert diloco.replicas_equal  # nothing trained yet
        steps = []
        for step in range(4):
            _sgd_step(model, seed=step)
            diloco.after_inner_step()
            steps.append(diloco.replicas_equal)
        assert steps == equal, delay
    streaming = _make(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))  # F=2: the fragments sync apart
    streaming.step = 8
    assert not streaming.replicas_equal


def test_fragments_split_otherwise_or_replicas_changed_mid_cycle_are_one_line() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    saved = _make(model).state_dict()
    params = list(model.named_parameters())
    regrouped = DiLoCo(params, None, fragments=[[n for n, _ in params[:1]], [n for n, _ in params[1:]]], every=4)
    with pytest.raises(ValueError, match=r"has 0.weight in fragment 1 and this layout in fragment 0 .*pp degree") as e:
        regrouped.load_state_dict({**saved, "fragment": {"0.weight": torch.tensor([1])}})
    assert "\n" not in str(e.value)
    meta = {"replicas": 2, "step": 3, "equal": False, "fragments": 1}
    with pytest.raises(ValueError, match=r"dp_replicate=2 between outer steps .*resume with dp_replicate=2") as e:
        replica_key(Path("ckpt"), meta, 4, 1, 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"diloco.fragments=1 and this run has 2; resume with .*diloco.fragments=1"):
        replica_key(Path("ckpt"), meta, 2, 1, 2)
    assert replica_key(Path("ckpt"), meta, 2, 1, 1) == "replica1"  # each replica its own
    assert replica_key(Path("ckpt"), meta, 2, 0, 1) == ""  # replica 0's at the top, as any run's
    assert replica_key(Path("ckpt"), {**meta, "equal": True}, 4, 3, 1) == ""  # equal replicas: replica 0's


def test_lightning_ddp_refuses_diloco() -> None:
    from lightning_dist.strategies import DataParallelStrategy

    with pytest.raises(ValueError, match=r"DataParallelStrategy averages gradients every step, so .*sync=diloco"):
        DataParallelStrategy(parallelism=Parallelism(sync="diloco"))

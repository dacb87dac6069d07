"""Activation checkpointing on the reference GPT: the same gradients, fewer saved activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dist.models.gpt import GPT, GPTConfig
from lightning_dist.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_dist.parallel.options import ActivationCheckpointOptions

CFG = GPTConfig(vocab_size=64, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=64)
MODES = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


def _saved_bytes_and_grads(
    mode: str, selective: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[torch.Tensor]]:
    """Bytes kept for backward after the forward: what autograd packs, plus what op-level SAC stores aside."""
    from lightning_dist.parallel import activation_checkpoint

    sac_storages = []
    real = activation_checkpoint.create_selective_checkpoint_contexts

    def recording(policy):
        forward_context, recompute_context = real(policy)
        sac_storages.append(forward_context.storage)  # torch's cache of the saved op outputs (test-only peek)
        return forward_context, recompute_context

    monkeypatch.setattr(activation_checkpoint, "create_selective_checkpoint_contexts", recording)
    torch.manual_seed(0)
    model = GPT(CFG)
    model.init_weights(0)
    apply_activation_checkpointing(list(model.layers.values()), ActivationCheckpointOptions(mode, selective))
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(tensor, torch.nn.Parameter):  # activations only, not the weights autograd keeps anyway
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    for storage in sac_storages:
        for outputs in storage.values():  # per op: a dict by call index (torch 2.13), a list (torch 2.11)
            for kept in outputs.values() if isinstance(outputs, dict) else outputs:  # a version wrapper or the output
                for tensor in torch.utils._pytree.tree_leaves(getattr(kept, "val", kept)):
                    if isinstance(tensor, torch.Tensor):
                        saved += tensor.numel() * tensor.element_size()
    loss.backward()
    return saved, [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], tuple[int, list[torch.Tensor]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {mode: _saved_bytes_and_grads(*mode, monkeypatch) for mode in MODES}


def test_gradients_are_identical_with_and_without_checkpointing(runs) -> None:
    _, reference = runs[("none", "op")]
    for mode in MODES[1:]:
        for grad, ref in zip(runs[mode][1], reference):
            torch.testing.assert_close(grad, ref, rtol=0, atol=0, msg=str(mode))


def test_saved_activation_bytes_fall_as_expected(runs) -> None:
    none, full = runs[("none", "op")][0], runs[("full", "op")][0]
    op, every2 = runs[("selective", "op")][0], runs[("selective", "2")][0]
    # Full keeps one (B, T, C) input per block plus what lies outside the blocks (embedding, norm, head, loss).
    assert full < 0.35 * none, (full, none)
    # Op-level keeps the matmul outputs only: between full and none.
    assert full < op < 0.8 * none, (full, op, none)
    # Every 2nd block: half the blocks keep everything.
    assert full < every2 < none and every2 == pytest.approx((none + full) / 2, rel=0.15), (full, every2, none)


def test_unknown_modes_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing.mode='half' is unknown; use none, full"):
        ActivationCheckpointOptions("half")
    with pytest.raises(
        ValueError, match=r"activation_checkpointing.selective='0': use op \(keep matmul outputs\), op_half"
    ):
        ActivationCheckpointOptions("selective", "0")
    with pytest.raises(ValueError, match=r"needs the model's blocks: define pipeline_spec"):
        apply_activation_checkpointing([], ActivationCheckpointOptions("full"))

"""Every HuggingFace family: exact or refused before launch, never silently different.

- The family matrix (``lightning_dist/models/hf_families.json``, shown in ``docs/reference/hf-families.md``) lists
  every decoder-only causal LM of the installed transformers; a new release fails here until it is regenerated
  (``python tests/support/hf_matrix.py --write``), so a new family is a new row, not a silent difference.
- Every family's meta-device build gets transformers' own values (``init``), as the matrix says.
- The layouts that exercise what families add, on 2 ranks against one process: Gemma2's logit soft-capping,
  embedding scale and sliding windows, Gemma3's per-layer attention types, Granite's multipliers, a Mistral window
  below the sequence, OLMo's final norm without parameters, the TP styles of Qwen3 (per-head norms), Phi3 (fused
  projections) and OLMo2 (full-width norms), GPT-NeoX under FSDP2 without a pipeline spec; the MoE families' own
  experts split over ep (Mixtral, Qwen3-MoE), Qwen3-MoE's router (a tuple of outputs) and dense-layer plan entries
  under tp, Qwen2-MoE's one-row shared-expert gate sharded unevenly by FSDP2.
- What the matrix refuses is one line before launch, and so are an attention implementation a family lacks and a
  bad ``parallelism.tensor.plan``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import FAST, compose_config
from support.hf_matrix import DOCS_PATH, LAYOUTS, RTOL, _batches, check_init, fit_losses, markdown, verdict
from support.hf_tiny import decoder_families, tiny_config

from lightning_dist.config.validate import validate
from lightning_dist.models.hf_families import family_matrix
from lightning_dist.run.launch import launch

HF_FAST = [o for o in FAST if not o.startswith("model.")] + ["model=hf"]

#: (family, layout) pairs run here on every test run; the whole matrix is `hf_matrix.py`'s (about 15 minutes).
CURATED = [("gemma2", "pp2"), ("gemma2", "tp2"), ("gemma3_text", "pp2"), ("granite", "pp2"), ("mistral", "pp2"),
           ("olmo", "pp2"), ("qwen3", "tp2"), ("phi3", "tp2"), ("olmo2", "tp2"), ("gpt_neox", "fsdp2"),
           ("mixtral", "ep2"), ("qwen3_moe", "ep2"), ("qwen3_moe", "tp2"), ("qwen2_moe", "fsdp2")]  # fmt: skip


def test_the_matrix_lists_every_family_of_the_installed_transformers() -> None:
    import transformers

    matrix = family_matrix()
    assert matrix["transformers"] == transformers.__version__, (
        f"the family matrix is of transformers {matrix['transformers']}, {transformers.__version__} is installed: "
        "regenerate it (python tests/support/hf_matrix.py --write)"
    )
    assert sorted(matrix["families"]) == decoder_families()
    assert DOCS_PATH.read_text() == markdown(matrix), "docs/reference/hf-families.md is stale: run hf_matrix.py --write"


@pytest.mark.parametrize("family", decoder_families())
def test_every_family_is_built_with_transformers_values_as_the_matrix_says(family: str) -> None:
    assert check_init(family) == family_matrix()["families"][family]["init"]


def test_gemma_gets_its_embedding_scale_and_zero_centred_norms() -> None:
    """The bug that trained a garbage Gemma: ``embed_scale`` (a non-persistent buffer) was uninitialized memory after
    the meta-device build, and the norms (applied as 1 + w) started at one."""
    from lightning_dist.models.hf_init import build_causal_lm, init_causal_lm

    model = build_causal_lm(tiny_config("gemma2"))
    model.to_empty(device="cpu")
    init_causal_lm(model, seed=0)
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(math.sqrt(model.config.hidden_size))
    assert all(float(layer.input_layernorm.weight.abs().max()) == 0.0 for layer in model.model.layers)


def _curated_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{family}|{layout}": fit_losses(family, LAYOUTS[layout]) for family, layout in CURATED}


def _curated_one_process() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {family: fit_losses(family, None) for family in sorted({family for family, _ in CURATED})}


@pytest.fixture(scope="module")
def curated() -> dict[str, Any]:
    one = launch(_curated_one_process, 1)[0]
    ranks = launch(_curated_ranks, 2)[0]
    return {f"{family}|{layout}": (ranks[f"{family}|{layout}"], one[family]) for family, layout in CURATED}


@pytest.mark.parametrize("family,layout", CURATED, ids=[f"{f}-{lay}" for f, lay in CURATED])
def test_what_a_family_adds_survives_the_layout(curated: dict[str, Any], family: str, layout: str) -> None:
    losses, reference = curated[f"{family}|{layout}"]
    assert verdict(losses, reference) == "exact", (losses, reference, RTOL)
    assert family_matrix()["families"][family][layout] == "exact"


def _config_dir(family: str, folder: Path) -> str:
    tiny_config(family).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "family,layout,message",
    [
        ("stablelm", "parallelism=tp", r"parallelism.tp=2 with model=hf 'stablelm': not exact for this family .*tp2:"),
        ("gemma2", "parallelism=fsdp", r"model.attn_implementation=sdpa: Gemma2ForCausalLM does not support it"),
        (
            "llama",
            "parallelism=ep",
            r"parallelism.ep=2 with model=hf 'llama': .*ep2: ValueError: ep=2 but the family has",
        ),
        ("mixtral", "parallelism.ep=3", r"parallelism.ep=3 does not divide the 4 experts of model=hf 'mixtral'"),
    ],
)
def test_a_refused_family_layout_is_one_line_before_launch(family: str, layout: str, message: str, tmp_path: Path):
    overrides = [*HF_FAST, f"model.config={_config_dir(family, tmp_path / 'config')}", layout]
    if layout == "parallelism.ep=3":
        overrides += ["parallelism=ep", "cluster.devices=3", "data.global_batch_size=6"]
    if family == "gemma2":
        overrides.append("model.attn_implementation=sdpa")
    with pytest.raises(ValueError, match=message):
        validate(compose_config(overrides))


def test_a_strategy_given_hf_causal_lm_directly_checks_ep_against_the_matrix() -> None:
    """Without the app's config check (a user's own Trainer and MeshStrategy(ep=2)), the module refuses ep for a
    family the matrix does not vouch for, before anything is sharded."""
    from lightning_dist.contract import declared_ep_spec
    from lightning_dist.models.hf import HFCausalLM

    with pytest.raises(ValueError, match=r"parallelism.ep=2 with model=hf 'llama': not exact .*ep2: ValueError: ep=2"):
        declared_ep_spec(HFCausalLM(tiny_config("llama")), 2)


def test_an_moe_config_asking_for_transformers_router_loss_is_refused(tmp_path: Path) -> None:
    """transformers adds its router auxiliary loss with ``output_router_logits``; lightning-dist trains the
    cross-entropy only, so such a config stops in one line instead of training without the loss it asked for."""
    config = tiny_config("mixtral")
    config.output_router_logits = True
    config.save_pretrained(tmp_path / "config")
    with pytest.raises(ValueError, match=r"'mixtral' has output_router_logits=true: .* set output_router_logits=false"):
        validate(compose_config([*HF_FAST, f"model.config={tmp_path / 'config'}"]))


def test_a_family_the_matrix_does_not_list_is_refused_unless_asked(tmp_path: Path, monkeypatch) -> None:
    from lightning_dist.models import hf_families

    config = _config_dir("llama", tmp_path / "config")
    rows = {k: v for k, v in family_matrix()["families"].items() if k != "llama"}
    monkeypatch.setattr(hf_families, "family_matrix", lambda: {**family_matrix(), "families": rows})
    overrides = [*HF_FAST, f"model.config={config}", "parallelism=fsdp"]
    with pytest.raises(ValueError, match=r"'llama' is not in the family matrix .* model.allow_untested_family=true"):
        validate(compose_config(overrides))
    validate(compose_config([*overrides, "model.allow_untested_family=true"]))


def test_a_tensor_parallel_plan_from_the_command_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("model.model.layers.*.self_attn.q_proj: colwise\nmodel.model.layers.*.self_attn.o_proj: rowwise\n")
    overrides = [*HF_FAST, "model.config=tiny_llama", "parallelism=tp", f"parallelism.tensor.plan={plan}"]
    assert dict(validate(compose_config(overrides)).parallelism.tensor.plan) == {
        "model.model.layers.*.self_attn.q_proj": "colwise",
        "model.model.layers.*.self_attn.o_proj": "rowwise",
    }
    plan.write_text("model.model.layers.*.self_attn.q_proj: columnwise\n")
    with pytest.raises(ValueError, match=r"style 'columnwise' of 'model.model.layers.\*.self_attn.q_proj' is unknown"):
        validate(compose_config(overrides))


def _first_losses(folder: str, names: list[str]) -> dict[str, float]:
    from lightning_dist.callbacks.checkpoints import InitWeights

    torch.set_num_threads(1)
    start = (InitWeights(Path(folder)),)
    return {name: fit_losses("mixtral", LAYOUTS[name], start, random_init=False, hf_source=folder)[0] for name in names}


def test_an_moe_saved_expert_by_expert_starts_every_layout_from_its_weights(tmp_path: Path) -> None:
    """transformers 5 saves an MoE's experts one by one and stacks them when it loads: read through its conversion
    rules (checkpoint/hf_conversion.py), each rank slicing its part, the first loss is transformers' own."""
    from safetensors import safe_open

    from lightning_dist.models.hf_init import causal_lm_class
    from lightning_dist.models.loss import token_loss

    config = tiny_config("mixtral")
    torch.manual_seed(1)
    reference = causal_lm_class(config)(config).eval()
    reference.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as saved:
        keys = list(saved.keys())
    assert any(".experts.0." in key for key in keys) and not any(key.endswith("experts.gate_up_proj") for key in keys)
    inputs, targets = _batches()
    with torch.no_grad():
        want = float(token_loss(reference(input_ids=inputs[:4], use_cache=False).logits, targets[:4]))
    ranks = launch(_first_losses, 2, str(tmp_path), ["fsdp2", "pp2", "ep2"])[0]  # ep2: each rank reads its experts
    assert all(ranks[layout] == pytest.approx(want, rel=RTOL) for layout in ("fsdp2", "pp2", "ep2")), (ranks, want)
    validate(compose_config([*HF_FAST, f"model.pretrained={tmp_path}", "parallelism=fsdp"]))  # names, before launch

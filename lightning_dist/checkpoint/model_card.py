"""The model card (``README.md``) of an export pushed to the hub, written from the run's ``report.json``: the base
model, the layout, the tokens seen, the loss curve, and LoRA's settings for an adapter."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from lightning_dist.checkpoint.adapters import lora_of

_SPARK = "▁▂▃▄▅▆▇█"


def base_model_of(hyper_parameters: dict[str, Any]) -> str | None:
    """The hub id (or folder name) of the model the run started from (``hf_source``): a HuggingFace cache snapshot
    ``.../models--org--name/snapshots/<sha>`` is ``org/name``."""
    source = hyper_parameters.get("hf_source")
    if not source:
        return None
    found = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", str(source))
    return f"{found.group(1)}/{found.group(2)}" if found else Path(source).name


def read_report(checkpoint: Path) -> dict[str, Any] | None:
    """The run's ``report.json`` beside its checkpoints (``<run>/checkpoints/step-N``), if it was written."""
    for folder in (checkpoint.parent.parent, checkpoint.parent):
        if (folder / "report.json").is_file():
            return json.loads((folder / "report.json").read_text())
    return None


def model_card(repo_id: str, hyper_parameters: dict[str, Any], report: dict[str, Any] | None, step: int | None) -> str:
    """The card's Markdown (with the hub's YAML metadata block)."""
    base = base_model_of(hyper_parameters)
    lora = lora_of(hyper_parameters)
    meta = ["---", "library_name: " + ("peft" if lora else "transformers"), "tags:", "- lightning-dist"]
    meta += ["- lora"] if lora else []
    meta += [f"base_model: {base}"] if base else []
    meta += ["pipeline_tag: text-generation", "---", ""]
    what = "a LoRA adapter" if lora else "a causal language model"
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"{what[0].upper()}{what[1:]} trained with lightning-dist {'on ' + base if base else 'from scratch'}.",
        "",
    ]
    rows = [("base model", base or "none (random initialization)")]
    if lora:
        targets = ", ".join(lora.targets) if lora.targets else "every linear layer of the blocks"
        rows += [("LoRA", f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, targets {targets}")]
    if report:
        steps = report.get("steps")
        rows += [("layout", str(report.get("layout", "")).replace("|", "/")), ("optimizer steps", str(steps))]
        if steps and report.get("tokens_per_step"):
            rows += [("tokens seen", f"{int(steps) * int(report['tokens_per_step']):,}")]
        if report.get("train_loss") is not None:
            rows += [("final train/loss", f"{report['train_loss']:.4f}")]
        if report.get("val_loss") is not None:
            rows += [("val/loss", f"{report['val_loss']:.4f}")]
        # What it ran on (report.json's "hardware" is the planner's assumption, not the run's devices)
        rows += [("trained on", str(report["devices"]))] if report.get("devices") else []
    if step is not None:
        rows += [("checkpoint", f"step {step}")]
    lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    curve = [(int(r["step"]), float(r["train/loss"])) for r in (report or {}).get("history", []) if "train/loss" in r]
    if curve:
        lines += [
            "## Training loss",
            "",
            f"`{sparkline([loss for _, loss in curve])}`",
            "",
            "| step | train/loss |",
            "|---:|---:|",
            *(f"| {s} | {loss:.4f} |" for s, loss in _thin(curve, 12)),
            "",
        ]
    usage = _usage(repo_id, base, lora is not None)
    return "\n".join([*meta, *lines, "## Use", "", "```python", *usage, "```", ""])


def sparkline(values: list[float]) -> str:
    """``values`` as a line of block characters (the lowest ``▁``, the highest ``█``)."""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - low) / span * len(_SPARK)))] for v in values)


def _thin(points: list[tuple[int, float]], most: int) -> list[tuple[int, float]]:
    """At most ``most`` of ``points``, evenly spaced, the first and the last kept."""
    if len(points) <= most:
        return points
    picks = {round(i * (len(points) - 1) / (most - 1)) for i in range(most)}
    return [points[i] for i in sorted(picks)]


def _usage(repo_id: str, base: str | None, adapter: bool) -> list[str]:
    if adapter:
        return [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        ]
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
    ]


def push_to_hub(
    folder: Path, repo_id: str, private: bool = False, leave_out: str | None = None, message: str | None = None
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it with huggingface_hub (the user's token,
    ``HF_ENDPOINT``); returns the commit's URL. ``leave_out``: a file name not uploaded (the export's marker).

    Raises:
        ValueError: huggingface_hub missing, or the upload failed (one line: the hub's refusal, or no connection).
    """
    try:
        import huggingface_hub  # optional: lightning-dist[hf]
    except ImportError:
        raise ValueError("--push-to-hub needs huggingface_hub: pip install 'lightning-dist[hf]'.") from None
    api = huggingface_hub.HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=message or f"Upload {folder.name} (lightning-dist)",
            ignore_patterns=[leave_out] if leave_out else None,
        )
    except (OSError, ValueError, huggingface_hub.errors.HfHubHTTPError) as err:
        raise ValueError(
            f"--push-to-hub {repo_id}: the hub refused ({_reason(err)}); check HF_TOKEN / `hf auth login` (a write "
            "token) and the repo name"
        ) from None
    except Exception as err:  # httpx's connection errors (no network, a proxy, DNS) are none of the above
        raise ValueError(
            f"--push-to-hub {repo_id}: the hub could not be reached ({type(err).__name__}: {_reason(err)}); check the "
            "network (HF_ENDPOINT, a proxy)"
        ) from None
    return str(commit)


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

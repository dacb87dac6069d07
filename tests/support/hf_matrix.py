"""The HuggingFace family matrix: every decoder-only causal LM of the installed transformers, built and trained by
lightning-dist, against transformers' own build and against one process.

For each family (``hf_tiny.tiny_config``):

- ``init``: the model built on the meta device and initialized by :func:`~lightning_dist.models.hf_init.init_causal_lm`
  against ``cls(config)``: every buffer and every constant tensor equal, every random one of the same spread (std
  within 25%).
- ``pretrained``: transformers' model saved with ``save_pretrained`` and read by ``InitWeights`` into a model built
  on the meta device: the first training loss equal to transformers' forward on the same batch (rtol 1e-5).
- ``chunked``: 4 steps with ``parallelism.loss_chunks=4`` (the head and loss in pieces, whatever the family does to
  its logits) against the plain loss, in one process.
- ``fsdp2``, ``tp2``, ``pp2``, ``cp2``: 4 AdamW steps of ``HFCausalLM(config)`` on 2 CPU ranks against the same steps
  in one process, the losses equal (rtol 1e-5). Where the tiny config's sliding windows are what ``cp2`` refuses
  (a config-level one-line refusal, ``hf_context.check_context_parallel``, that applies to any family), ``cp2`` is the
  family run with its windows off (:func:`windowless_cp`): the cell says whether the family's code is exact under
  cp, and a config with a window is refused by that check at launch, as before.

A verdict is ``exact`` or the one line saying why not (an error, or how far it differs); anything but ``exact`` is
refused before launch (``lightning_dist/models/hf_families.py``). ``python tests/support/hf_matrix.py --write``
writes ``lightning_dist/models/hf_families.json`` and ``docs/reference/hf-families.md`` (about 15 minutes on 2 cores);
``tests/foreign/test_hf_families.py`` checks that they describe the installed transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support")]

LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp2": {"dp_shard": 2},
    "tp2": {"tp": 2, "dp_shard": 1},
    "pp2": {"pp": 2, "dp_shard": 1},
    "cp2": {"cp": 2, "dp_shard": 1},
    "ep2": {"ep": 2, "dp_shard": 2},  # run for MoE families only (moe_layouts); the rest get their one-line refusal
}
#: One-process checks: the meta-device build, the first loss from saved weights, the chunked loss (loss_chunks=4).
SINGLE = ("init", "pretrained", "chunked")
COLUMNS = (*SINGLE, *LAYOUTS)
STEPS, BATCH, SEQ, RTOL = 4, 4, 32, 1e-5
JSON_PATH = ROOT / "lightning_dist" / "models" / "hf_families.json"
DOCS_PATH = ROOT / "docs" / "reference" / "hf-families.md"


def _batches() -> Any:
    import torch

    tokens = torch.randint(3, 200, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:200]


def fit_losses(
    model_type: str,
    layout: dict[str, int] | None,
    callbacks: tuple = (),
    loss_chunks: int = 0,
    windowless: bool = False,
    devices: int = 2,
    **module_kwargs: Any,
) -> Any:
    """The losses of ``STEPS`` steps of ``HFCausalLM(tiny config)`` on one process (``layout=None``) or on this
    rank of ``devices`` under ``MeshStrategy(**layout)`` (collectives time out after 2 minutes)."""
    from datetime import timedelta

    import lightning.pytorch as pl
    from helpers import quiet_trainer
    from hf_tiny import tiny_config
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist import MeshStrategy
    from lightning_dist.models.hf import HFCausalLM

    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train/loss"]))

    module = HFCausalLM(tiny_config(model_type, windowless), lr=1e-2, **module_kwargs)
    module.set_loss_chunks(loss_chunks)
    per_rank = BATCH // (layout or {}).get("dp_shard", 1)
    strategy, devices = (
        ("auto", 1) if layout is None else (MeshStrategy(**layout, timeout=timedelta(minutes=2)), devices)
    )
    trainer = quiet_trainer(strategy, devices, STEPS, callbacks=[Record(), *callbacks])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TensorDataset(*_batches()), batch_size=per_rank))
    return losses


def _losses_or_line(model_type: str, layout: dict[str, int] | None, *args: Any, **kwargs: Any) -> Any:
    """:func:`fit_losses`, or its error's one line (one process: nothing to hang)."""
    try:
        return fit_losses(model_type, layout, *args, **kwargs)
    except Exception as err:  # a verdict: the family fails here, in one line
        return _line(err)


def check_init(model_type: str) -> str:
    """Our meta build + init against ``cls(config)`` (see the module docstring)."""
    import torch
    from hf_tiny import tiny_config

    from lightning_dist.models.hf_init import build_causal_lm, causal_lm_class, init_causal_lm

    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        reference = causal_lm_class(config)(config)
        ours = build_causal_lm(config)
        ours.to_empty(device="cpu")
        init_causal_lm(ours, seed=0)
    except Exception as err:
        return _line(err)
    theirs = dict(reference.named_parameters()) | dict(reference.named_buffers())
    mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
    buffers = {name for name, _ in reference.named_buffers()}
    for name, want in theirs.items():
        got = mine[name].detach().float()
        want = want.detach().float()
        if name in buffers or want.numel() < 4 or float(want.std()) == 0.0:
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-7, equal_nan=True):
                return f"{name} differs from transformers' build: {_sample(got)} vs {_sample(want)}"
        elif not math.isclose(float(got.std()), float(want.std()), rel_tol=0.25):
            return f"{name} has std {float(got.std()):.3g} where transformers' build has {float(want.std()):.3g}"
    return "exact"


def _sample(tensor: Any) -> str:
    return str([round(v, 4) for v in tensor.flatten()[:3].tolist()])


def check_pretrained(model_type: str) -> str:
    """transformers' weights read into a meta-built model: the first loss against transformers' own forward."""
    import torch
    from hf_tiny import tiny_config

    from lightning_dist.callbacks.checkpoints import InitWeights
    from lightning_dist.models.hf_init import causal_lm_class
    from lightning_dist.models.loss import token_loss

    try:
        config = tiny_config(model_type)
        torch.manual_seed(1)
        reference = causal_lm_class(config)(config).eval()
        inputs, targets = _batches()
        with torch.no_grad():
            want = float(token_loss(reference(input_ids=inputs[:BATCH], use_cache=False).logits, targets[:BATCH]))
        with tempfile.TemporaryDirectory() as folder:
            reference.save_pretrained(folder)
            got = _losses_or_line(model_type, None, (InitWeights(Path(folder)),), random_init=False, hf_source=folder)
    except Exception as err:
        return _line(err)
    if isinstance(got, str):
        return got.replace(folder, "<saved folder>")  # the same line on every run
    if not math.isclose(got[0], want, rel_tol=RTOL):
        return f"first loss {got[0]:.6f} where transformers gives {want:.6f}"
    return "exact"


def _one_process(families: list[str]) -> dict[str, dict[str, Any]]:
    """The one-process checks of every family, in one process (no process group: nothing to hang or pile up)."""
    import torch

    torch.set_num_threads(1)
    found = {}
    for mt in families:
        reference = _losses_or_line(mt, None)
        chunked = verdict(_losses_or_line(mt, None, loss_chunks=4), reference)
        found[mt] = {"init": check_init(mt), "pretrained": check_pretrained(mt), "chunked": chunked,
                     "reference": reference}  # fmt: skip
    return found


def _layouts(model_type: str, names: list[str], windowless: bool = False) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return {name: fit_losses(model_type, LAYOUTS[name], windowless=windowless) for name in names}


def _windowless_reference(model_type: str) -> Any:
    import torch

    torch.set_num_threads(1)
    return _losses_or_line(model_type, None, windowless=True)


def windowless_cp(model_type: str) -> str | None:
    """The ``cp2`` verdict of ``model_type`` with its sliding windows off, against one process with them off;
    ``None`` where the family cannot run without them (its config or its layers need a window: Gemma 3, GPT-OSS)."""
    from lightning_dist.run.launch import RankFailedError, launch

    reference = launch(_windowless_reference, 1, model_type)[0]
    if isinstance(reference, str):
        return None
    try:
        found = launch(_layouts, 2, model_type, ["cp2"], True)[0]["cp2"]
    except RankFailedError as err:
        found = str(err).split(": ", 1)[-1][:200]
    return verdict(found, reference)


def _window_refused(cell: str) -> bool:
    return "with sliding_window=" in cell


def has_experts(model_type: str) -> bool:
    """Whether the family's tiny model has experts expert parallelism takes (built on the meta device)."""
    import torch
    from hf_tiny import tiny_config

    from lightning_dist.models.hf_experts import hf_expert_parallel_spec
    from lightning_dist.models.hf_init import build_causal_lm

    with torch.device("meta"):
        try:
            return hf_expert_parallel_spec(build_causal_lm(tiny_config(model_type))) is not None
        except Exception:  # a family that cannot be built has its reason in every other cell
            return False


#: The ep2 cell of a family without experts of the stacked interface (``hf_experts.py``).
NO_EXPERTS = "ValueError: ep=2 but the family has no MoE experts of the stacked interface (hf_experts.py)"


def family_row(model_type: str, one: dict[str, Any]) -> dict[str, Any]:
    """One family's layouts against its one-process checks ``one``, in processes of their own: the two-rank layouts
    in one launch, and where one fails (a rank's error ends the launch; a hang, its timeout), each layout again in a
    launch of its own. ``ep2`` runs for families with experts only."""
    from lightning_dist.run.launch import RankFailedError, launch

    names = [name for name in LAYOUTS if name != "ep2" or has_experts(model_type)]
    try:
        found = launch(_layouts, 2, model_type, names)[0]
    except RankFailedError:
        found = {}
        for name in names:
            try:
                found[name] = launch(_layouts, 2, model_type, [name])[0][name]
            except RankFailedError as err:
                found[name] = str(err).split(": ", 1)[-1][:200]  # "rank 1: <its one line>"
    found.setdefault("ep2", NO_EXPERTS)
    row = {**{column: one[column] for column in SINGLE},
           **{name: verdict(found[name], one["reference"]) for name in LAYOUTS}}  # fmt: skip
    if _window_refused(row["cp2"]):
        row["cp2"] = windowless_cp(model_type) or row["cp2"]
    return row


def _reference(model_type: str) -> Any:
    import torch

    torch.set_num_threads(1)
    return _losses_or_line(model_type, None)


def redo_layouts(families: list[str]) -> dict[str, Any]:
    """The layout cells of ``families`` again (the one-process cells kept from the committed matrix), printed as each
    family ends: after a change that can only touch the layouts (a new axis, a sharding fix)."""
    from lightning_dist.run.launch import launch

    matrix = json.loads(JSON_PATH.read_text())
    for mt in families:
        row = matrix["families"][mt]
        one = {**{column: row[column] for column in SINGLE}, "reference": launch(_reference, 1, mt)[0]}
        row.update(family_row(mt, one))
        print(mt, {k: v if v == "exact" else v[:70] for k, v in row.items()}, flush=True)
    return matrix


def verdict(losses: Any, reference: Any) -> str:
    """``exact`` when ``losses`` equal ``reference`` (rtol 1e-5), else why not in one line."""
    if isinstance(losses, str):
        return losses
    if isinstance(reference, str):
        return f"one process fails: {reference}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    return "exact" if worst <= RTOL else f"differs from one process by {worst:.2g} (relative)"


#: Where a run keeps what it has done, so one that stops (a crash, a kill) goes on from there.
PROGRESS = Path(tempfile.gettempdir()) / "lightning_dist_hf_matrix_progress.json"
BATCH_FAMILIES = 20  # one-process checks per launch: what a crash can lose


def build_matrix(families: list[str], one_process_only: bool = False) -> dict[str, Any]:
    """Every check of every family (:func:`family_row`), printed as each family ends; progress kept in
    :data:`PROGRESS` (delete it to start over)."""
    import torch
    import transformers
    from hf_tiny import resolve_classes

    from lightning_dist.models.hf_families import family_matrix
    from lightning_dist.run.launch import launch

    version = transformers.__version__
    progress = json.loads(PROGRESS.read_text()) if PROGRESS.exists() else {}
    if progress.get("transformers") != version or progress.get("one_process_only") != one_process_only:
        progress = {"transformers": version, "one_process_only": one_process_only, "single": {}, "rows": {}}
    todo = [mt for mt in families if mt not in progress["single"]]
    for start in range(0, len(todo), BATCH_FAMILIES):
        progress["single"].update(launch(_one_process, 1, todo[start : start + BATCH_FAMILIES])[0])
        PROGRESS.write_text(json.dumps(progress))
    for model_type in families:
        if model_type not in progress["rows"]:
            one = progress["single"][model_type]
            if one_process_only:  # the layouts' cells kept from the committed matrix
                row = {**family_matrix()["families"][model_type], **{c: one[c] for c in SINGLE}}
            else:
                row = family_row(model_type, one)
            progress["rows"][model_type] = {"class": resolve_classes(model_type)[1].__name__, **row}
            PROGRESS.write_text(json.dumps(progress))
        row = progress["rows"][model_type]
        print(model_type, {k: v if v == "exact" else v[:70] for k, v in row.items()}, flush=True)
    rows = {mt: progress["rows"][mt] for mt in families}
    return {"transformers": version, "torch": torch.__version__.split("+")[0], "families": rows}


def markdown(matrix: dict[str, Any]) -> str:
    """The docs page: one row per family, one column per check (``exact`` or the reason it is refused)."""
    lines = [
        "# HuggingFace families: what is exact and what is refused",
        "",
        f"Generated by `python tests/support/hf_matrix.py --write` on transformers {matrix['transformers']} (torch "
        f"{matrix['torch']}, CPU, fp32); `tests/foreign/test_hf_families.py` fails when it no longer describes the "
        "installed transformers. Each family's tiny config (`tests/support/hf_tiny.py`) is built and trained by "
        "lightning-dist: `init` is the meta-device build against transformers' own, `pretrained` the first loss from "
        "weights transformers saved, and each layout 4 steps on 2 CPU ranks against one process (rtol 1e-5). A cell "
        "that is not `exact` says why, and that family is refused under that layout before launch (one line; "
        "`model.allow_untested_family=true` runs a family this table does not list). `cp2` runs a tiny config with "
        "sliding windows with its windows off: a config with a window is refused under cp by its own one-line check "
        "(the cp attention is full causal attention), whatever the family. `ep2` runs the MoE families whose experts "
        "have transformers' stacked interface (`models/hf_experts.py`) with their experts split over 2 ranks; the "
        "others are refused under `parallelism.ep`.",
        "",
        "| family | class | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for mt, row in sorted(matrix["families"].items()):
        cells = [row[column].replace("|", "/") for column in COLUMNS]
        lines.append(f"| {mt} | {row['class']} | " + " | ".join(cells) + " |")
    exact = {column: sum(row[column] == "exact" for row in matrix["families"].values()) for column in COLUMNS}
    lines += ["", f"{len(matrix['families'])} families; exact: " + ", ".join(f"{c} {n}" for c, n in exact.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    import os

    from hf_tiny import decoder_families

    from lightning_dist.models.hf_families import GENERATING

    os.environ[GENERATING] = "1"  # every cell is run, none refused by the matrix being made (ranks inherit it)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every decoder-only family)")
    parser.add_argument("--write", action="store_true", help="write the JSON and the docs page")
    parser.add_argument("--one-process-only", action="store_true", help="redo the one-process columns only")
    parser.add_argument("--windowless-cp", action="store_true", help="redo the cp2 cells a sliding window refused")
    parser.add_argument("--layouts", action="store_true", help="redo the layout cells only (one-process cells kept)")
    args = parser.parse_args()
    families = args.families or decoder_families()
    if args.windowless_cp:
        matrix = json.loads(JSON_PATH.read_text())
        for mt in families:
            row = matrix["families"][mt]
            if _window_refused(row["cp2"]):
                row["cp2"] = windowless_cp(mt) or row["cp2"]
                print(mt, row["cp2"][:100], flush=True)
    elif args.layouts:
        matrix = redo_layouts(families)
    else:
        matrix = build_matrix(families, args.one_process_only)
    if args.write:
        if (args.families or args.one_process_only) and JSON_PATH.exists():  # update these rows only
            whole = json.loads(JSON_PATH.read_text())
            whole["families"].update(matrix["families"])
            matrix = {**matrix, "families": whole["families"]}
        JSON_PATH.write_text(json.dumps(matrix, indent=1, sort_keys=True) + "\n")
        DOCS_PATH.write_text(markdown(matrix))


if __name__ == "__main__":
    main()

"""Which HuggingFace families are exact under which layout: the family matrix, checked before launch.

``hf_families.json`` (beside this file) is written by ``tests/support/hf_matrix.py`` from what the installed
transformers provides: for every decoder-only causal-LM family, whether lightning-dist's meta-device build equals
transformers' (``init``), whether transformers' saved weights give transformers' first loss (``pretrained``), whether
the chunked loss equals the plain one (``chunked``), and whether 4 steps under fsdp2 / tp2 / pp2 / cp2 equal one
process (and ep2 for MoE families: experts split over 2 ranks). A family is run only where its cell is ``exact``;
any other cell is the reason it is refused, in one line, before a process starts. A family the matrix does not list
(a newer transformers) is refused too, unless ``model.allow_untested_family=true``. ``docs/reference/hf-families.md``
shows the same table. Torch-free: the launcher reads it.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

MATRIX = Path(__file__).with_name("hf_families.json")
#: The matrix column that vouches for each axis when its degree is above one.
AXIS_COLUMNS = {"dp_shard": "fsdp2", "tp": "tp2", "pp": "pp2", "cp": "cp2", "ep": "ep2"}
DOCS = "docs/reference/hf-families.md"
#: Set to ``1`` while ``tests/support/hf_matrix.py`` fills the matrix: nothing is refused then.
GENERATING = "LIGHTNING_DIST_GENERATING_FAMILY_MATRIX"


@functools.cache
def family_matrix() -> dict[str, Any]:
    """The committed matrix: ``{"transformers": version, "families": {model_type: {column: verdict}}}``."""
    return json.loads(MATRIX.read_text())


def check_family(
    config: Any, degrees: dict[str, int], start: str | None, allow_untested: bool = False, loss_chunks: int = 0
) -> None:
    """Refuse, in one line, a family / layout the matrix does not vouch for.

    Args:
        config: The transformers config of the run's model.
        degrees: The layout's degrees by axis name (``ParallelDims.degrees``); those above one are checked.
        start: ``"init"`` (a model built from its config, initialized here), ``"pretrained"`` (saved weights read
            into it), or ``None`` (a model built by the user: its values are kept).
        allow_untested: Run a family the matrix does not list (``model.allow_untested_family``).
        loss_chunks: ``parallelism.loss_chunks``: above 0, the chunked loss's cell is checked too.

    Raises:
        ValueError: The family, under this layout, is not ``exact`` in the matrix (or is not in it).
    """
    if os.environ.get(GENERATING) == "1":
        return  # the matrix's own generation (tests/support/hf_matrix.py) runs every cell to fill it
    matrix = family_matrix()
    model_type = getattr(config, "model_type", None)
    row = matrix["families"].get(model_type)
    if row is None:
        if allow_untested:
            return
        raise ValueError(
            f"model=hf {model_type!r} is not in the family matrix (transformers {matrix['transformers']}; {DOCS}), "
            "so no layout of it was checked against one process; set model.allow_untested_family=true to run it "
            "anyway, or regenerate the matrix (python tests/support/hf_matrix.py --write)."
        )
    names = {"init": "model.config", "pretrained": "model.pretrained"}
    checks = [(start, names[start])] if start is not None else []
    checks += [
        (column, f"parallelism.{axis}={degrees[axis]}")
        for axis, column in AXIS_COLUMNS.items()
        if degrees.get(axis, 1) > 1
    ]
    if loss_chunks > 0:
        checks.append(("chunked", f"parallelism.loss_chunks={loss_chunks}"))
    for column, what in checks:
        cell = row.get(column, "not checked")
        if cell != "exact":
            raise ValueError(
                f"{what} with model=hf {model_type!r}: not exact for this family in the family matrix ({column}: "
                f"{cell}; {DOCS}); use another layout or family."
            )

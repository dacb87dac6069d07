"""``lightning-dist-eval RUN|HF_FOLDER --tasks ...``: a run's model on lm-evaluation-harness tasks.

The model is what :func:`~lightning_dist.checkpoint.hf_model.resolve_hf_model` finds (a checkpoint's ``hf/`` save,
else the checkpoint exported; a LoRA run's adapter on its base model), evaluated by lm-eval's HuggingFace backend
(:func:`lightning_dist.callbacks.evaluation.evaluate`). The metrics are printed as ``eval/<task>/<metric>`` and, for a
run folder or one of its checkpoints, written to ``<run>/eval/<checkpoint>.json`` (``step-00000500.json``) with
lm-eval's whole result (or to ``--output``). A failure is one line, and nothing is written.

Examples::

    lightning-dist-eval outputs/2026-11-24/10-00-00 --tasks hellaswag arc_easy --limit 200
    lightning-dist-eval finetuned/ --tasks my_task --include-path tasks/     # a task YAML of your own
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def _limit(text: str) -> int | float:
    value = float(text)
    return int(value) if value >= 1 else value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a run folder, a checkpoint, or a HuggingFace / peft adapter folder")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names (or of your --include-path)")
    parser.add_argument("--include-path", type=Path, help="a folder of task YAML files of your own")
    parser.add_argument("--limit", type=_limit, help="examples per task (or a fraction below 1); default all")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's)")
    parser.add_argument("--batch-size", default="8", help="lm-eval's batch size, or auto")
    parser.add_argument("--base", type=Path, help="the base model of a LoRA adapter (default: the one it names)")
    parser.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda where there is one)")
    parser.add_argument("--dtype", default="auto", help="the weights' dtype: auto, bfloat16, float32")
    parser.add_argument(
        "--output", type=Path, help="the results file (default for a run or checkpoint: <run>/eval/<checkpoint>.json)"
    )
    args = parser.parse_args(argv)
    missing = [
        dist
        for name, dist in (("lm_eval", "lm-eval"), ("transformers", "transformers"), ("peft", "peft"))
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        sys.exit(f"lightning-dist-eval needs {', '.join(missing)}: pip install 'lightning-dist[hf,eval]'")
    # deferred: `--help` and a bad argument answer without torch (tests/unit/test_layering.py: DEFERRED)
    from lightning_dist.callbacks.evaluation import evaluate
    from lightning_dist.checkpoint.hf_model import resolve_hf_model

    batch = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
    model = None
    whole: dict = {}
    try:
        model = resolve_hf_model(args.model, args.base)
        metrics = evaluate(
            model,
            args.tasks,
            include_path=args.include_path,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            batch_size=batch,
            device=args.device,
            dtype=args.dtype,
            results=whole,
        )
    except ValueError as err:
        sys.exit(f"lightning-dist-eval: {err} No results written.")
    finally:
        if model is not None:
            model.cleanup()
    for key, value in metrics.items():
        print(f"{key:48s} {value:.4f}")
    output = args.output or results_path(model.checkpoint)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": str(args.model), "tasks": args.tasks, "metrics": metrics, "lm_eval": whole}
        output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"results -> {output}")


def results_path(checkpoint: Path | None) -> Path | None:
    """``<run>/eval/<checkpoint>.json`` for a checkpoint of a run (``<run>/checkpoints/<checkpoint>``); ``None`` for a
    HuggingFace folder, or a checkpoint outside a run's ``checkpoints`` folder (``--output`` names the file)."""
    if checkpoint is None or checkpoint.parent.name != "checkpoints":
        return None
    return checkpoint.parent.parent / "eval" / f"{checkpoint.name}.json"


if __name__ == "__main__":
    main()

"""``lightning-dist-generate RUN "prompt"``: text from a run's model (or any HuggingFace / adapter folder).

The model is what :func:`~lightning_dist.checkpoint.hf_model.resolve_hf_model` finds: a checkpoint's ``hf/`` save,
else the checkpoint exported (a LoRA run: the base model with its adapters, merged for speed). It is generated with
transformers' ``generate`` and the model's own tokenizer and ``generation_config.json``; the options below override
them. ``--chat`` renders the prompt as a user message with the tokenizer's chat template.

Examples::

    lightning-dist-generate outputs/2026-11-24/10-00-00 "The capital of France is" --max-new-tokens 20
    lightning-dist-generate outputs/<a LoRA run> "Write a haiku" --chat --temperature 0.7 --top-p 0.9 --seed 1
    lightning-dist-generate finetuned/ "Once upon a time" --greedy -n 3     # an exported folder
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dist.checkpoint.hf_model import HFModel

DTYPES = ("auto", "float32", "bfloat16", "float16")


def generate(
    model: HFModel,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    greedy: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    num_return_sequences: int = 1,
    seed: int | None = None,
    chat: bool = False,
    device: str | None = None,
    dtype: str = "auto",
) -> list[str]:
    """The texts ``model`` writes after ``prompt`` (the prompt itself left out)."""
    import torch  # deferred: `--help` answers without torch (tests/unit/test_layering.py: DEFERRED)

    from lightning_dist.checkpoint.hf_model import load_hf_model, tokenizer_folder  # deferred: as torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tokenizer = load_hf_model(model, device, dtype)
    if chat:
        if tokenizer.chat_template is None:
            raise ValueError(f"--chat: the tokenizer in {tokenizer_folder(model)} has no chat template.")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        ids = tokenizer(prompt, return_tensors="pt")
    ids = {k: v.to(device) for k, v in ids.items()}
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "num_return_sequences": num_return_sequences}
    if greedy:
        options["do_sample"] = False
    elif any(v is not None for v in (temperature, top_p, top_k)):
        options["do_sample"] = True
    options.update(
        {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    )
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        options["pad_token_id"] = tokenizer.eos_token_id
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = net.generate(**ids, **options)
    start = ids["input_ids"].shape[1]
    return [tokenizer.decode(row[start:], skip_special_tokens=True) for row in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-dist-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a run folder, a checkpoint, or a HuggingFace / peft adapter folder")
    parser.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="the most likely token each step (no sampling)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the generation config's)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens with this mass")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("-n", "--num-return-sequences", type=int, default=1)
    parser.add_argument("--seed", type=int, help="seed of the sampling (the same seed, the same text)")
    parser.add_argument("--chat", action="store_true", help="render the prompt with the tokenizer's chat template")
    parser.add_argument("--base", type=Path, help="the base model of a LoRA adapter (default: the one it names)")
    parser.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda where there is one)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    args = parser.parse_args(argv)
    missing = [name for name in ("transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"lightning-dist-generate needs {', '.join(missing)}: pip install 'lightning-dist[hf]'")
    from lightning_dist.checkpoint.hf_model import resolve_hf_model  # deferred: `--help` answers without torch

    model = None
    try:
        model = resolve_hf_model(args.model, args.base)
        texts = generate(
            model,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            greedy=args.greedy,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            num_return_sequences=args.num_return_sequences,
            seed=args.seed,
            chat=args.chat,
            device=args.device,
            dtype=args.dtype,
        )
    except ValueError as err:
        sys.exit(f"lightning-dist-generate: {err}")
    finally:
        if model is not None:
            model.cleanup()
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- {i + 1}")
        print(args.prompt + text if not args.chat else text)


if __name__ == "__main__":
    main()

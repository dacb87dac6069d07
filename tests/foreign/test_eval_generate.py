"""The loop after training, offline on a tiny model: lm-eval on a task whose data the test writes (lightning-dist-eval,
and EvalCallback at every step of a LoRA run from its checkpoint.save_hf adapters), and lightning-dist-generate on an
exported folder and on the LoRA run folder.

The expected metrics are worked out here with transformers (lm-eval's loglikelihood task: the answer's log-likelihood
after the question, perplexity = exp(-mean), acc = the answer is the greedy continuation), so a metric that did not
come from this very model (its adapters included) fails.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, make_tiny_tokenizer, run_app

from lightning_dist.run.evaluate import main as eval_main
from lightning_dist.run.generate import main as generate_main

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
peft = pytest.importorskip("peft")

LLAMA = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip
QUESTIONS = [{"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(2 * i + 1), str(i)], "answer": i % 3}
             for i in range(12)]  # fmt: skip
TASK = """task: tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evalgen")
    folder = root / "tiny-llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.2)).save_pretrained(folder)
    texts = [f"{q['question']} {c}" for q in QUESTIONS for c in q["choices"]] + ["Once upon a time there was"]
    make_tiny_tokenizer(folder, texts, vocab_size=300)
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "sums.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tasks / "tiny_sums.yaml").write_text(TASK.format(data=data))
    return {"folder": folder, "tasks": tasks}


def _expected(model: torch.nn.Module, tokenizer: object) -> dict[str, float]:
    """lm-eval's perplexity and acc of the answers (see the module docstring), computed here."""
    lls, greedy = [], []
    for q in QUESTIONS:
        context = tokenizer(q["question"])["input_ids"]
        whole = tokenizer(q["question"] + q["choices"][q["answer"]])["input_ids"]  # lm-eval's request: no delimiter
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits.log_softmax(-1)[0]
        targets = range(len(context), len(whole))
        lls.append(sum(logits[i - 1, whole[i]].item() for i in targets))
        greedy.append(all(logits[i - 1].argmax().item() == whole[i] for i in targets))
    return {"perplexity": math.exp(-sum(lls) / len(lls)), "acc": sum(greedy) / len(greedy)}


def test_lightning_dist_eval_runs_a_local_task_on_a_folder(setup: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    eval_main([str(setup["folder"]), "--tasks", "tiny_sums", "--include-path", str(setup["tasks"]),
               "--device", "cpu", "--dtype", "float32", "--output", str(out)])  # fmt: skip
    metrics = json.loads(out.read_text())["metrics"]
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["folder"], dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup["folder"])
    expected = _expected(model, tokenizer)
    assert metrics == {f"eval/tiny_sums/{k}": pytest.approx(v, rel=1e-4) for k, v in expected.items()}
    with pytest.raises(SystemExit, match=r"^lightning-dist-eval: lm-eval has no task 'nope' or in "):
        eval_main([str(setup["folder"]), "--tasks", "nope", "--include-path", str(setup["tasks"])])


def test_lightning_dist_generate_continues_a_prompt_as_transformers_does(
    setup: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    generate_main([str(setup["folder"]), "Once upon a time", "--greedy", "--max-new-tokens", "6", "--device", "cpu"])
    printed = capsys.readouterr().out.strip()
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["folder"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup["folder"])
    ids = tokenizer("Once upon a time", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert printed == "Once upon a time" + tokenizer.decode(
        out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
    )
    generate_main([str(setup["folder"]), "Once", "--temperature", "0.9", "--seed", "3", "-n", "2", "--device", "cpu"])
    assert capsys.readouterr().out.count("--- ") == 2


def test_two_ranks_evaluating_at_their_last_step_end_together_with_the_report(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """The last step is an evaluation step: evaluated once (after its batch), and no rank waits alone at the end (rank 1
    used to enter a barrier by itself in on_train_end: rc 1, 'Connection closed by peer', no report)."""
    common = [o for o in FAST if not o.startswith(("model.", "logger=", "data.", "trainer.max_steps"))]
    run = run_app([*common, "model=hf", f"model.pretrained={setup['folder']}", "model.lora.rank=4",
                   "data.vocab_size=300", "data.seq_len=32", "data.global_batch_size=4", "data.num_train_samples=64",
                   "trainer.max_steps=2", "parallelism=fsdp", "cluster.devices=2", "logger=csv",
                   "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=2", "checkpoint.save_hf=true",
                   "eval.tasks=[tiny_sums]", "eval.every_n_steps=2", f"eval.include_path={setup['tasks']}",
                   "eval.limit=4"], tmp_path / "run")  # fmt: skip
    assert run["steps"] == 2 and (tmp_path / "run" / "report.json").is_file()
    rows = [row for f in (tmp_path / "run").rglob("metrics.csv") for row in csv.DictReader(f.open())]
    assert [int(row["step"]) for row in rows if row.get("eval/tiny_sums/acc")] == [2]


def test_a_lora_run_is_evaluated_during_training_and_generates_from_its_folder(
    setup: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    common = [o for o in FAST if not o.startswith(("model.", "logger=", "data.", "trainer.max_steps"))]
    run = run_app([*common, "model=hf", f"model.pretrained={setup['folder']}", "model.lora.rank=4",
                   "data.vocab_size=300", "data.seq_len=32", "data.global_batch_size=4", "data.num_train_samples=64",
                   "trainer.max_steps=2", "optim.lr=3e-2", "parallelism=fsdp", "cluster.devices=1", "logger=csv",
                   "trainer.enable_checkpointing=true", "checkpoint.every_n_steps=1", "checkpoint.save_hf=true",
                   "eval.tasks=[tiny_sums]", f"eval.include_path={setup['tasks']}"], tmp_path / "run")  # fmt: skip
    rows = [row for f in (tmp_path / "run").rglob("metrics.csv") for row in csv.DictReader(f.open())]
    logged = {int(row["step"]): float(row["eval/tiny_sums/perplexity"]) for row in rows
              if row.get("eval/tiny_sums/perplexity")}  # fmt: skip
    assert sorted(logged) == [1, 2]
    # Each logged value is that checkpoint's model: its peft adapter on the pretrained folder.
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup["folder"])
    base = transformers.AutoModelForCausalLM.from_pretrained(setup["folder"], dtype=torch.float32).eval()
    before = _expected(base, tokenizer)["perplexity"]
    for step, perplexity in logged.items():
        hf = Path(run["checkpoint"]).parent / f"step-{step:08d}" / "hf"
        model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(setup["folder"], dtype=torch.float32), hf
        ).eval()
        assert perplexity == pytest.approx(_expected(model, tokenizer)["perplexity"], rel=1e-4), step
        assert perplexity != pytest.approx(before, rel=1e-3), step  # the adapters changed the model

    # lightning-dist-eval on the run: the newest checkpoint's results at <run>/eval/<checkpoint>.json, as --help says
    capsys.readouterr()
    eval_main([str(tmp_path / "run"), "--tasks", "tiny_sums", "--include-path", str(setup["tasks"]), "--device", "cpu",
               "--dtype", "float32"])  # fmt: skip
    written = tmp_path / "run" / "eval" / f"{Path(run['checkpoint']).name}.json"
    assert f"results -> {written}" in capsys.readouterr().out and Path(run["checkpoint"]).name == "step-00000002"
    assert json.loads(written.read_text())["metrics"]["eval/tiny_sums/perplexity"] == pytest.approx(logged[2], rel=1e-4)

    capsys.readouterr()
    generate_main([str(tmp_path / "run"), "What is 3 plus 3?", "--greedy", "--max-new-tokens", "4", "--device", "cpu"])
    printed = capsys.readouterr().out.strip()
    merged = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(setup["folder"]), Path(run["checkpoint"]) / "hf"
    ).merge_and_unload()
    ids = tokenizer("What is 3 plus 3?", return_tensors="pt")
    out = merged.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert printed == "What is 3 plus 3?" + tokenizer.decode(
        out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
    )


def test_a_task_whose_data_cannot_be_downloaded_is_one_line_and_writes_nothing(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    """arc_easy offline (an empty HuggingFace cache, the hub unreachable): one line, as every other command, not
    datasets' traceback."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dist.run.evaluate", str(setup["folder"]), "--tasks", "arc_easy", "--limit",
         "2", "--device", "cpu", "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lightning-dist-eval: the data of arc_easy could not be loaded (") and "Traceback" not in (
        done.stderr
    )
    assert last.endswith("No results written.") and not out.exists()

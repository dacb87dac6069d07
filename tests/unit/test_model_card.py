"""The model card written from a run's report says what the run did: the devices it ran on, never the hardware the
planner assumed (a CPU run's card used to say ``hardware assumed: H100 SXM 80GB``)."""

from __future__ import annotations

from lightning_dist.checkpoint.model_card import model_card

REPORT = {
    "layout": "ddp: pp=1 dp_replicate=2 dp_shard=1 tp=1 (world 2)",
    "devices": "2 x CPU",
    "hardware": "H100 SXM 80GB",  # the planner's assumption (conf/hardware), in every report
    "steps": 3,
    "tokens_per_step": 256,
    "train_loss": 2.5,
    "history": [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 2.7}, {"step": 3, "train/loss": 2.5}],
}


def test_a_cpu_runs_card_says_it_ran_on_cpu_and_names_no_assumed_hardware() -> None:
    card = model_card("me/tiny", {}, REPORT, step=3)
    assert "| trained on | 2 x CPU |" in card
    assert "H100" not in card and "assumed" not in card


def test_a_report_without_its_devices_says_nothing_of_hardware() -> None:
    card = model_card("me/tiny", {}, {k: v for k, v in REPORT.items() if k != "devices"}, step=3)
    assert "H100" not in card and "trained on" not in card
    assert "| tokens seen | 768 |" in card

"""``lightning-dist-reproduce``: a CPU recipe passes against its golden file (resumed at half, so it also shows that
resuming equals the uninterrupted recorded run), and a doctored golden file fails with the check named."""

from __future__ import annotations

import json

import pytest

from lightning_dist.run.reproduce import GOLDEN_DIR, compare, main


def test_a_cpu_recipe_reproduces_its_golden_file(tmp_path, capsys) -> None:
    """Loss per step and memory against the recorded run; tokens/s is left out here (a loaded test machine is not
    the recorded one: its band is checked on made-up numbers below)."""
    golden = json.loads((GOLDEN_DIR / "tiny_ddp_cpu.cpu.json").read_text())
    (tmp_path / "golden.json").write_text(json.dumps({**golden, "tokens_per_sec_band": [0.0, float("inf")]}))
    main(["tiny_ddp_cpu", "--steps", "12", "--golden", str(tmp_path / "golden.json")])  # exits 1 on a miss
    out = capsys.readouterr().out
    assert "loss, 12 steps (resumed at half)" in out and "MISS" not in out


def test_a_doctored_golden_file_fails_on_the_check_it_breaks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    golden = json.loads((GOLDEN_DIR / "tiny_ddp_cpu.cpu.json").read_text())
    measured = {
        "loss": golden["loss"][:12],
        "tokens_per_sec": golden["tokens_per_sec"],
        "memory_gib": golden["memory_gib"],
    }
    assert all(ok for *_, ok in compare(golden, measured))
    assert not {c: ok for c, _, _, ok in compare(golden, {**measured, "memory_gib": 1e3})}["GiB per rank"]
    assert not {c: ok for c, _, _, ok in compare(golden, {**measured, "tokens_per_sec": 1.0})}["tokens/s"]
    golden["loss"][5] *= 1.01
    assert not {c: ok for c, _, _, ok in compare(golden, measured)}["loss, 12 steps (resumed at half)"]
    path = tmp_path / "doctored.json"
    path.write_text(json.dumps(golden))
    monkeypatch.setattr("lightning_dist.run.reproduce.measure", lambda *args, **kwargs: {**measured, "wall_s": 0.0})
    with pytest.raises(SystemExit) as exited:
        main(["tiny_ddp_cpu", "--steps", "12", "--golden", str(path)])
    assert exited.value.code == 1

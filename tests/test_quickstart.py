"""``examples/quickstart.py``, the quickstart's script (docs/get-started/quickstart.md), run as a user runs it:
``python examples/quickstart.py``.

Lightning's own launcher starts the second rank; the script must train under tensor parallelism on 2 CPU processes
and print its final loss.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import fresh_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "quickstart.py"


def test_the_quickstart_trains_and_prints_its_final_loss(tmp_path: Path) -> None:
    env = fresh_env()  # no launcher variables another test left behind
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"final train/loss: (\S+)", done.stdout)
    assert found, done.stdout[-3000:]
    assert float(found.group(1)) < 4.0  # the target's variance is 16: the model has learned something


def test_the_quickstart_page_shows_the_script_as_it_is() -> None:
    assert SCRIPT.read_text() in (ROOT / "docs" / "get-started" / "quickstart.md").read_text()
    assert "examples/quickstart.py" in (ROOT / "README.md").read_text()

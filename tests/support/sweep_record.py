"""A Hydra callback for tests: appends each job's override list and return value to a JSON-lines file."""

from __future__ import annotations

import json
from typing import Any

from hydra.experimental.callback import Callback


class RecordReturns(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        value = job_return._return_value  # the task's return value, or the exception a failed job raised
        with open(self.path, "a") as file:
            file.write(json.dumps({"overrides": list(job_return.overrides), "value": repr(value)}) + "\n")

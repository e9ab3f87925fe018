"""Reading a stage process's result from its combined output."""

from __future__ import annotations

import json
from typing import Any


def result_json(output: str) -> dict[str, Any]:
    """The last line of `output` that is a JSON object: the stage's printed result.

    Ray forwards worker log lines to the driver's output as they arrive, so one may
    land after the result line; those are skipped.
    """
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"no JSON result line in the output:\n{output[-3000:]}")

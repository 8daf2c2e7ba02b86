"""The output of the one-op GPU timing scripts (expert_linear.py, multi_token.py, fp8_decode.py): each row on stderr
as it is measured (a killed run keeps what it printed), then the whole document as JSON on stdout and, when the
script got a path, in that file."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row_done(row: dict) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)


def emit(doc: dict, argv: list[str]) -> None:
    text = json.dumps(doc, indent=1)
    print(text)
    if argv:
        Path(argv[0]).write_text(text)

"""A benchmark script's refusal of bad options: argparse's usage error, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def refusal(parse_args: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``parse_args(argv)`` printed refusing ``argv`` (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err

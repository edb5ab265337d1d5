"""Train a EAGLE3 drafter in the layout SGLang's builtin EAGLE3 worker loads (`--format eagle3`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of this format only, each named --eagle3-..."""


def train_and_save(args: argparse.Namespace, target: Any, feats: list, held_out: list) -> dict:
    raise SystemExit("--format eagle3 is not implemented yet")

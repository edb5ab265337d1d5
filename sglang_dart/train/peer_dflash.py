"""Train a DFLASH drafter in the layout SGLang's builtin DFLASH worker loads (`--format dflash`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """Options of this format only, each named --dflash-..."""


def train_and_save(args: argparse.Namespace, target: Any, feats: list, held_out: list) -> dict:
    raise SystemExit("--format dflash is not implemented yet")

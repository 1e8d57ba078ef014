"""Placeholder for the evaluator (issue 7): argument parsing exists, the stage itself is not built yet."""

from __future__ import annotations

import argparse

from deepspec.cli import add_config_arguments, config_from_args
from deepspec.errors import DeepSpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    config_from_args(args)
    raise DeepSpecError("This stage is not implemented yet (the evaluator (issue 7)); see the open issues.")

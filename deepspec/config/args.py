"""The command-line arguments every config-driven stage takes (CONFIG and --opts), and the config they make: kept
with the config so that each stage's own CLI imports them from below, not from the `deepspec` command above it."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    """The arguments every config-driven stage takes: CONFIG and --opts key=value ..."""
    if config_required:
        parser.add_argument("config", help="YAML recipe, e.g. config/quickstart/eagle3.yaml")
    else:
        parser.add_argument("--config", default=None, help="YAML recipe (default: the one stored with the input)")
    parser.add_argument(
        "--opts", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="override config fields with the schema's types, e.g. --opts train.lr=3e-4 model.target_layer_ids=[1,9,17]; "
        "repeated --opts add up, later values win",
    )


def config_from_args(args: argparse.Namespace):
    from deepspec.config import load_config

    return load_config(getattr(args, "config", None), getattr(args, "opts", None))

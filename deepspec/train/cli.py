"""`deepspec train CONFIG [--opts ...]`: train in this process (one worker).

For several workers use `bash scripts/train/train.sh CONFIG --nproc N` (or one per GPU), or
`--nproc N` here, which starts them through torchrun.
"""

from __future__ import annotations

import argparse

from deepspec.config.args import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--nproc", type=int, default=1, help="number of workers (>1 starts them with torchrun)")


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.nproc > 1:
        from deepspec.train import launch

        out = launch(cfg, args.nproc)
    else:
        from deepspec.train import train

        out = train(cfg)
    print(out)
    return 0

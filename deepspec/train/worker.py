"""Entry point of one training worker: `python -m deepspec.train.worker CONFIG [--opts ...]`.

torchrun starts one of these per device (scripts/train/train.sh); it joins the process group
from torchrun's environment and runs the same loop as `deepspec train`.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from deepspec.config.args import add_config_arguments, config_from_args
    from deepspec.errors import DeepSpecError
    from deepspec.log import setup_logging

    parser = argparse.ArgumentParser(prog="deepspec.train.worker", description="one training worker (use scripts/train/train.sh)")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        cfg = config_from_args(args)
        from deepspec.train.loop import train

        out = train(cfg)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"deepspec: final checkpoint {out}", file=sys.stderr)
        return 0
    except DeepSpecError as e:
        print(f"deepspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from deepspec.exiting import exit_process

    exit_process(main())

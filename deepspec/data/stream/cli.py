"""`deepspec data stream CONFIG [--opts ...] [--producer W --producers N]`: feed a streamed run (cache.mode=stream).

Runs the target on the samples the trainer will read next and writes them into the run's spool (cache.spool_dir,
capped by cache.spool_gb) until the trainer has read its last one; prints the producer's statistics as JSON. Start
one per GPU (CUDA_VISIBLE_DEVICES) or per node, with the trainer's recipe and --opts; a killed producer is simply
started again. The trainer starts cache.stream_producers of them itself; set it to 0 when you start them here.
"""

from __future__ import annotations

import argparse
import json

from deepspec.config.args import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--producer", type=int, default=0, help="this producer's number, 0..N-1 (default 0)")
    parser.add_argument("--producers", type=int, default=1, help="how many producers feed the run (default 1)")
    parser.add_argument("--device", default=None, help="the HF target's device (default: cuda:0 on a GPU machine, else cpu)")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # set by a trainer that starts producers


def main(args: argparse.Namespace) -> int:
    from deepspec.data.stream.producer import Producer

    cfg = config_from_args(args)
    stats = Producer(cfg, args.producer, args.producers, device=args.device, parent_pid=args.parent_pid).run()
    print(json.dumps(stats))
    return 0

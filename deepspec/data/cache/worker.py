"""Entry point of one cache worker under torchrun: `python -m deepspec.data.cache.worker CONFIG [--opts ...]`.

scripts/data/cache.sh starts one per GPU of each node (or N CPU workers). Each rank joins a barrier-only
gloo group from torchrun's environment (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*), runs the target on
its own device (cuda:LOCAL_RANK) over the shards s with s % WORLD_SIZE == RANK, and rank 0 writes the
index and manifest once every rank is done. Shards are fixed by the plan before any forward, so the
cache is byte for byte the one a single worker writes. Across nodes, cache.dir must be on a filesystem
every node sees (rank 0 merges the other ranks' shards).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from deepspec.data.cache.cli import add_arguments
    from deepspec.data.cache.cli import main as cache_main
    from deepspec.errors import DeepSpecError
    from deepspec.log import setup_logging

    parser = argparse.ArgumentParser(prog="deepspec.data.cache.worker", description="one cache worker (use scripts/data/cache.sh)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return cache_main(args)
    except DeepSpecError as e:
        print(f"deepspec: error: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from deepspec.exiting import exit_process

    exit_process(main())

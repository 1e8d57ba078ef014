"""The trainer's side of a streamed run (cache.mode=stream): publish the plan in the spool, start the local producers,
and read the training samples from the spool; validation reads the held-out offline cache.
"""

from __future__ import annotations

from typing import Callable

from deepspec.data.batches import total_steps
from deepspec.data.cache.plan import load_plan_inputs, make_plan, tap_rows
from deepspec.data.stream import spool as sp
from deepspec.data.stream.channel import open_channel
from deepspec.data.stream.producer import start_local_producers, stop_local_producers
from deepspec.data.stream.spool import spool_dir
from deepspec.log import get_logger

log = get_logger(__name__)


def open_stream_datasets(cfg, info, start_step: int):
    """cache.mode=stream: training samples come through the spool (rank 0 publishes the plan and starts the local
    producers); validation reads the held-out offline cache when it was built (small: `deepspec data cache --split
    heldout`, which `deepspec run` does), else training runs without validation. `start_step`: the step the trainer
    resumes at (its newest intact checkpoint's, 0 for a new run), where the ranks start reading.

    Returns (train, val, finish). `finish()` ends this rank's part once training is over: the producers see its done
    mark, and rank 0 waits for its local producers (with cache.spool_keep, until they have written the kept records
    into the offline cache, however long that takes; after a failed run, 30 s). The trainer calls it before `train()`
    returns, so an in-process caller finds the kept cache complete; it also runs at exit, once."""
    import atexit

    import torch.distributed as dist

    tokenizer, tconf = load_plan_inputs(cfg)
    plan = make_plan(cfg, "train", tokenizer, tconf, count_tokens=True)
    G = cfg.train.global_batch_size
    total = total_steps(len(plan.samples), G, cfg.train.max_steps, cfg.train.epochs)
    reader: list = []  # this rank's SpoolDataset, once made (the producers' stop asks whether it finished)
    stop_producers: Callable[[], None] | None = None
    spool = spool_dir(cfg)
    spool.mkdir(parents=True, exist_ok=True)  # each rank's ledger; the records too with the folder transport
    channel = open_channel(cfg, spool, role="trainer", largest_record=sp.largest_record(plan))
    if info.is_main:
        for stale in (f"{sp.DONE}.", "pos."):
            channel.delete_matching(stale)
        doc = sp.plan_document(plan, seed=cfg.train.seed, global_batch=G, total_steps=total, bucketing=cfg.train.bucketing)
        # where the ranks will start reading, so producers fill the first steps while the trainer still builds its model
        sp.put_json(channel, sp.PLAN, {**doc, "world": info.world, "start_step": start_step})
        if cfg.cache.stream_producers:
            procs = start_local_producers(cfg, spool, cfg.cache.stream_producers)

            def stop() -> None:
                # with spool_keep they still write the offline cache after the last read: wait for them, however long;
                # a trainer that failed before its last read leaves them nothing to finish
                finished = bool(reader) and reader[0].done
                stop_local_producers(procs, None if cfg.cache.spool_keep and finished else 30.0)

            stop_producers = stop
        else:
            log.info("streamed run: start the producers with `deepspec data stream CONFIG --producer W --producers N` "
                     "(the same recipe and --opts); spool %s", spool)
    # what was read for steps after the checkpoint we resume from was never trained: it is read (and logged) again
    dropped = sp.commit_ledgers(spool, start_step)
    if dropped and info.is_main:
        log.info("ledger: %d read(s) after the resumed checkpoint were never trained; they are read again", dropped)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    _, _, rows = tap_rows(cfg, tconf)
    train = sp.SpoolDataset(channel, plan, global_batch=G, rank=info.rank, world=info.world, taps=plan.signature["taps"], rows=rows,
                            local=spool, timeout_s=cfg.cache.stream_timeout_s, keep=cfg.cache.spool_keep)
    reader.append(train)
    finished: list[bool] = []

    def finish() -> None:
        if finished:
            return
        finished.append(True)
        train.linger()  # first: the producers stop on their own once they see every rank's done mark
        if stop_producers is not None:
            stop_producers()

    atexit.register(finish)  # a trainer that failed before its loop ran (or a caller that never calls it)
    val = None
    from deepspec.data.cache.format import is_complete

    if is_complete(cfg.cache_heldout_dir):
        from deepspec.data.cache.reader import open_cache

        val = open_cache(cfg.cache_heldout_dir, cfg=cfg)
    else:
        log.warning("no held-out cache at %s: training without validation (build it with `deepspec data cache CONFIG --split heldout`)",
                    cfg.cache_heldout_dir)
    return train, val, finish

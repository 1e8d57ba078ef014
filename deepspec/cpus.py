"""The CPU cores this process may use: one answer for every place that splits them among workers.

`os.sched_getaffinity` honours taskset / cgroup cpusets (a container limited to 2 of 64 cores sees 2);
`os.cpu_count()` would see the whole host, so it is only the fallback where affinity is unavailable.
"""

from __future__ import annotations

import os


def usable_cpus() -> list[int]:
    """Sorted ids of the cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def threads_per_worker(nproc: int) -> int:
    """torch threads for each of `nproc` CPU worker processes sharing this machine's usable cores."""
    return max(1, len(usable_cpus()) // max(1, nproc))

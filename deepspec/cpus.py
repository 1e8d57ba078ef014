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


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16).

    Elsewhere (e.g. AVX2-only x86, most ARM servers) torch and vLLM emulate bf16 and run it several
    times slower than fp32 (vLLM on a 2-core AVX2 EPYC: 41 vs 199 tokens/s), so `bf16_if_native`
    dtypes fall back to fp32 there. Reads /proc/cpuinfo; False where it cannot tell.

    The environment variable DEEPSPEC_CPU_BF16 = native | emulated overrides the answer, so one machine can run
    what depends on it both ways (the test suite on either CPU kind, a benchmark of fp32 against bf16).
    """
    forced = os.environ.get("DEEPSPEC_CPU_BF16", "").strip().lower()
    if forced:
        if forced not in ("native", "emulated"):
            raise ValueError(f"DEEPSPEC_CPU_BF16={forced!r} is not understood; set it to native or emulated, or unset it to read the CPU's flags.")
        return forced == "native"
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def threads_per_worker(nproc: int) -> int:
    """torch threads for each of `nproc` CPU worker processes sharing this machine's usable cores."""
    return max(1, len(usable_cpus()) // max(1, nproc))

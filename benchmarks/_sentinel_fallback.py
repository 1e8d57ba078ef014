"""Whether gpu_check's rows after `tests` must take EAGLE-3's sentinel call: the tests row's JUnit report says the
chain's merge through the CUDA flash kernel's log-sum-exp failed its test.

    python benchmarks/_sentinel_fallback.py REPORT.xml ROWS.jsonl

Exits 0, after appending a note line to ROWS.jsonl and printing why, when a test of that merge failed or raised;
exits 1 when every one passed or skipped. Without a report (the tests row not selected in this call, or out of time),
an earlier call's note in the same ROWS.jsonl still counts (a rerun of some rows on the same machine keeps the
fallback); with neither, exit 1 and the rows train the default path. A GPU session is short and rare: a merge that is
wrong on that GPU must not cost its EAGLE-3 rows, and the sentinel call (deepspec/drafts/attention.py,
`chain_attention`) is the path those rows measured before.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TEST = "test_on_cuda_the_chain_merged_through_the_flash_lse_equals_the_reference"
NOTE_KEY = "eagle3_chain_fallback"


def failed_merge_tests(report: Path) -> list[str] | None:
    """Names of the merge's CUDA test cases that failed or raised in `report`; None when there is no readable report."""
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return None
    return [case.get("name", "") for case in root.iter("testcase")
            if case.get("name", "").startswith(TEST) and (case.find("failure") is not None or case.find("error") is not None)]


def earlier_fallback(rows: Path) -> list[str]:
    """The failed cases an earlier call's note in `rows` names ([] when none)."""
    if not rows.is_file():
        return []
    for line in rows.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get(NOTE_KEY):
            return list(entry[NOTE_KEY])
    return []


def main(argv: list[str]) -> int:
    report, rows = Path(argv[0]), Path(argv[1])
    failed = failed_merge_tests(report)
    if failed is None:
        earlier = earlier_fallback(rows)
        if earlier:
            print(f"[gpu_check] an earlier call's tests row failed {', '.join(earlier)} (rows.jsonl): the rows below run "
                  "EAGLE-3's sentinel call (DEEPSPEC_CHAIN_SENTINEL=1)")
            return 0
        return 1
    if not failed:
        return 1
    note = {"benchmark": "gpu_check", "row": "tests", NOTE_KEY: failed,
            "note": "the chain's merge through the CUDA flash kernel's log-sum-exp failed its test (log.txt): the rows "
                    "after this one run with DEEPSPEC_CHAIN_SENTINEL=1 (EAGLE-3's sentinel call)"}
    with rows.open("a") as f:
        f.write(json.dumps(note) + "\n")
    print(f"[gpu_check] the TTT chain's flash log-sum-exp merge failed its CUDA test ({', '.join(failed)}; log.txt): the "
          "rows below run EAGLE-3's sentinel call (DEEPSPEC_CHAIN_SENTINEL=1)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Whether gpu_check's rows after `tests` must take EAGLE-3's sentinel call: the tests row's JUnit report says the
chain's merge through the CUDA flash kernel's log-sum-exp failed its test.

    python benchmarks/_sentinel_fallback.py REPORT.xml ROWS.jsonl

Exits 0, after appending a note line to ROWS.jsonl, when a test of that merge failed or raised; exits 1 when every
one passed or skipped, or when there is no report (the tests row ran out of time or was not selected): the rows then
train the default path. A GPU session is short and rare; a merge that is wrong on that GPU must not cost its EAGLE-3
rows, and the sentinel call (deepspec/drafts/attention.py, `chain_attention`) is the path those rows measured before.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TEST = "test_on_cuda_the_chain_merged_through_the_flash_lse_equals_the_reference"


def failed_merge_tests(report: Path) -> list[str]:
    """Names of the merge's CUDA test cases that failed or raised in `report` ([] when it is missing or unreadable)."""
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return []
    return [case.get("name", "") for case in root.iter("testcase")
            if case.get("name", "").startswith(TEST) and (case.find("failure") is not None or case.find("error") is not None)]


def main(argv: list[str]) -> int:
    report, rows = Path(argv[0]), Path(argv[1])
    failed = failed_merge_tests(report)
    if not failed:
        return 1
    note = {"benchmark": "gpu_check", "row": "tests", "eagle3_chain_fallback": failed,
            "note": "the chain's merge through the CUDA flash kernel's log-sum-exp failed its test (log.txt): the rows "
                    "after this one run with DEEPSPEC_CHAIN_SENTINEL=1 (EAGLE-3's sentinel call)"}
    with rows.open("a") as f:
        f.write(json.dumps(note) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The loop measures quoted beside served figures: a trigram lookup's share of answer positions."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_served_length import repeated_ngram_share, trigram_hits  # noqa: E402


def test_trigram_lookup_share_counts_only_repeats():
    loop = [1, 2, 3, 4] * 3  # from the second lap on every token is predicted by the previous lap
    assert trigram_hits(loop) == (5, 9)
    assert trigram_hits([1, 2, 3, 4, 5, 6]) == (0, 3)
    assert trigram_hits([7, 8]) == (0, 0)
    # the lookup follows the LAST earlier occurrence: (1,2,3) was followed by 4, then by 9
    assert trigram_hits([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3, 9]) == (1, 9)
    assert repeated_ngram_share(loop) == (5, 12)

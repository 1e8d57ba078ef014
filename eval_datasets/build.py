#!/usr/bin/env python
"""Build the benchmark files in this folder: `python eval_datasets/build.py [--online|--offline] [--tasks ...]`.

The logic lives in deepspec/eval/datasets_build.py; see README.md here for sources and licenses.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspec.eval.datasets_build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

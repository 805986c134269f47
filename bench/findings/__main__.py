"""``python bench/findings [--out DIR] [--smoke] ...`` (``python -m bench.findings ...`` from the
repository root works too): run the findings; the flags are in `bench.findings.cli`."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: import the package from the repository root, not from inside it
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.findings.cli import main  # noqa: E402

sys.exit(main())

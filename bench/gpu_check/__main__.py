"""``python bench/gpu_check --out DIR [--cpu-smoke] [--sections a,b] ...`` (``python -m bench.gpu_check ...``
from the repository root works too; ``rltt bench gpu_check ...`` runs the folder): the flags are in
`bench.gpu_check.cli`."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: import the package from the repository root, not from inside it
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.gpu_check.cli import main  # noqa: E402

sys.exit(main())

"""`python -m milepost ...`, the same as the `milepost` script (useful without an install)."""

from milepost.cli import main

raise SystemExit(main())

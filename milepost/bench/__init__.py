"""`milepost bench ...`: benchmarks run from the CLI, each measuring milepost against a baseline
in the same run (engine.py: the embedded engine against transformers `generate`)."""

"""True on-policy (report §5.3): the engine and the trainer assign bitwise-equal log-probs.

contract.py: the one computation both sides run (a trainer-shaped forward of one sequence).
profiles.py: which model family × device × dtype the contract is checked for, and refusals.
mismatch.py: `milepost diagnose mismatch`, which attributes a run's log-prob gap to its sources.
"""

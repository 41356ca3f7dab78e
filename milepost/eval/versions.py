"""Which weights an evaluation measured (report section 2.2.4).

A score counts only if it provably measured one weight version: the mean weight version over
every sample equals the version the score is recorded against, and no request was served by a
mix of versions (an engine updated mid-request, or a router that reached an engine still holding
older weights). Versions are the strings engines report; a numeric mean needs numeric versions.
"""

from __future__ import annotations

from dataclasses import dataclass

from milepost.types import Sample


@dataclass(frozen=True)
class VersionCheck:
    expected: str
    mean_version: float | None  # None when some version is not a number
    mixed_fraction: float  # requests whose tokens came from more than one version
    versions_seen: tuple[str, ...]

    @property
    def reject_reason(self) -> str | None:
        """Why the score must not be recorded against `expected`, or None when it may."""
        if not self.versions_seen:
            return "the evaluation produced no response tokens, so no weight version to check"
        if self.mixed_fraction > 0:
            return (f"{self.mixed_fraction:.1%} of the evaluation's requests were served by mixed "
                    f"weight versions {list(self.versions_seen)}")
        if self.versions_seen != (self.expected,):
            return (f"the evaluation's samples carry weight versions {list(self.versions_seen)}, "
                    f"not the expected {self.expected!r}")
        return None


def check_versions(samples: list[Sample], expected: str) -> VersionCheck:
    """The version facts of an evaluation's samples (samples without response tokens are skipped:
    they carry no version)."""
    per_sample = [s.weight_versions for s in samples if s.weight_versions]
    seen = sorted({v for versions in per_sample for v in versions})
    mixed = sum(1 for versions in per_sample if len(set(versions)) > 1)
    return VersionCheck(
        expected=str(expected),
        mean_version=_mean_version(per_sample),
        mixed_fraction=mixed / len(per_sample) if per_sample else 0.0,
        versions_seen=tuple(seen),
    )


def _mean_version(per_sample: list[list[str]]) -> float | None:
    """The mean over samples of each sample's mean token version."""
    try:
        means = [sum(float(v) for v in versions) / len(versions) for versions in per_sample]
    except ValueError:  # a non-numeric version ("default", a hash): no mean to compare
        return None
    return sum(means) / len(means) if means else None

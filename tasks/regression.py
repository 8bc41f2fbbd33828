"""Regression gates: observed run metrics against a stored baseline with tolerance bands, and a readable diff.

A band passes when the observed value lies in [baseline - below, baseline + above]; a missing value fails.
Step time is compared as a ratio to a reference workload (tasks/engine_job/speed_probe.py) timed in each chunk's engine
process just before it trains, so a slower or busier machine does not read as a regression of the code (and
a chunk that comes back from the cache brings the reference of the run that trained it).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field


class Band(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str
    baseline: float
    below: float = Field(0.0, ge=0, description="how far under the baseline still passes")
    above: float = Field(0.0, ge=0, description="how far over the baseline still passes")

    @property
    def low(self) -> float:
        return self.baseline - self.below

    @property
    def high(self) -> float:
        return self.baseline + self.above


class Baseline(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = ""
    bands: list[Band]


class BandResult(BaseModel):
    band: Band
    observed: float | None

    @property
    def passed(self) -> bool:
        return self.observed is not None and self.band.low <= self.observed <= self.band.high


def load_baseline(path: str | Path) -> Baseline:
    return Baseline.model_validate(yaml.safe_load(Path(path).read_text()))


def compare(observed: dict[str, float | None], baseline: Baseline) -> list[BandResult]:
    return [BandResult(band=b, observed=observed.get(b.metric)) for b in baseline.bands]


def render_diff(results: list[BandResult]) -> str:
    """A markdown table, failures first, saying for each metric what was expected and what came."""
    rows = sorted(results, key=lambda r: r.passed)
    failed = sum(not r.passed for r in results)
    head = (f"**{failed} of {len(results)} metric(s) outside their band**" if failed
            else f"all {len(results)} metrics within their bands")
    lines = [head, "", "| | metric | observed | baseline | allowed range | off by |", "|---|---|---|---|---|---|"]
    for r in rows:
        b, v = r.band, r.observed
        if v is None:
            off = "missing"
        elif v < b.low:
            off = f"{v - b.low:+.4g} under"
        elif v > b.high:
            off = f"{v - b.high:+.4g} over"
        else:
            off = ""
        lines.append(f"| {'✅' if r.passed else '❌'} | {b.metric} | {'—' if v is None else f'{v:.4g}'} "
                     f"| {b.baseline:.4g} | [{b.low:.4g}, {b.high:.4g}] | {off} |")
    return "\n".join(lines)

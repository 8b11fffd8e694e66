"""Which engine gets a request.

    score  = the index's hit for the engine (JOINT: `longest_matched`; ATTENTION: `attention_matched`)
    among  the engines up, whose load is within `max_skew` of the least loaded one and whose share of
           the requests routed so far is at most `max_share` x the fair share (1 / engines)
    pick   the highest score; ties: the longer attention-only prefix (where the session's blocks are,
           its next hits will be), the least loaded, then the one routed the fewest requests

Load is the larger of what this router has in flight there and what the engine's /metrics last said
(running + waiting). ROUND_ROBIN ignores the index. An engine that failed is skipped for
`down_for_s` (failover goes to the next choice).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["Engine", "Policy", "rank"]


class Policy(Enum):
    """How the router scores engines."""

    JOINT = "joint"
    ATTENTION = "attention"
    ROUND_ROBIN = "round_robin"


@dataclass(slots=True)
class Engine:
    """One upstream engine as the router sees it."""

    url: str
    instance_id: str
    in_flight: int = 0
    reported_load: int = 0
    routed: int = 0
    failures: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    checked: int = 0  # responses whose cached tokens were compared with the index's prediction
    exact: int = 0  # ... and equal to it
    over: int = 0  # ... predicted more than the engine found (evicted meanwhile)
    under: int = 0  # ... predicted less (cached meanwhile, e.g. by a request ahead in the engine's queue)
    down_until: float = 0.0
    events_seq: int = 0  # the KV event batches its latest response said it had published

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_load)

    def up(self, now: float) -> bool:
        return now >= self.down_until


_rr = itertools.count()


def rank(engines: Sequence[Engine], hits: Mapping[str, tuple[int, int]], policy: Policy, *, max_skew: int = 2,
         max_share: float = 1.25, now: float | None = None) -> list[Engine]:
    """Engines in the order to try (the first is the choice; the rest are the failover order)."""
    now = time.monotonic() if now is None else now
    live = [e for e in engines if e.up(now)] or list(engines)  # (all down: try them anyway)
    if policy is Policy.ROUND_ROBIN:
        start = next(_rr) % len(live)
        return live[start:] + live[:start]
    least = min(e.load for e in live)
    cap = max_share * (sum(e.routed for e in live) + 1) / len(live)

    def ok(e: Engine) -> bool:
        return e.load <= least + max_skew and e.routed < max(cap, 1.0)

    near = [e for e in live if ok(e)]
    far = [e for e in live if not ok(e)]

    def key(e: Engine) -> tuple[int, int, int, int]:
        joint, attention = hits.get(e.instance_id, (0, 0))
        if policy is Policy.ATTENTION:
            return (-attention, 0, e.load, e.routed)
        return (-joint, -attention, e.load, e.routed)

    return sorted(near, key=key) + sorted(far, key=key)

"""The What-if tab's cluster sweep, without Qt: replica counts x routers x budgets, as JSON rows."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import ServiceModel, replay_cluster, replica_counts
from .cluster_cli import cluster_configs
from .results import DEFAULT_POLICY, parse_budget
from .routers import RouterKnobs, check_routers
from .sweep import Progress, run_sweep
from .trace import TraceSource


@dataclass
class ClusterKnobs:
    """What to sweep: replica counts, pages per replica (None: infinite), routers."""

    replicas: list[int]
    budgets: list[int | None]
    routers: list[str]


def cluster_knobs_from_text(replicas: str, budgets: str, routers: list[str]) -> ClusterKnobs:
    """The What-if cluster fields as knobs: "1,2,4,8", "3000", router names; ValueError says what's wrong."""
    counts = replica_counts(replicas)
    pages = [parse_budget(w) for w in budgets.split(",") if w.strip()]
    if not pages:
        raise ValueError("give the pages each replica caches (an integer, or inf)")
    if not routers:
        raise ValueError("pick at least one router")
    return ClusterKnobs(counts, pages, check_routers(routers))


def run_cluster(source: TraceSource, knobs: ClusterKnobs, service: ServiceModel, workers: int | None = None,
                progress: Progress | None = None) -> list[dict]:
    """Every (replicas, router, budget) of the knobs under `service`, as rows."""
    service.validate()
    configs = cluster_configs(knobs.replicas, knobs.routers, knobs.budgets, [DEFAULT_POLICY], [None],
                              service, RouterKnobs())
    return [r.to_json() for r in run_sweep(source, configs, workers=workers, progress=progress or False,
                                           fn=replay_cluster)]

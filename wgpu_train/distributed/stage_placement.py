"""Where a run's pipeline stages sit on a Ray cluster (or the local instance): a placement group of one bundle per
stage, each of --stage-resources (CPU=1 by default), packed onto as few nodes as hold them, so that neighbouring
stages pass their activations within a machine where they can. A group the cluster cannot hold is refused in one
line: at once when no node has a bundle's resources or the cluster has too few in all, after a bounded wait when
other work holds them."""
from __future__ import annotations

import math

from wgpu_train.errors import ConfigError

DEFAULT_STAGE_RESOURCES = "CPU=1"
PLACEMENT_WAIT_S = 60.0        # how long a group waits for resources that other work holds, before the refusal


def parse_resources(spec: str | None) -> dict[str, float]:
    """--stage-resources, NAME=AMOUNT,... (e.g. CPU=1,GPU=1), as Ray's resource dict; one line for a bad spec."""
    resources = {}
    for part in (spec or DEFAULT_STAGE_RESOURCES).split(","):
        name, _, amount = part.strip().partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = math.nan
        if not name.strip() or not value >= 0 or math.isinf(value) or name.strip() in resources:
            raise ConfigError(f"--stage-resources {spec!r}: give NAME=AMOUNT pairs, each name once, e.g. CPU=1,GPU=1")
        resources[name.strip()] = value
    if not any(resources.values()):
        raise ConfigError(f"--stage-resources {spec!r}: a stage's bundle needs some resource above 0")
    return resources


def describe(resources: dict) -> str:
    """A resource dict as --stage-resources writes it."""
    return ",".join(f"{name}={amount:g}" for name, amount in resources.items())


def stage_cpus(stages: int, spec: str | None) -> int:
    """The CPUs `stages` stages of --stage-resources `spec` reserve (what a local Ray instance must have)."""
    return math.ceil(stages * parse_resources(spec).get("CPU", 0))


def _check_feasible(ray, stages: int, resources: dict):
    """Refuse at once a group that this cluster could never hold: a bundle that no node has room for, or more
    of a resource than the cluster has in all."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    if not any(all(node.get(k, 0) >= v for k, v in resources.items()) for node in nodes):
        have = "; ".join(describe({k: n.get(k, 0) for k in resources}) for n in nodes)
        raise ConfigError(f"each pipeline stage asks for {describe(resources)} (--stage-resources), which no node of "
                          f"the Ray cluster has (its nodes: {have})")
    total = ray.cluster_resources()
    short = {k: v * stages for k, v in resources.items() if v * stages > total.get(k, 0)}
    if short:
        raise ConfigError(f"{stages} pipeline stages of {describe(resources)} (--stage-resources) need "
                          f"{describe(short)}, and the Ray cluster has {describe({k: total.get(k, 0) for k in short})}: "
                          f"use fewer stages, or a cluster with more")


def reserve_stages(ray, stages: int, resources: dict, wait_s: float = PLACEMENT_WAIT_S):
    """A ready placement group of `stages` bundles of `resources` (bundle s: stage s), packed onto as few nodes
    as hold them; ConfigError when the cluster cannot hold it, or has not within wait_s seconds."""
    from ray.util.placement_group import placement_group, remove_placement_group

    _check_feasible(ray, stages, resources)
    group = placement_group([dict(resources) for _ in range(stages)], strategy="PACK")
    if not group.wait(wait_s):
        remove_placement_group(group)
        free = ray.available_resources()
        raise ConfigError(f"the Ray cluster did not free {stages} bundles of {describe(resources)} for the pipeline "
                          f"stages within {wait_s:g} s (free now: {describe({k: free.get(k, 0) for k in resources})}): "
                          f"other work holds them; retry when it ends, or use fewer stages")
    return group


def seat(group, stage: int):
    """The scheduling strategy that puts stage `stage`'s actor on its bundle of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=stage)


def release(group):
    """Give the group's resources back to the cluster."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)

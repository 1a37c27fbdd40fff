"""The policies by name; the one place that turns (name, params) into a Policy."""

from __future__ import annotations

import dataclasses
from typing import Any

from policies.base import Policy, PolicyError
from policies.fair import Fair
from policies.fcfs import Fcfs
from policies.priority import Priority
from policies.slo import Slo
from policies.stall_free import StallFree

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Fcfs, StallFree, Priority, Fair, Slo)
}


def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """A fresh policy instance; PolicyError for an unknown name or bad params."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise PolicyError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return cls.from_params(params)


def describe_policies() -> list[dict[str, Any]]:
    return [
        {
            "name": cls.name,
            "summary": cls.summary,
            "params": dataclasses.asdict(cls.Params()),
        }
        for cls in POLICIES.values()
    ]

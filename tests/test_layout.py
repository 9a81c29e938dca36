"""The layout record (pipeline/core/layout.py) and the one mesh built from it: every rank's
coordinates, the groups each axis makes, experts folded over the replicas; and nothing but
runtime/mesh.py builds a DeviceMesh."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from pipelaunch.pipeline.core.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout", [Layout(pp=2, dp=4, tp=2, ep=2), Layout(pp=3, dp=2, tp=1, cp=2),
                                    Layout(pp=1, dp=8, ep=4), Layout(pp=4, dp=1)], ids=repr)
def test_coordinates_and_groups(layout: Layout) -> None:
    """Coordinates round-trip; tp is innermost, then cp, pp, dp; each axis's groups partition the
    world; an expert group is ep consecutive replicas, the expert replicas the others with the
    same experts, and the two together are the replicas."""
    for rank in range(layout.world):
        at = layout.coordinates(rank)
        assert layout.rank(at.dp, at.pp, at.cp, at.tp) == rank
        assert at.ep == at.dp % layout.ep and at.expert_replica == at.dp // layout.ep
    for axis in ("dp", "pp", "cp", "tp", "ep", "expert_dp"):
        groups = layout.groups(axis)
        members = sorted(itertools.chain.from_iterable(groups))
        assert members == list(range(layout.world)), axis
        size = {"ep": layout.ep, "expert_dp": layout.dp // layout.ep}.get(axis) or getattr(layout, axis)
        assert all(len(g) == size for g in groups), axis
    for rank in range(layout.world):
        replicas = set(layout.along(rank, "dp"))
        assert set(layout.expert_group(rank)) <= replicas and set(layout.expert_replicas(rank)) <= replicas
        assert set(layout.expert_group(rank)) & set(layout.expert_replicas(rank)) == {rank}


def test_a_layout_refuses_what_no_mesh_holds() -> None:
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        Layout(dp=4, ep=3)
    with pytest.raises(ValueError, match="pp=0"):
        Layout(pp=0)


def test_only_the_mesh_module_builds_a_mesh() -> None:
    """One DeviceMesh a run: `init_device_mesh` and `DeviceMesh(` appear in runtime/mesh.py alone."""
    found = []
    for path in (ROOT / "pipeline").rglob("*.py"):
        if path.name == "mesh.py":
            continue
        if re.search(r"init_device_mesh\(|DeviceMesh\(", path.read_text()):
            found.append(str(path.relative_to(ROOT)))
    assert not found, found

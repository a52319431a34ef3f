"""The process groups the model's collectives run over, as the model sees them.

The model never creates or looks up a process group: whoever builds it passes the
expert-parallel group to :func:`lptrain.model.build.build_model` (the MoE token dispatch's
all-to-all runs over it), and the data-parallel group to
:func:`lptrain.model.moe.metrics.moe_step_metrics`. Any object with the attributes of
:class:`ProcessGroup` works; :class:`lptrain.distributed.groups.Group` is the one the engine
passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ProcessGroup(Protocol):
    """A process group with this process's place in it."""

    @property
    def pg(self) -> Any:
        """The ``torch.distributed`` group (None on a single rank)."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def active(self) -> bool:
        """Whether collectives over the group do anything (a group of several ranks)."""
        ...


@dataclass(frozen=True)
class SingleRank:
    """The group of this process alone: collectives over it are skipped."""

    pg: None = None
    size: int = 1
    rank: int = 0

    @property
    def active(self) -> bool:
        return False


SINGLE_RANK = SingleRank()


@dataclass(frozen=True)
class ShapeOnlyGroup:
    """Rank ``rank`` of a group of ``size`` that exists only to give a model its shapes: a
    tensor-parallel model built on the meta device (the memory planner, a dry run) has this
    rank's shard shapes without any process group. Any collective over it fails (``pg`` is
    None): a meta build runs none."""

    size: int
    rank: int = 0
    pg: None = None

    @property
    def active(self) -> bool:
        return self.size > 1

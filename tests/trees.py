"""One small tree every backend's tree tests score (no model, no optional package): node i hangs
under TREE_PARENTS[i] (-1: under the cache's last token). Two roots, a node with three children,
paths of depth 1 to 3."""

from __future__ import annotations

TREE_TOKENS = [5, 17, 99, 17, 42, 7, 256, 3]
TREE_PARENTS = [-1, 0, 0, 0, 1, 2, -1, 6]


def tree_path(node: int) -> list[int]:
    """The nodes from a root down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = TREE_PARENTS[node]
    return path[::-1]

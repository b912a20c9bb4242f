"""Originals kept until their copy is done, dropped at the next schedule point.

NOTE [retire at the schedule point]: a policy that copies a saved tensor away (to pages, to
host memory) issues the copy on a side stream and must keep the original alive until the copy
has read it. Rather than ``record_stream`` (which, under a capture, defers every free to the
end of the capture and saves nothing), the original stays referenced until the next
*schedule point* of the policy (the next group's entry or commit, the next layer, a reload,
a step boundary): there the compute stream waits on the copy's mark and the reference goes,
so the caching allocator, which frees in compute-stream order, can hand the memory to the
next layer at once. The copies of one group overlap the next group's compute.
"""
from __future__ import annotations

from .streams import Mark, SideStream


class RetireQueue:
    """Owners (groups, layers) whose copies are in flight, in issue order, with their marks.

    Args:
        side: the side stream the copies run on.

    Example::

        queue = RetireQueue(side)
        queue.add(group, side.mark(), group.drop_originals)
        ...
        queue.retire()                  # schedule point: wait, then drop the originals
    """

    def __init__(self, side: SideStream):
        self.side = side
        self._items: dict = {}        # id(owner) -> [owner, mark, drop]; insertion order

    def add(self, owner, mark: Mark | None, drop) -> None:
        """Queue ``owner`` (or move its mark later if queued): ``drop()`` retires it."""
        item = self._items.get(id(owner))
        if item is None:
            self._items[id(owner)] = [owner, mark, drop]
        else:
            item[1] = mark

    def __contains__(self, owner) -> bool:
        return id(owner) in self._items

    def __len__(self) -> int:
        return len(self._items)

    def owners(self) -> list:
        """The queued owners, oldest first."""
        return [item[0] for item in self._items.values()]

    def take(self, owner) -> Mark | None:
        """Remove ``owner`` without retiring it (its caller adopts the originals); its mark."""
        item = self._items.pop(id(owner), None)
        return None if item is None else item[1]

    def wait(self, owner) -> None:
        """Remove ``owner``, wait for its copy, but keep its originals (they are adopted)."""
        self.side.wait(self.take(owner))

    def retire(self, owners=None) -> None:
        """Schedule point: wait for the copies of ``owners`` (default: every queued owner),
        oldest first, and drop their originals."""
        keys = list(self._items) if owners is None else [id(o) for o in owners]
        for key in keys:
            item = self._items.pop(key, None)
            if item is not None:
                self.side.wait(item[1])
                item[2]()

    def drop_all(self) -> None:
        """Drop every queued owner's originals without waiting (the side stream was joined)."""
        items, self._items = list(self._items.values()), {}
        for _, _, drop in items:
            drop()

"""RequestQueue: the scheduler's FCFS waiting queue, with O(1) removal from anywhere.

A deque makes an abort of a waiting request O(waiting): with thousands of queued requests and
clients that hang up, every abort would scan the queue on the engine thread.  An insertion-
ordered dict keyed by request id keeps FCFS order and removes any entry in O(1); putting a
request back at the front (a preempted one, or one that did not fit this step) is
``move_to_end(last=False)``, also O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvserve.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def append(self, request: Request) -> None:
        """Queue at the back (a new arrival)."""
        self._requests[request.request_id] = request

    def appendleft(self, request: Request) -> None:
        """Queue at the front (a preempted request, or one the pool cannot take yet)."""
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        """The oldest request; IndexError when empty."""
        if not self._requests:
            raise IndexError("pop from an empty RequestQueue")
        return self._requests.popitem(last=False)[1]

    def remove(self, request: Request) -> bool:
        """Drop `request` if queued; True when it was."""
        return self._requests.pop(request.request_id, None) is not None

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

"""RequestQueue: the scheduler's waiting queue in arrival order, with O(1) removal from anywhere
(the policies of scheduling_policy.py read it in their own order).

A deque makes an abort of a waiting request O(waiting): with thousands of queued requests and
clients that hang up, every abort would scan the queue on the engine thread.  An insertion-
ordered dict keyed by request id keeps FCFS order and removes any entry in O(1); putting a
preempted request back at the front is ``move_to_end(last=False)``, also O(1); a request
leaves the queue only when admitted (``remove``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice

from kvserve.request import Request


class RequestQueue:
    def __init__(self) -> None:
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def append(self, request: Request) -> None:
        """Queue at the back (a new arrival)."""
        self._requests[request.request_id] = request

    def appendleft(self, request: Request) -> None:
        """Queue at the front (a preempted request, or a sibling whose fork is ready)."""
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def extend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.append(request)

    def first(self, num: int) -> list[Request]:
        """The first `num` requests in queue order, without copying the rest."""
        return list(islice(self._requests.values(), num))

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

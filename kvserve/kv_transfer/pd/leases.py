"""The producer rank's leases: the blocks of finished requests it holds for their consumers (thread-safe).

A lease is added when the scheduler side's metadata names a kept request, taken (once) by the consumer's pull,
and ends when the push is done or failed, when the consumer releases it, or when it expires untaken. Every lease
that ends is reported once (`pop_ended`, as `finished_saving`): the scheduler then frees the blocks. A pull may
arrive before its lease (the consumer heard of the request from the client before the workers heard of it from
the scheduler), so `take` waits a little; a release may too, so an unknown release is remembered for a while.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_HELD, _SENDING = "held", "sending"


@dataclass
class _Lease:
    block_ids: list[int]
    deadline: float
    state: str = _HELD


class LeaseError(Exception):
    pass


class LeaseTable:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._cond = threading.Condition()
        self._leases: dict[str, _Lease] = {}
        self._ended: set[str] = set()  # ended since the last pop_ended
        self._gone: dict[str, tuple[str, float]] = {}  # ended or released early -> (why, until when remembered)
        self.num_expired = 0
        self.num_sent = 0

    # ------------------------------------------------------------------ scheduler side's messages

    def add(self, req_id: str, block_ids: list[int]) -> None:
        with self._cond:
            early = self._gone.pop(req_id, None)
            if early is not None and early[0] == "released":
                self._ended.add(req_id)  # its consumer gave it up before we heard of it
                return
            self._leases[req_id] = _Lease(list(block_ids), self.clock() + self.lease_s)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the side channel's

    def take(self, req_id: str, wait_s: float) -> list[int]:
        """The lease's block ids, now being sent; LeaseError says why not (unknown after `wait_s`, expired, released,
        taken by another pull). `sent(req_id, ok)` must follow."""
        deadline = self.clock() + wait_s
        with self._cond:
            while True:
                self._expire_locked()
                lease = self._leases.get(req_id)
                if lease is not None:
                    break
                if req_id in self._gone:
                    raise LeaseError(f"request {req_id}'s KV is no longer held ({self._gone[req_id][0]})")
                left = deadline - self.clock()
                if left <= 0:
                    raise LeaseError(f"request {req_id} is not held here (unknown request, or it was aborted)")
                self._cond.wait(min(left, 0.05))
            if lease.state != _HELD:
                raise LeaseError(f"request {req_id}'s KV is already being sent to another reader")
            lease.state = _SENDING
            return lease.block_ids

    def sent(self, req_id: str, ok: bool) -> None:
        """The push is over (ok or not: a failed push means the reader is gone or gave up): the lease ends."""
        with self._cond:
            if self._leases.pop(req_id, None) is not None:
                self.num_sent += ok
                self._end_locked(req_id, "sent" if ok else "send failed")

    def release(self, req_ids: list[str]) -> None:
        """The consumer will not read these: end their leases (one being sent finishes its push first)."""
        with self._cond:
            for req_id in req_ids:
                lease = self._leases.get(req_id)
                if lease is None:
                    if req_id not in self._gone:
                        self._gone[req_id] = ("released", self.clock() + self.lease_s)
                elif lease.state == _HELD:
                    del self._leases[req_id]
                    self._end_locked(req_id, "released")

    # ------------------------------------------------------------------ the worker's report

    def pop_ended(self) -> set[str]:
        with self._cond:
            self._expire_locked()
            ended, self._ended = self._ended, set()
            return ended

    def wait_for_change(self, timeout_s: float) -> None:
        with self._cond:
            if not self._ended:
                self._cond.wait(timeout_s)

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._leases)

    def next_deadline(self) -> float | None:
        with self._cond:
            return min((lease.deadline for lease in self._leases.values()), default=None)

    def _end_locked(self, req_id: str, why: str) -> None:
        self._ended.add(req_id)
        self._gone[req_id] = (why, self.clock() + self.lease_s)
        self._cond.notify_all()

    def _expire_locked(self) -> None:
        now = self.clock()
        for req_id in [r for r, lease in self._leases.items() if lease.state == _HELD and lease.deadline <= now]:
            del self._leases[req_id]
            self.num_expired += 1
            self._end_locked(req_id, f"its lease of {self.lease_s:g} s expired")
        for req_id in [r for r, (_, until) in self._gone.items() if until <= now]:
            del self._gone[req_id]

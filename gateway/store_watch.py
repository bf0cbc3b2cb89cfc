"""Whether the store (``batch.store``: stored responses and chat completions live there too) was
last seen failing, so that a request that would run the model and then store what it made is
refused before the work while the store is down, rather than run, metered and answered 503.

Any request's store error (the app's handler), ``/readyz`` and a store write that failed after the
work tell it the store is down; while it is, such a request first reads the store it will write (a
read of an id that does not exist) and is refused with 503 ``store_unavailable`` unless it answers,
and the first read that answers says the store is back. While the store is up, nothing is asked of
it before the work. A request that ran because the outage began while it did is still answered:
its work is done and metered, so it gets its answer without the store's copy (said in the
``x-tiergate-stored: false`` header, or, once a stream has started, in the log only).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from accounts.store import STORE_ERRORS
from gateway.errors import store_unavailable

log = logging.getLogger("tiergate.store")

NOT_STORED = {"x-tiergate-stored": "false"}  # an answer whose store write failed


class StoreWatch:
    def __init__(self) -> None:
        self.down = False

    def failed(self, exc: BaseException) -> None:
        if not self.down:
            log.warning("the store did not answer (%r): stored responses and chat completions are refused "
                        "before their work until it does", exc)
        self.down = True

    def answered(self) -> None:
        if self.down:
            log.warning("the store answers again: stored responses and chat completions are served")
        self.down = False

    async def check(self, probe: Callable[[], Awaitable[object]]) -> None:
        """Nothing while the store is up; while it is down, ``probe`` (a read of the store to be
        written) and 503 ``store_unavailable`` unless it answers."""
        if not self.down:
            return
        try:
            await probe()
        except STORE_ERRORS as exc:
            raise store_unavailable("the store this request writes") from exc
        self.answered()

    async def kept(self, write: Awaitable[None], what: str) -> bool:
        """``write`` (the store's copy of work already done and metered); False, logged, when the
        store failed it: the client still gets the answer."""
        try:
            await write
        except STORE_ERRORS as exc:
            self.failed(exc)
            log.warning("%s was answered but not stored: the store did not answer (%r)", what, exc)
            return False
        return True

"""Sessions (SGLang's ``/open_session``, ``/close_session`` and ``session_params``): a conversation whose context
stays in the radix cache, pinned, so its next turn is served from the cache even under memory pressure.

The scheduler owns one ``Sessions`` table and calls it at these points: ``resolve`` on intake (the session
must be open; ``rid`` continues an earlier request of the session: its prompt + output, cut to ``offset`` tokens
when given, without the output under ``drop_previous_output``, then the new input ids less a leading BOS, as in
SGLang; ``capacity_of_str_len`` bounds the resulting prompt) and ``admitted`` once it is queued; ``retired``
after a running request's pages went back to the cache (``Memory.release``); ``ended`` for a request that ended
any other way (abort, failed grammar); ``expire`` once a step.

A pin is a lock on the tree node that covers a session's latest finished context (``RadixCache.lock``, the
same lock a running request holds): its pages cannot be evicted. Each session holds at most one pin (the next
one is taken before the previous one is released, so the shared path never becomes evictable in between).
Bounds: ``session_max_pages`` caps one session's pin (it pins the first that many pages of its context; 0:
nothing), ``sessions_max_pages`` caps all pins together (the least recently used sessions lose their pins
first), ``session_timeout`` closes a session idle that many seconds (none of its requests in flight), and
``max_open_sessions`` bounds the table. Pins never make the pool unable to serve: ``unpin_lru`` releases the
least recently used pins whenever admission or ``Memory.reserve`` is short of pages, before a request waits or a
running one is retracted. An unpinned session stays open; its pages become ordinary evictable cache.

A session remembers its last MAX_RECORDS finished requests (prompt and output ids) for ``rid`` continuation.
Closing a session with requests in flight is allowed: they finish normally and pin nothing. ``replace`` is
accepted and changes nothing (radixrt keeps no branch tree of a session's requests).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec

from radixrt.protocol.messages import GenerateReq
from radixrt.protocol.errors import Conflict, NotFound, RequestError

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import RadixCache, TreeNode
    from radixrt.scheduler.request import Req
    from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.scheduler")
MAX_RECORDS = 32  # finished requests a session remembers for rid continuation
MAX_SESSION_ID_CHARS = 256


class Session:
    __slots__ = ("id", "capacity", "last_used", "node", "pinned", "records", "in_flight")

    def __init__(self, session_id: str, capacity: int | None, now: float) -> None:
        self.id = session_id
        self.capacity = capacity  # SGLang's capacity_of_str_len: the longest prompt (tokens) of the session
        self.last_used = now
        self.node: TreeNode | None = None  # the pinned node (locked), or None
        self.pinned = 0  # pages on the pinned path
        self.records: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()  # rid -> (prompt, output)
        self.in_flight = 0


class Sessions:
    def __init__(self, args: ServerArgs, cache: RadixCache, page_size: int, bos_token_id: int | None = None) -> None:
        for name in ("session_max_pages", "sessions_max_pages", "session_timeout"):
            value = getattr(args, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        if args.max_open_sessions < 0:
            raise ValueError("max_open_sessions must be >= 0")
        self.cache = cache
        self.page_size = page_size
        self.bos_token_id = bos_token_id
        self.session_max_pages = args.session_max_pages
        self.sessions_max_pages = args.sessions_max_pages
        self.timeout = args.session_timeout
        self.max_open = args.max_open_sessions
        self.table: dict[str, Session] = {}
        self._rids: dict[str, Session] = {}  # rid of a request in flight -> its session
        self._last_expire = time.monotonic()

    # ----- open / close -------------------------------------------------------------------------------

    def open(self, capacity_of_str_len: int | None = None, session_id: str | None = None) -> str:
        """Open a session (``session_id``, else a generated one); RequestError for a duplicate or a bad value."""
        if capacity_of_str_len is not None and (type(capacity_of_str_len) is not int or capacity_of_str_len < 1):
            raise RequestError("capacity_of_str_len must be a positive integer")
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
            raise RequestError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters")
        if session_id in self.table:
            raise Conflict(f"session {session_id!r} is already open")
        if len(self.table) >= self.max_open:
            raise RequestError(f"too many open sessions ({self.max_open}); close one first")
        self.table[session_id] = Session(session_id, capacity_of_str_len, time.monotonic())
        return session_id

    def close(self, session_id: str) -> bool:
        """Close a session and release its pin; False if it was not open. Its requests in flight go on."""
        session = self.table.pop(session_id, None)
        if session is None:
            return False
        self._unpin(session)
        return True

    def close_all(self) -> None:
        for session_id in list(self.table):
            self.close(session_id)

    # ----- requests -----------------------------------------------------------------------------------

    def resolve(self, msg: GenerateReq) -> GenerateReq:
        """The request as the session serves it (``rid`` continuation applied); RequestError if it cannot be."""
        params = msg.session
        session = self.table.get(params.id)
        if session is None:
            raise NotFound(f"unknown session {params.id!r}: open it first (/open_session), or it was closed")
        input_ids = msg.input_ids
        if params.rid is not None:
            record = session.records.get(params.rid)
            if record is None:
                state = "still running" if self._rids.get(params.rid) is session else "not a finished request"
                raise RequestError(f"session_params.rid {params.rid!r} is {state} of session {params.id!r}")
            prompt, output = record
            context = list(prompt) if params.drop_previous_output else prompt + output
            if params.offset:
                context = context[: params.offset]
            if input_ids and self.bos_token_id is not None and input_ids[0] == self.bos_token_id:
                input_ids = input_ids[1:]  # an appended turn's BOS goes, as in SGLang
            input_ids = context + list(input_ids)
        if session.capacity is not None and len(input_ids) > session.capacity:
            raise RequestError(f"the session's request has {len(input_ids)} tokens; its capacity_of_str_len is "
                               f"{session.capacity}")
        if msg.rid in self._rids:
            raise RequestError(f"rid {msg.rid!r} is already in flight")
        session.last_used = time.monotonic()
        return msgspec.structs.replace(msg, input_ids=input_ids) if input_ids is not msg.input_ids else msg

    def admitted(self, rid: str, session_id: str) -> None:
        """The request was taken in (queued): it counts as the session's work in flight."""
        session = self.table.get(session_id)
        if session is not None:
            session.in_flight += 1
            self._rids[rid] = session

    def ended(self, rid: str) -> Session | None:
        """A request of a session ended (any way): it is no longer in flight. Returns its open session."""
        session = self._rids.pop(rid, None)
        if session is None:
            return None
        session.in_flight -= 1
        session.last_used = time.monotonic()
        return session if self.table.get(session.id) is session else None  # None: closed (maybe reopened) since

    def retired(self, req: Req) -> None:
        """A running request finished and its pages went back to the cache: a successful one of an open session
        becomes the session's record and its context the session's pin."""
        session = self.ended(req.rid)
        if session is None or req.finish_reason is None or req.finish_reason.is_error:
            return
        session.records[req.rid] = (req.prompt_ids, req.output_ids)
        session.records.move_to_end(req.rid)
        while len(session.records) > MAX_RECORDS:
            session.records.popitem(last=False)
        self._pin(session, req.fill_ids, req.cache_namespace)

    # ----- pins ---------------------------------------------------------------------------------------

    def _pin(self, session: Session, context: list[int], namespace: int = 0) -> None:
        if self.cache.disabled:
            return
        cap = self.session_max_pages
        if self.sessions_max_pages is not None:
            cap = self.sessions_max_pages if cap is None else min(cap, self.sessions_max_pages)
        tokens = context if cap is None else context[: cap * self.page_size]
        match = self.cache.match_prefix(tokens, record=False, namespace=namespace)
        if not match.pages:
            self._unpin(session)
            return
        self.cache.lock(match.node)  # the new pin before the old one goes: a shared path stays protected
        self._unpin(session)
        session.node, session.pinned = match.node, len(match.pages)
        if self.sessions_max_pages is not None:
            over = self.pinned_pages - self.sessions_max_pages
            if over > 0:
                self.unpin_lru(over, keep=session)

    def _unpin(self, session: Session) -> int:
        if session.node is None:
            return 0
        self.cache.unlock(session.node)
        released = session.pinned
        session.node, session.pinned = None, 0
        return released

    def unpin_lru(self, pages: int, keep: Session | None = None) -> int:
        """Release the pins of the least recently used sessions until ``pages`` pinned pages are released (or no
        pin is left but ``keep``'s); returns the pinned pages released (shared paths may stay protected)."""
        released = 0
        for session in sorted((s for s in self.table.values() if s.node is not None and s is not keep),
                              key=lambda s: s.last_used):
            if released >= pages:
                break
            released += self._unpin(session)
        if released:
            logger.info("released the pins of sessions (%d pages) to make room", released)
        return released

    def unpin_all(self) -> int:
        return sum(self._unpin(s) for s in self.table.values())

    @property
    def pinned_pages(self) -> int:
        """Pinned pages summed over the sessions (a path two sessions share counts twice)."""
        return sum(s.pinned for s in self.table.values())

    def expire(self) -> None:
        """Close sessions idle for ``session_timeout`` seconds (checked at most once a second)."""
        if self.timeout is None or not self.table:
            return
        now = time.monotonic()
        if now - self._last_expire < min(1.0, self.timeout):
            return
        self._last_expire = now
        for session in list(self.table.values()):
            if session.in_flight == 0 and now - session.last_used > self.timeout:
                logger.info("session %s closed after %.0f s idle", session.id, now - session.last_used)
                self.close(session.id)

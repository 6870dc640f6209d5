"""Waiting for a request's outputs while watching its client: the moment the connection closes, the requests
are aborted (their pages freed on the scheduler's next step), however busy they are.

After the body is read, the ASGI receive channel's next message is ``http.disconnect``, sent as soon as the
socket closes, so one task awaiting it (ClientWatch) notices a disconnect at once; waiting on output alone
would not notice until the generation ended. Streams hand over to their StreamingResponse after the first
output (it listens for the disconnect itself).
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from radixrt.client import Handle, raise_for_failures
from radixrt.server.tokenizer_manager import TokenizerManager


class ClientGone(Exception):
    pass


class ClientWatch:
    """Watches one HTTP call's connection: the moment the client closes it, abort ``states`` and wake their waiter."""

    def __init__(self, request: Request, tm: TokenizerManager, states: list[Handle]) -> None:
        self.gone = False
        self._task = asyncio.create_task(self._watch(request, tm, states))

    async def _watch(self, request: Request, tm: TokenizerManager, states: list[Handle]) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        tm.abort_unfinished(states)
        states[0].waker.wake()

    def close(self) -> None:
        self._task.cancel()


async def wait_any(watch: ClientWatch | None, states: list[Handle]) -> None:
    """Wait for new output on any of ``states``; raise ClientGone when the client has gone away."""
    await states[0].waker.wait()
    if watch is not None and watch.gone:
        raise ClientGone()


async def wait_all(watch: ClientWatch, states: list[Handle]) -> None:
    while not all(s.finished for s in states):
        await wait_any(watch, states)


async def first_output(watch: ClientWatch, states: list[Handle]) -> None:
    """Before a stream's headers go out: wait for its first output, so runtime-side errors are still a 4xx."""
    while not any(s.finished or s.builder.output_ids for s in states):
        await wait_any(watch, states)
    if any(s.finished for s in states):
        raise_for_failures(states)


async def gather(request: Request, tm: TokenizerManager, states: list[Handle], stream: bool) -> None:
    """Wait until every state finished (or, for a stream, has its first output), aborting them if the client
    goes away meanwhile. After this a stream's disconnects are seen by its StreamingResponse."""
    watch = ClientWatch(request, tm, states)
    try:
        if stream:
            await first_output(watch, states)
        else:
            await wait_all(watch, states)
            raise_for_failures(states)
    except ClientGone:
        raise  # the watch has aborted them already
    except BaseException:
        tm.abort_unfinished(states)
        raise
    finally:
        watch.close()

"""A serve-edge client that goes away before its answer: noticed while its job runs (or its stream
waits for the first piece), as Starlette's streamed responses notice it, so that its generation stops."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

CLIENT_GONE = 499  # nginx's "client closed request": the status a request whose client went away is logged with


async def client_disconnected(request: Request) -> None:
    """Return once the client of `request` (its body read) has disconnected, as Starlette's streamed
    responses listen for it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, future: asyncio.Future):
    """`future`'s result, unless the client disconnects first: then `future` is cancelled and
    `ClientDisconnect` raised."""
    gone = asyncio.ensure_future(client_disconnected(request))
    try:
        await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not future.done():
        future.cancel()
        raise ClientDisconnect()
    return future.result()

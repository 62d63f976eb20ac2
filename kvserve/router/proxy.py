"""Forwarding one request to one instance, streaming or not, with the failure rules the router promises.

- The body goes through as the client sent it; the instance's status and body come back as they are (its 400s
  included), and a stream is passed through chunk by chunk.
- An instance that cannot be reached (connection refused or timed out) is taken out of rotation and the request
  goes to another one: nothing was sent, so nothing is lost or done twice.
- An instance that fails after the request went out (its connection breaks, or it is taken out of rotation while
  the request runs) ends the request with an error: a 502/503 body, or an error event closing the stream. It is not
  retried, since the instance may have generated part of it.
- A client that goes away closes the upstream connection, which the instance takes as an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.router.instances import Instance, InstanceSet, RequestTicket

logger = logging.getLogger(__name__)


def json_body(raw: bytes) -> dict | JSONResponse:
    """A request body as a JSON object, or the 400 that answers it (both router modes take bodies this way)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return error_response(f"malformed JSON body: {e}", 400, "BadRequestError")
    if not isinstance(body, dict):
        return error_response("the body must be a JSON object", 400, "BadRequestError")
    return body


def error_response(message: str, status: int, err_type: str = "ServiceUnavailableError") -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": status}}, status)


def sse_error(message: str, status: int = 503) -> bytes:
    body = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": status}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Unreachable(Exception):
    """The instance could not be reached: nothing was sent."""


@dataclass
class Upstream:
    """An instance's response whose status and headers are in, its body not yet read."""

    instance: Instance
    response: httpx.Response
    ticket: RequestTicket
    cancelled: asyncio.Event


class Proxy:
    def __init__(self, client: httpx.AsyncClient, instances: InstanceSet, request_timeout_s: float) -> None:
        self.client = client
        self.instances = instances
        self.timeout = httpx.Timeout(connect=2.0, read=request_timeout_s, write=30.0, pool=None)

    async def open(self, inst: Instance, path: str, body: bytes, prompt_tokens: int) -> Upstream:
        """Send the request; raise Unreachable (after taking `inst` out of rotation) when it could not be sent."""
        cancelled = asyncio.Event()
        request = self.client.build_request(
            "POST",
            f"{inst.url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=self.timeout,
        )
        ticket = RequestTicket(inst, prompt_tokens, cancelled.set)
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            ticket.close()
            self.instances.mark_failed(inst, f"{type(e).__name__}: {e}")
            raise Unreachable(str(e)) from None
        except httpx.HTTPError as e:
            ticket.close()
            self.instances.mark_failed(inst, f"{type(e).__name__}: {e}")
            raise
        return Upstream(inst, response, ticket, cancelled)

    async def read_all(self, up: Upstream) -> tuple[int, bytes, str]:
        """(status, body, content type) of a non-streaming response; raises RuntimeError when the instance fails
        or is taken out of rotation before the body is complete."""
        try:
            read = asyncio.ensure_future(up.response.aread())
            cancel = asyncio.ensure_future(up.cancelled.wait())
            done, _ = await asyncio.wait({read, cancel}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                raise RuntimeError(f"instance {up.instance.name} failed while serving the request")
            cancel.cancel()
            try:
                content = read.result()
            except httpx.HTTPError as e:
                self.instances.mark_failed(up.instance, f"{type(e).__name__}: {e}")
                raise RuntimeError(f"instance {up.instance.name} failed while serving the request: {e}") from None
            return up.response.status_code, content, up.response.headers.get("content-type", "application/json")
        finally:
            up.ticket.close()
            await up.response.aclose()

    async def respond(self, up: Upstream, stream: bool) -> Response:
        """The client's response: the instance's, passed through."""
        if not stream or up.response.status_code != 200:
            try:
                status, content, ctype = await self.read_all(up)
            except RuntimeError as e:
                return error_response(str(e), 502)
            return Response(content, status_code=status, media_type=ctype)
        return StreamingResponse(self._relay(up), media_type="text/event-stream")

    async def _relay(self, up: Upstream) -> AsyncIterator[bytes]:
        chunks = up.response.aiter_raw()
        cancel = asyncio.ensure_future(up.cancelled.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                done, _ = await asyncio.wait({nxt, cancel}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    yield sse_error(f"instance {up.instance.name} failed while streaming")
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as e:
                    self.instances.mark_failed(up.instance, f"{type(e).__name__}: {e}")
                    yield sse_error(f"instance {up.instance.name} failed while streaming: {e}")
                    return
                up.ticket.first_output()
                yield chunk
        finally:
            cancel.cancel()
            up.ticket.close()
            with contextlib.suppress(Exception):
                await up.response.aclose()

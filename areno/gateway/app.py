"""The gateway's HTTP side: an OpenAI-compatible FastAPI app on localhost.

Routes: `POST /runs/{key}/v1/chat/completions` and `/runs/{key}/v1/completions`
(the per-run base URL), the same under `/v1/...` with the run's key as the
Bearer token, and `GET .../v1/models`. A request becomes a `Call` handed to the
driver's thread (which owns the engine and the trajectories); the handler
awaits its answer. uvicorn serves it from a thread of the process that runs
the episode driver, on a socket bound before the agents start.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations
# (Request, imported inside make_app) at definition time.
import asyncio
import queue
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from areno.errors import UserError

MODEL_NAME = "policy"


@dataclass
class Call:
    """One request for the driver: `kind` "chat" (messages, tools) or "completion" (prompt)."""

    key: str
    kind: str
    body: dict
    answer: Future = field(default_factory=Future)  # -> (status code, JSON body)

    def reply(self, status: int, body: dict) -> None:
        """Answer the call, unless its request is gone (its handler cancelled the
        future: the agent's worker was killed, or the server stopped)."""
        try:
            self.answer.set_result((status, body))
        except InvalidStateError:
            pass


class GatewayError(Exception):
    """A request the gateway refuses: (status, message), answered in OpenAI's error format."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def make_app(calls: "queue.Queue[Call]", keys: set[str]) -> Any:
    """The FastAPI app; `keys` are the runs in flight (the driver adds and removes them)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="areno gateway", docs_url=None, redoc_url=None, openapi_url=None)

    async def handle(key: str | None, kind: str, request: Request) -> JSONResponse:
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in keys:
            return JSONResponse(error_body(f"no agent run in flight has the key {key[:16]!r}",
                                           "authentication_error"), status_code=401)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the request body is not JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body is not a JSON object"), status_code=400)
        call = Call(key, kind, body)
        calls.put(call)
        status, out = await asyncio.wrap_future(call.answer)
        return JSONResponse(out, status_code=status)

    for prefix, with_key in (("/runs/{key}/v1", True), ("/v1", False)):
        for kind, path in (("chat", "/chat/completions"), ("completion", "/completions")):
            def route(kind: str = kind, with_key: bool = with_key) -> Any:
                if with_key:
                    async def endpoint(key: str, request: Request) -> JSONResponse:
                        return await handle(key, kind, request)
                else:
                    async def endpoint(request: Request) -> JSONResponse:
                        return await handle(None, kind, request)
                return endpoint
            app.post(prefix + path)(route())

    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                            "owned_by": "areno"}]}
    app.get("/v1/models")(models)
    app.get("/runs/{key}/v1/models")(models)
    return app


class GatewayServer:
    """uvicorn serving the app from a daemon thread, on 127.0.0.1 at a free port
    (bound here, before any agent needs the URL)."""

    def __init__(self) -> None:
        try:
            import fastapi  # noqa: F401 - make_app's
            import uvicorn
        except ImportError as e:
            raise UserError(f"--agent-path: the gateway needs fastapi and uvicorn, which vLLM brings "
                            f"(pip install 'areno[cpu]' or 'areno[vllm]', or fastapi uvicorn): {e}") from None

        self.calls: "queue.Queue[Call]" = queue.Queue()
        self.keys: set[str] = set()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(make_app(self.calls, self.keys), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the run's signals are the controller's
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="areno-gateway", daemon=True)
        self.thread.start()
        t_end = time.monotonic() + 30.0
        while not self.server.started and self.thread.is_alive() and time.monotonic() < t_end:
            time.sleep(0.005)
        if not self.server.started:
            raise RuntimeError("the agent gateway did not start serving within 30 s")

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/runs/{key}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5.0)
        self.sock.close()

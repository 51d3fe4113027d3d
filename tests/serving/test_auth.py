"""Auth fails closed: an empty or malformed key, or no key on a non-loopback host, is refused at
start; every route and websocket but /health needs the key, /docs and /openapi.json included."""

from __future__ import annotations

import runpy

import pytest

pytest.importorskip("fastapi")
from starlette.websockets import WebSocket, WebSocketDisconnect  # noqa: E402

from llmfoundry.serving.auth import BearerAuth, api_key_from_env, is_loopback
from tests.serving.conftest import API_KEY, ROOT


def serve_main():
    return runpy.run_path(str(ROOT / "scripts" / "serve.py"), run_name="serve")["main"]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"LLMFOUNDRY_API_KEY": ""}, [], "LLMFOUNDRY_API_KEY is set but empty"),
        ({"LLMFOUNDRY_API_KEY": ""}, ["--host", "0.0.0.0"], "is set but empty"),
        ({"LLMFOUNDRY_API_KEY": "key\n"}, [], "holds whitespace"),
        ({}, ["--host", "0.0.0.0"], "--host 0.0.0.0 accepts connections from other machines"),
        ({}, ["--host", "::"], "set LLMFOUNDRY_API_KEY"),
        ({}, ["--host", "0.0.0.0", "--engine", "vllm"], "set LLMFOUNDRY_API_KEY"),
    ],
)
def test_serve_refuses_to_start_without_a_usable_key(
    env, args, message, monkeypatch, capsys, tmp_path
):
    monkeypatch.delenv("LLMFOUNDRY_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        serve_main()([str(tmp_path / "no-such-checkpoint"), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err  # one line, before the model loads


def test_serve_with_a_key_on_any_host_goes_on_to_load_the_model(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LLMFOUNDRY_API_KEY", API_KEY)
    with pytest.raises(SystemExit) as exit_:
        serve_main()([str(tmp_path / "no-such-checkpoint"), "--host", "0.0.0.0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no-such-checkpoint" in err and "LLMFOUNDRY_API_KEY" not in err and API_KEY not in err


def test_loopback_hosts():
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))
    assert api_key_from_env("127.0.0.1", {}) is None
    assert api_key_from_env("0.0.0.0", {"LLMFOUNDRY_API_KEY": API_KEY}) == API_KEY


def test_an_empty_key_never_reaches_the_middleware():
    with pytest.raises(ValueError, match="empty API key"):
        BearerAuth(lambda *a: None, "")


def test_every_route_and_websocket_needs_the_key(in_process_app):
    key = {"Authorization": f"Bearer {API_KEY}"}
    with in_process_app(api_key=API_KEY) as client:

        async def echo(websocket: WebSocket) -> None:  # a websocket route, as an extension adds
            await websocket.accept()
            await websocket.send_text("open")
            await websocket.close()

        client.app.add_api_websocket_route("/v1/ws", echo)
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/metrics"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers=key).status_code == 200, path
        assert client.get("/v1/models", headers={"Authorization": "Bearer"}).status_code == 401
        assert client.get("/health").status_code == 200  # probes need no key
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(WebSocketDisconnect) as closed:
                with client.websocket_connect("/v1/ws", headers=headers):
                    pass
            assert closed.value.code == 1008
        with client.websocket_connect("/v1/ws", headers=key) as websocket:
            assert websocket.receive_text() == "open"

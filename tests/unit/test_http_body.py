"""Every HTTP body, on every route of the app, bounded before the route runs (gateway.http.body): its depth
measured on the text (common.json_depth) as json.loads would find it, 413 past --max-request-bytes, 400 past
--max-request-depth or for text that is not JSON, the parsed body handed to the route; and --chat-template's
value read as vLLM reads it (gateway.chat_template)."""

import json

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient

from common.json_depth import json_depth
from gateway.chat_template import ChatTemplateError, resolve
from gateway.http.app import create_app
from gateway.http.body import request_json
from gateway.http.errors import HttpError
from gateway.limits import EdgeLimits


@pytest.mark.parametrize(
    "value",
    [1, "[[{", [], {}, [[1], [[2]]], {"a": ']}\\"[[', "b": [{"c": []}]}, ["\\", '"[', [[[]]]], "x" * 1000],
)
def test_the_depth_of_json_text_is_that_of_its_value(value):
    def depth(item) -> int:
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        return 0 if children is None else 1 + max(map(depth, children), default=0)

    assert json_depth(json.dumps(value)) == json_depth(json.dumps(value).encode()) == depth(value)
    assert json_depth("[" * 5000 + "]" * 5000) == 5000, "no recursion, however deep"


@pytest.fixture
def client() -> TestClient:
    async def echo(request: Request) -> Response:
        try:
            return JSONResponse({"got": request_json(request), "raw": len(await request.body())})
        except HttpError as err:
            return err.response()

    app = create_app([lambda app: app.add_api_route("/any", echo, methods=["POST"])],
                     EdgeLimits(max_request_bytes=64, max_request_depth=3))  # fmt: skip
    return TestClient(app)


def test_a_body_within_the_limits_reaches_the_route_parsed_and_readable(client):
    reply = client.post("/any", content=b'{"a": [[1]]}')
    assert reply.status_code == 200 and reply.json() == {"got": {"a": [[1]]}, "raw": 12}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"a": [[[1]]]}', 400, "nests arrays and objects 4 levels deep; the limit is 3"),
        (b"[" * 40, 400, "40 levels deep"),
        (b'{"a": ', 400, "the request body is not valid JSON"),
        (b'"' + b"x" * 70 + b'"', 413, "the limit is 64 (--max-request-bytes)"),
        (b"", 400, "the request body is empty"),
    ],
)
def test_a_body_past_a_limit_is_refused_before_the_route(client, body, status, says):
    reply = client.post("/any", content=body)
    assert reply.status_code == status and says in reply.json()["error"]["message"]


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert resolve(str(tmp_path / "t.jinja")) == template
    assert resolve(template) == template
    with pytest.raises(ChatTemplateError, match="no such file, and not a template"):
        resolve(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        resolve("{% for m in messages %}")

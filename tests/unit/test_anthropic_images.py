"""Messages API image blocks (gateway.http.anthropic.request): base64 and URL sources become image parts in
order among the user turn's text, as OpenAI image_url parts do; a refusal names the block."""

import base64

import pytest

from gateway.http.anthropic.request import MessagesRequest, generate_request
from gateway.http.errors import HttpError
from gateway.http.image_parts import MediaSources
from gateway.http.openai_request import parse

PNG = b"\x89PNG not decoded here"


def body(*turns: dict) -> MessagesRequest:
    return parse(MessagesRequest, {"model": "m", "max_tokens": 4, "messages": list(turns)})


def image(data: bytes = PNG) -> dict:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def test_image_blocks_are_parts_in_order_among_the_text(tmp_path):
    (tmp_path / "b.png").write_bytes(b"second")
    url = {"type": "image", "source": {"type": "url", "url": f"file://{tmp_path}/b.png"}}
    turn = {
        "role": "user",
        "content": [{"type": "text", "text": "one "}, image(), url, {"type": "text", "text": "?"}],
    }
    media = MediaSources.of(tmp_path, None, 1000)
    (message,) = generate_request(body(turn), "rid", media).messages
    parts = [part.text if part.WhichOneof("part") == "text" else part.image for part in message.parts]
    assert message.role == "user" and not message.content and parts == ["one ", PNG, b"second", "?"]


def test_a_text_only_turn_stays_content():
    (message,) = generate_request(body({"role": "user", "content": "hi"}), "rid").messages
    assert message.content == "hi" and not message.parts


def user(*blocks: dict) -> dict:
    return {"role": "user", "content": list(blocks)}


@pytest.mark.parametrize(
    ("turn", "says"),
    [
        (
            user({"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/a"}}),
            "messages[0].content[0].source.url: http(s) URLs are not fetched unless the server is started "
            "with --allowed-media-domains HOST",
        ),
        (
            user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}),
            "messages[0].content[0].source.data: the base64 does not decode",
        ),
        (
            {"role": "assistant", "content": [{"type": "text", "text": "x"}, image()]},
            "messages[0].content[1]: image blocks go in user turns",
        ),
    ],
)
def test_a_bad_image_block_is_refused_naming_it(turn, says):
    with pytest.raises(HttpError) as caught:
        generate_request(body(turn), "rid")
    assert caught.value.status == 400 and str(caught.value).startswith(says), str(caught.value)


def test_a_media_type_anthropic_does_not_take_is_refused():
    block = image()
    block["source"]["media_type"] = "image/tiff"
    with pytest.raises(HttpError) as caught:
        body({"role": "user", "content": [block]})
    assert caught.value.status == 400 and "media_type" in str(caught.value)

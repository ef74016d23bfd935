"""Chat messages with the real SmolLM2 tokenizer: OpenAI's roles render, any other role is refused naming
them, an empty one too."""

import pytest
from transformers import AutoTokenizer

from common.errors import InvalidArgument
from common.model_files import local_copy
from gateway.tokenizer import CHAT_ROLES, encode
from protos import generation_pb2

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


def chat(*roles: str) -> generation_pb2.GenerateRequest:
    messages = [generation_pb2.ChatMessage(role=role, content=f"a {role} message") for role in roles]
    return generation_pb2.GenerateRequest(messages=messages)


@pytest.mark.parametrize("role", CHAT_ROLES)
def test_each_openai_role_renders(tokenizer, role):
    ids = encode(tokenizer, chat("user", role), VOCAB)
    assert f"a {role} message" in tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("role", "said"), [("hacker", "role 'hacker'"), ("", "no role"), ("User", "role 'User'")]
)
def test_any_other_role_is_refused_naming_the_allowed_ones(tokenizer, role, said):
    with pytest.raises(InvalidArgument) as err:
        encode(tokenizer, chat("system", role), VOCAB)
    assert str(err.value) == f"messages[1] has {said}: use one of system, developer, user, assistant, tool"

"""The gateway runs without torch: a fresh interpreter that imports the gateway's server, loads the model's
tokenizer (gateway.tokenizer.load: transformers imported with torch hidden) and wraps it for the grammar
engine loads no torch, and renders prompts, chat messages and tools to the token ids that transformers
with torch gives."""

import json
import subprocess
import sys

import pytest
from google.protobuf import json_format
from transformers import AutoTokenizer

from common.model_files import local_copy
from gateway import tokenizer as tok
from gateway.tools import request as tool_request
from protos import generation_pb2
from tests.helpers import ROOT

WEATHER = generation_pb2.Tool(
    name="get_weather",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)
REQUESTS = [
    generation_pb2.GenerateRequest(prompt="The capital of France is"),
    generation_pb2.GenerateRequest(
        messages=[
            generation_pb2.ChatMessage(role="system", content="Answer briefly."),
            generation_pb2.ChatMessage(role="user", content="Name three rivers."),
        ]
    ),
    generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="Weather in Paris?")], tools=[WEATHER]
    ),
]
GATEWAY = """
import json, sys
from google.protobuf import json_format
import gateway.server
from gateway import tokenizer as tok
from gateway.structured.grammars import Grammars
from gateway.structured.limits import ConstraintLimits
from gateway.tools import request as tool_request
from protos import generation_pb2

tokenizer = tok.load(sys.argv[1])
Grammars(tokenizer, ConstraintLimits()).prepare(len(tokenizer), [tokenizer.eos_token_id])
requests = [json_format.ParseDict(r, generation_pb2.GenerateRequest()) for r in json.loads(sys.argv[2])]
ids = [
    tok.encode(tokenizer, r, len(tokenizer), tool_request.from_request(r, 128, 65536, 32)) for r in requests
]
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
import importlib.util, os
restored = importlib.util.find_spec("torch") is not None and tok.NO_ADVICE not in os.environ
print(json.dumps({"heavy": heavy, "restored": restored, "class": type(tokenizer).__name__, "ids": ids}))
"""


@pytest.fixture(scope="module")
def model_dir():
    # NOTE: converted here if need be: a gateway that converts the GGUF itself imports torch to do it.
    return local_copy("smollm2").path


def test_the_gateway_loads_no_torch_and_renders_as_transformers_does(model_dir):
    requests = [json_format.MessageToDict(r) for r in REQUESTS]
    out = subprocess.run(
        [sys.executable, "-c", GATEWAY, str(model_dir), json.dumps(requests)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr, "transformers' advice is silenced"
    gateway = json.loads(out.stdout.splitlines()[-1])
    assert gateway["heavy"] == []
    assert gateway["restored"], "torch is hidden while transformers is imported only"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert gateway["class"] == type(tokenizer).__name__
    tools = (tool_request.from_request(r, 128, 65536, 32) for r in REQUESTS)
    expected = [tok.encode(tokenizer, r, len(tokenizer), t) for r, t in zip(REQUESTS, tools, strict=True)]
    assert gateway["ids"] == expected
    assert len(set(map(tuple, gateway["ids"]))) == len(REQUESTS)

"""vllm:lora_requests_info (gateway.lora.requests_info): vLLM's labels, the adapters of the waiting and of
the running sequences, and no sample while compute serves no adapters."""

from types import SimpleNamespace

from gateway.lora import requests_info
from protos import compute_pb2


def _seq(lora_name: str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=lora_name)


def test_the_adapters_of_waiting_and_running_sequences_label_the_sample():
    info = compute_pb2.ModelInfo(lora_limits=compute_pb2.LoraLimits(enabled=True, max_loras=4))
    scheduler = SimpleNamespace(
        waiting=[_seq("sql"), _seq(""), _seq("sql")], running=[_seq("code"), _seq("chat"), _seq("")]
    )
    (sample,) = requests_info(info, scheduler).samples
    assert sample.name == "vllm:lora_requests_info"
    assert sample.labels == {
        "max_lora": "4",
        "waiting_lora_adapters": "sql",
        "running_lora_adapters": "chat,code",
    }
    assert sample.value > 1.7e9, "the scrape's time, as vLLM sets it"


def test_no_sample_without_lora():
    scheduler = SimpleNamespace(waiting=[], running=[])
    assert requests_info(compute_pb2.ModelInfo(), scheduler).samples == []
    assert requests_info(None, None).samples == []

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_files import local_copy
from tests.e2e.greedy import keep_references
from tests.e2e.stack import SMALL_FLAGS, start_stack
from tests.tiny_model import save_tiny_llama


@pytest.fixture(scope="session")
def model_dir():
    return local_copy("smollm2").path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer):
    """A random-weight Llama (peaked logits, so greedy picks are clear) with the real model's tokenizer."""
    model = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", initializer_range=0.3)
    tokenizer.save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def stack_fp32(model_dir, logs):
    # --debug-read-kv: test_shared_pool.py and test_errors.py read raw K/V through ReadBlock.
    stack = start_stack(
        logs, "--dtype", "float32", "--kv-blocks", "512", "--log-format", "json", "--log-level", "debug",
        "--debug-read-kv",
    )  # fmt: skip
    yield stack
    stack.stop()


# The scoring stack's chat template (--chat-template TEXT) and names (--served-model-name).
SCORING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
SCORING_NAMES = ("smol", "smol-alias")


@pytest.fixture(scope="session")
def stack_scoring(model_dir, logs):
    """The real model in float32, prompts cut into 40-token chunks (so that a prompt is scored over several
    steps), a chat template and served names of its own: test_completions.py and test_lm_eval.py."""
    stack = start_stack(
        logs, "--dtype", "float32", "--kv-blocks", "256", "--max-batched-tokens", "40",
        "--chat-template", SCORING_TEMPLATE, "--served-model-name", ",".join(SCORING_NAMES),
    )  # fmt: skip
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="session")
def stack_bf16(model_dir, logs):
    # NOTE: bfloat16 GEMMs round by row count here (test_generation.py, TIES): a prompt cut into chunks
    # beside running decodes (--prefill-tokens-with-decodes) may leave transformers' one-pass greedy at a
    # near-tie wider than TIES allows, so the parity stack prefills each prompt in one step, as before.
    stack = start_stack(
        logs,
        "--dtype",
        "bfloat16",
        "--kv-blocks",
        "512",
        "--prefill-tokens-with-decodes",
        "0",
        "--decode-step-target-ms",
        "0",
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def small_stack(model_dir, logs):
    """See SMALL_FLAGS: the stack the CLI and scheduling tests run out of blocks on."""
    stack = start_stack(logs, *SMALL_FLAGS)
    yield stack
    assert stack.stop() == 0


@pytest.fixture(scope="session")
def hf_models(model_dir):
    """The same weights in plain transformers, per dtype, loaded once (never changed: their greedy references
    are kept)."""
    loaded = {}

    def get(dtype: torch.dtype):
        if dtype not in loaded:
            loaded[dtype] = keep_references(
                AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            )
        return loaded[dtype]

    return get


@pytest.fixture(scope="session")
def api(stack_fp32):
    """The `openai` client on the float32 stack."""
    with openai.OpenAI(base_url=stack_fp32.http_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def model(api):
    """The name of the model the float32 stack serves."""
    return api.models.list().data[0].id

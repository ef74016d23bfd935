"""fp8 KV scales, calibrated once at start-up: the model reads a fixed built-in text through the paged path
and each layer's K and V scale is the smallest power of two that maps MARGIN x the largest |K| (|V|) it
wrote to at most the format's largest finite value.

Guarantees: the same model files and dtype give the same scales in every compute process (a restarted
compute attaches the pool its predecessor filled); the scales are powers of two, so dividing by them is
exact and a last-bit difference in a layer's amax (another thread count) moves no scale unless it crosses a
power of two.
"""

import math
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel

from common.paging import blocks_for
from common.shared_pool import is_fp8
from compute_service.attention.kv_codec import KVScales
from compute_service.batch import ForwardBatch
from compute_service.runner import Runner
from compute_service.validation import Limits
from protos import compute_pb2

# Headroom over the calibration text's amax, for inputs that go further (the rest saturates).
MARGIN = 2.0
MAX_TOKENS = 512
BLOCK_SIZE = 16
# Varied on purpose (prose, a list, code, numbers, dialogue, another language); never the e2e parity text.
CALIBRATION_TEXT = """\
The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one hundred and
twelve steps out of habit rather than necessity. From the lamp room he could see the fishing boats
returning, their wakes drawing white lines across the darkening bay.
Shopping list: eggs (a dozen), whole milk, two lemons, basil, 500 g of flour, olive oil, black pepper.
def fibonacci(n: int) -> list[int]:
    sequence = [0, 1]
    while len(sequence) < n:
        sequence.append(sequence[-1] + sequence[-2])
    return sequence[:n]
In 2023 the station logged 1,284 mm of rain, 17% above the 30-year mean; July alone brought 312 mm.
"Are you sure the bridge is safe?" she asked. "It held the cart yesterday," he said, "and the cart is
heavier than both of us together." They crossed slowly, listening to the planks creak.
La mer était calme ce matin-là, et les mouettes tournaient au-dessus du port encore endormi.
Q: What is the boiling point of water at sea level? A: 100 degrees Celsius, or 212 degrees Fahrenheit.
SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
"""


def calibrate(model: PreTrainedModel, path: Path, kv_dtype: torch.dtype) -> KVScales:
    """The scales of an fp8 `kv_dtype` for this model (its files at `path`); none for other dtypes."""
    if not is_fp8(kv_dtype):
        return KVScales()
    config = model.config
    ids = calibration_ids(path, config.vocab_size)[: min(MAX_TOKENS, config.max_position_embeddings)]
    amax = kv_amax(model, ids)
    k = tuple(power_of_two_scale(a, kv_dtype) for a in amax[:, 0].tolist())
    v = tuple(power_of_two_scale(a, kv_dtype) for a in amax[:, 1].tolist())
    return KVScales(k, v)


def calibration_ids(path: Path, vocab_size: int) -> list[int]:
    """The built-in text in the model's tokens; without a tokenizer that fits the model (a test model) its
    UTF-8 bytes modulo the vocabulary."""
    try:
        ids = AutoTokenizer.from_pretrained(path).encode(CALIBRATION_TEXT, add_special_tokens=False)
    except (OSError, ValueError):
        ids = []
    if not ids or max(ids) >= vocab_size:
        return [byte % vocab_size for byte in CALIBRATION_TEXT.encode()]
    return ids


def kv_amax(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[layers, 2] the largest |K| and |V| each layer writes for `ids` as one prompt, in float32 (the pool
    here is a scratch one in the weights' dtype)."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    blocks = blocks_for(len(ids), BLOCK_SIZE)
    pool = torch.zeros(config.num_hidden_layers, 2, blocks, BLOCK_SIZE, heads, head_dim, dtype=model.dtype)
    runner = Runner(model)
    runner.attach(pool)
    request = compute_pb2.ForwardRequest(
        token_ids=ids,
        cu_seqlens_q=[0, len(ids)],
        num_computed=[0],
        block_tables=list(range(blocks)),
        block_table_width=blocks,
        sample=[True],
        sampling=[compute_pb2.RowSampling(temperature=0)],
    )
    limits = Limits(config.vocab_size, config.max_position_embeddings, blocks, BLOCK_SIZE)
    runner.logits(ForwardBatch.from_request(request, limits))
    return pool.abs().amax(dim=(2, 3, 4, 5)).float()


def power_of_two_scale(amax: float, dtype: torch.dtype) -> float:
    """The smallest power of two s with amax * MARGIN / s <= dtype's largest finite value."""
    if not math.isfinite(amax):
        raise ValueError(f"calibration met a non-finite K/V value ({amax}): the model's activations overflow")
    if amax == 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * MARGIN / torch.finfo(dtype).max))

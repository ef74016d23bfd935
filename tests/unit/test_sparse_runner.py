"""Block-sparse decode through the runner of a tiny random Llama on the cpu-native backend: exactly dense
when the budget covers the tables, different once it selects; the block summaries a step may have made
stale (blocks it writes, a prefix the cache found) are rebuilt from the pool."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.sparse_settings import SparseAttention, SparseMode
from compute_service import planning
from compute_service.batch import ForwardBatch
from compute_service.model_loader import register_attention
from compute_service.runner import Runner
from compute_service.validation import Limits
from tests.forward import forward_request
from tests.tiny_model import tiny_llama_config

BLOCK, NUM_BLOCKS, PROMPT, STEPS = 4, 64, 41, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_llama_config(initializer_range=0.3)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=register_attention("cpu-native"), dtype=torch.float32
    ).eval()


def runner(model, sparse: SparseAttention | None) -> Runner:
    mode = None if sparse is None else SparseMode(sparse)
    plan = planning.resolve(model.config, planning.Flags(sparse_attention=mode), planning.this_machine())
    config = model.config
    paged = Runner(model, plan=plan)
    paged.attach(torch.zeros(config.num_hidden_layers, 2, NUM_BLOCKS, BLOCK, 2, config.head_dim))
    return paged


def batch(model, request) -> ForwardBatch:
    limits = Limits(model.config.vocab_size, model.config.max_position_embeddings, NUM_BLOCKS, BLOCK)
    return ForwardBatch.from_request(request, limits)


def greedy_logits(model, sparse: SparseAttention | None) -> list[torch.Tensor]:
    """The logits of a prompt's step and of STEPS greedy decodes after it, on shuffled blocks."""
    torch.manual_seed(1)
    table = torch.randperm(NUM_BLOCKS).tolist()
    paged, tokens, logits = runner(model, sparse), list(range(3, 3 + PROMPT)), []
    for step in range(STEPS + 1):
        new = tokens if step == 0 else tokens[-1:]
        cached = 0 if step == 0 else len(tokens) - 1
        logits.append(paged.logits(batch(model, forward_request([new], [cached], [table], block_size=BLOCK))))
        tokens.append(int(logits[-1][-1].argmax()))
    return logits


def test_a_covering_budget_is_exactly_dense_and_a_smaller_one_selects(model):
    dense = greedy_logits(model, None)
    covering = greedy_logits(model, SparseAttention(sink=1, recent=1, topk=20))
    assert all(torch.equal(a, b) for a, b in zip(dense, covering, strict=True))
    selecting = greedy_logits(model, SparseAttention(sink=1, recent=1, topk=2))
    assert torch.equal(selecting[0], dense[0]), "the prompt's step stays dense"
    assert not torch.allclose(selecting[1], dense[1], atol=1e-5), "a decode of 11 blocks attends to 4"


def test_a_prompts_last_token_alone_stays_dense(model):
    # after a prefix hit of all but the prompt's last token, that token is a one-token step of the prompt
    dense, sparse = runner(model, None), runner(model, SparseAttention(sink=1, recent=1, topk=2))
    table, prompt = list(range(20)), list(range(3, 3 + PROMPT))
    last = []
    for paged in (dense, sparse):
        paged.logits(batch(model, forward_request([prompt[:-1]], [0], [table], block_size=BLOCK)))
        request = forward_request([prompt[-1:]], [PROMPT - 1], [table], block_size=BLOCK)
        request.prompt_chunk.append(True)
        last.append(paged.logits(batch(model, request)))
    assert torch.equal(*last)


def test_written_blocks_and_a_cached_prefix_are_rebuilt_from_the_pool(model):
    paged = runner(model, SparseAttention(sink=1, recent=1, topk=2))
    table = list(range(20))
    paged.logits(batch(model, forward_request([list(range(3, 3 + PROMPT))], [0], [table], block_size=BLOCK)))
    paged.logits(batch(model, forward_request([[7]], [PROMPT], [table], block_size=BLOCK)))
    summaries = paged.summaries
    assert summaries.current[1:10].all() and not summaries.current[10], "read blocks current, written not"
    # a new sequence's table holds blocks 0-4 as cached hits (the cache may have refilled them)
    request = forward_request([[9]], [20], [[0, 1, 2, 3, 4, 30]], block_size=BLOCK)
    request.cached_prefix.append(True)
    summaries.current[:] = True
    paged._sparse(batch(model, request))
    assert (~summaries.current).nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4, 30]

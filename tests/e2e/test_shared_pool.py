"""The pool is one memory: K/V written by the compute process are read back through the cache process."""

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from protos import cache_pb2, compute_pb2

pytestmark = pytest.mark.e2e


def _read(stack, block: int, layer: int) -> torch.Tensor:
    reply = stack.cache().ReadBlock(
        cache_pb2.ReadBlockRequest(block_id=block, layer=layer, include_data=True)
    )
    assert reply.dtype == "float32"
    return torch.from_numpy(np.frombuffer(reply.data, dtype=np.float32).copy()).view(*reply.shape)


def test_values_written_by_compute_are_read_by_cache(stack_fp32, hf_models):
    cache, compute = stack_fp32.cache(), stack_fp32.compute()
    tokens = [504, 3575, 282, 4649, 314]
    table = cache.Reserve(
        cache_pb2.ReserveRequest(
            new_seqs=[cache_pb2.SequenceRequest(seq_id="shared-pool-test", num_tokens=5)]
        )
    ).tables[0]
    try:
        (block,) = table.block_ids
        before = _read(stack_fp32, block, layer=0)
        compute.Forward(
            compute_pb2.ForwardRequest(
                pool_epoch=stack_fp32.stats().pool_epoch,
                token_ids=tokens,
                cu_seqlens_q=[0, 5],
                num_computed=[0],
                block_tables=[block],
                block_table_width=1,
                sample=[True],
                sampling=[compute_pb2.RowSampling(temperature=0.0)],
            ),
            timeout=60,
        )
        after = _read(stack_fp32, block, layer=0)
    finally:
        cache.Free(cache_pb2.FreeRequest(seq_ids=["shared-pool-test"]))
    model = hf_models(torch.float32)
    layer = model.model.layers[0]
    with torch.inference_mode():
        hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor(tokens)))
        values = layer.self_attn.v_proj(hidden).view(5, 3, 64)
        keys = layer.self_attn.k_proj(hidden).view(1, 5, 3, 64).transpose(1, 2)
        cos, sin = model.model.rotary_emb(hidden, torch.arange(5)[None])
        _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
    # [K/V, slot, kv head, head dim]: the five written slots hold this prompt's rotated keys and its values,
    # the rest is untouched. A freed block keeps its bytes, so "changed" would depend on earlier tests.
    torch.testing.assert_close(after[0, :5], keys[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[1, :5], values, rtol=1e-4, atol=1e-4)
    assert torch.equal(after[:, 5:], before[:, 5:])
    assert stack_fp32.stats().used_blocks == 0

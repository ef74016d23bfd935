"""The execution plan (compute_service.planning): each stage's implementation and reason for the model,
flags and machine it is resolved for, the refusals, and its report (the log line's summary, GetModelInfo's
message)."""

from dataclasses import replace

import pytest
import torch
from transformers import BertConfig

from common import cpu
from common.sparse_settings import SparseMode
from compute_service import fused, planning
from compute_service.model_info import plan_message
from compute_service.plan import STAGES
from compute_service.planning import Flags
from tests.architectures import tiny_config
from tests.tiny_model import tiny_llama_config

LLAMA = tiny_llama_config()
# A machine as each kind of host gives it: this CPU with and without the native kernels built, and AVX2-only.
BUILT = planning.Machine(isa="AMX", profile="native", kernels=True, bfloat16_native=True, onednn=True)
UNBUILT = replace(BUILT, kernels=False)
AVX2 = replace(BUILT, isa="AVX2", profile="avx2", bfloat16_native=False)


def implementations(config=LLAMA, machine=BUILT, **flags) -> dict[str, str]:
    plan = planning.resolve(config, Flags(**flags), machine)
    return {stage: choice.implementation for stage, choice in plan.stages().items()}


def reasons(config=LLAMA, machine=BUILT, **flags) -> dict[str, str]:
    plan = planning.resolve(config, Flags(**flags), machine)
    return {stage: choice.reason for stage, choice in plan.stages().items()}


def test_float32_llama_with_the_native_kernels_runs_every_native_path():
    got = implementations()
    assert got == {
        "layers": "fused",
        "layers.decode": "native-stack",
        "linears.decoder": "panels float32",
        "linears.head": "panels float32",
        "attention.prefill": "cpu-native: the native kernel, K/V read in place by block table",
        "attention.decode": "cpu-native: the native kernel, K/V read in place by block table",
        "sampling.greedy": "native",
        "sampling": "torch",
    }
    assert "16-float vectors" in reasons()["attention.decode"], "AVX-512 scores head dim 64 by vectors"


def test_without_the_native_kernels_every_stage_names_its_pure_torch_implementation():
    got, why = implementations(machine=UNBUILT), reasons(machine=UNBUILT)
    assert got["attention.decode"].startswith("cpu: ") and "cannot be built" in why["attention.decode"]
    assert (got["layers"], got["layers.decode"]) == ("fused", "fused")
    assert "cpu-native attention" in why["layers.decode"]
    assert got["linears.decoder"] == "onednn float32" and "cannot be built" in why["linears.decoder"]
    assert got["sampling.greedy"] == "torch"


def test_an_avx2_machine_keeps_the_native_paths_and_refuses_bfloat16_products():
    assert implementations(machine=AVX2) == implementations()
    assert "16-float vectors" not in reasons(machine=AVX2)["attention.decode"]
    with pytest.raises(ValueError, match="need a cpu with AVX512-BF16 or AMX"):
        planning.resolve(LLAMA, Flags(weights="bfloat16"), AVX2)


def test_the_machine_is_what_common_cpu_answers(monkeypatch):
    machine = planning.this_machine()
    assert (machine.isa, machine.profile) == (cpu.isa_level(cpu.cpu_flags()), cpu.profile())
    assert machine.bfloat16_native == cpu.bfloat16_native()
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert cpu.isa_level(cpu.cpu_flags()) == "AVX2" and not cpu.bfloat16_native()


def test_bfloat16_keeps_transformers_layers_and_linears_and_the_cpu_attention():
    got, why = implementations(dtype=torch.bfloat16), reasons(dtype=torch.bfloat16)
    assert (got["layers"], got["layers.decode"]) == ("transformers", "transformers")
    assert "float32 only" in why["layers"]
    assert got["linears.decoder"] == "transformers bfloat16"
    assert (
        got["attention.prefill"].startswith("cpu: ") and "rounds as transformers" in why["attention.prefill"]
    )


@pytest.mark.parametrize(
    ("weights", "decoder", "decode_layers"),
    [("int8", "panels int8", "native-stack"),
     ("int4", "panels int4", "native-stack"),
     ("bfloat16", "onednn bfloat16", "native-stack")],
)  # fmt: skip
def test_weights_modes_choose_their_linears_and_the_head_is_int8_when_quantised(
    weights, decoder, decode_layers
):
    got, why = implementations(weights=weights), reasons(weights=weights)
    assert (got["linears.decoder"], got["layers.decode"]) == (decoder, decode_layers)
    if weights in ("int8", "int4"):
        assert got["linears.head"] == "panels int8" and "output head is int8" in why["linears.head"]


def test_quantised_weights_without_the_native_kernels_take_torchs_kernels_and_onednn_above():
    got = implementations(machine=UNBUILT, weights="int8")
    assert got["linears.decoder"] == "weight-only int8 up to 16 rows, onednn float32 above"
    bf16 = implementations(dtype=torch.bfloat16, weights="int4")
    assert bf16["linears.decoder"] == "weight-only int4 up to 16 rows, dense bfloat16 above"


@pytest.mark.parametrize(
    ("flags", "stage", "implementation", "reason"),
    [(dict(kv_dtype=torch.float8_e4m3fn), "layers.decode", "fused", "fp8_e4m3 pool"),
     (dict(kv_dtype=torch.bfloat16), "layers.decode", "native-stack", "in C++"),
     (dict(fused=False), "layers", "transformers", "--unfused"),
     (dict(plain_linear=True), "linears.decoder", "transformers float32", "--plain-linear"),
     (dict(attention_backend="cpu"), "layers.decode", "fused", "cpu-native attention"),
     (dict(attention_backend="cuda"), "attention.decode", "cuda: ", "--attention-backend cuda")],
)  # fmt: skip
def test_flags_decide_the_stage_they_name(flags, stage, implementation, reason):
    assert implementations(**flags)[stage].startswith(implementation)
    assert reason in reasons(**flags)[stage]


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_biased_projections_decode_in_the_native_stack(bias):
    got = implementations(tiny_llama_config(**{bias: True}))
    assert (got["layers"], got["layers.decode"]) == ("fused", "native-stack")


@pytest.mark.parametrize(
    ("name", "layers", "decode"),
    [("mistral", "fused", "native-stack"),
     ("qwen2", "fused", "native-stack"),
     ("qwen3", "fused", "native-stack"),
     ("gemma2", "transformers", "transformers"),
     ("mixtral", "transformers", "transformers")],
)  # fmt: skip
def test_each_architecture_runs_the_layers_it_fits_and_the_plan_says_why(name, layers, decode):
    config = tiny_config(name)
    got, why = implementations(config), reasons(config)
    assert (got["layers"], got["layers.decode"]) == (layers, decode)
    if layers == "transformers":
        assert why["layers"] == (
            f"{fused.UNFUSED_LAYERS[name]}: the fused forward supports llama, mistral, qwen2, qwen3 only"
        )
    if decode == "transformers":
        assert why["layers.decode"] == "the native decode stack runs the fused layers only"
    assert got["linears.decoder"] == "panels float32", "the linears and attention do not depend on it"


def test_a_model_compute_does_not_serve_or_attend_is_refused_by_the_plan():
    with pytest.raises(ValueError, match="model_type 'bert' is an encoder-only model"):
        planning.resolve(BertConfig(), Flags(), BUILT)
    with pytest.raises(ValueError, match="--max-model-len 9999 is beyond this model's"):
        planning.resolve(LLAMA, Flags(max_model_len=9999), BUILT)
    assert planning.resolve(LLAMA, Flags(max_model_len=64), BUILT).max_model_len == 64


def test_an_accelerator_runs_its_backend_and_transformers_linears():
    plan = planning.resolve(LLAMA, Flags(dtype=torch.bfloat16, device="cuda:0"), BUILT)
    got = {stage: choice.implementation for stage, choice in plan.stages().items()}
    assert plan.attention_backend == "cuda" and got["linears.decoder"] == "transformers bfloat16"
    assert got["sampling.greedy"] == "torch" and plan.device == "cuda:0"


@pytest.mark.parametrize(
    ("flags", "machine", "message"),
    [(dict(weights="int8", device="cuda"), BUILT, "--weights int8 runs torch's CPU kernels; on cuda"),
     (dict(weights="int4", plain_linear=True), BUILT, "--plain-linear .* cannot combine with --weights int4"),
     (dict(attention_backend="cpu-native"), UNBUILT, "cpu-native: its kernel cannot be built here"),
     (dict(attention_backend="npu"), BUILT, "'npu' runs on npu, not on cpu"),
     (dict(attention_backend="cuda", kv_dtype=torch.float8_e5m2), BUILT, "'cuda' cannot store K/V as fp8"),
     (dict(weights="int3"), BUILT, "unknown --weights 'int3'")],
)  # fmt: skip
def test_combinations_that_cannot_run_are_refused_before_the_config_is_read(flags, machine, message):
    with pytest.raises(ValueError, match=message):
        planning.check(Flags(**flags), machine)


def test_the_report_names_every_stage_in_order():
    plan = planning.resolve(LLAMA, Flags(weights="int4"), AVX2)
    summary = plan.summary()
    assert list(summary)[-len(STAGES) :] == list(STAGES)
    assert (summary["isa"], summary["native_kernels"]) == ("AVX2 (profile avx2)", "built")
    message = plan_message(plan)
    assert [s.stage for s in message.stages] == list(STAGES) and all(s.reason for s in message.stages)
    assert (message.architecture, message.isa, message.native_kernels) == (
        "llama",
        "AVX2 (profile avx2)",
        True,
    )
    assert message.stages[2].implementation == summary["linears.decoder"]


def test_block_sparse_decode_runs_in_cpu_native_and_its_native_decode_stack():
    sparse = SparseMode()
    plan = planning.resolve(LLAMA, Flags(sparse_attention=sparse), BUILT)
    assert plan.sparse_attention == sparse and plan.decode_layers.implementation == "native-stack"
    decode = plan.attention_decode
    assert decode.implementation.startswith(
        "cpu-native: block-sparse for every decode by default (sink=1,recent=4,topk=8"
    )
    assert decode.reason.startswith("--sparse-attention sink=1,recent=4,topk=8")
    assert "block-sparse" not in plan.attention_prefill.implementation
    allowed = planning.resolve(LLAMA, Flags(sparse_attention=SparseMode(default=False)), BUILT)
    assert allowed.attention_decode.implementation.startswith(
        "cpu-native: block-sparse for decodes of requests asking for it (allow,sink=1,recent=4,topk=8"
    )


@pytest.mark.parametrize("flags", [{"attention_backend": "cpu"}, {"dtype": torch.bfloat16}])
def test_block_sparse_decode_elsewhere_than_cpu_native_is_refused(flags):
    with pytest.raises(
        ValueError, match="--sparse-attention runs in the cpu-native attention backend, not in cpu"
    ):
        planning.resolve(LLAMA, Flags(sparse_attention=SparseMode(), **flags), BUILT)


def test_block_sparse_decode_of_a_model_without_full_attention_layers_is_refused():
    mistral = tiny_config("mistral")
    with pytest.raises(ValueError, match="every layer of this mistral model attends within a sliding window"):
        planning.resolve(mistral, Flags(sparse_attention=SparseMode()), BUILT)

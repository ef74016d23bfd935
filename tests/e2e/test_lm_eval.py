"""lm-evaluation-harness (`lm_eval`, the CLI users run) against the real stack through `local-completions`: a
multiple-choice (log-likelihood) task and a `generate_until` task, both defined here from local JSONL files
(no hub). Its tokenizer is the server's (/tokenizer_info, /tokenize); the log-likelihoods it records equal
transformers' float32 ones within 1e-4 per token, and its generations equal the server's own greedy ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import SCORING_NAMES

pytestmark = pytest.mark.e2e
TOL_PER_TOKEN = 1e-4
QUESTIONS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": [" six", " eight"], "answer": 1},
    {"question": "Which colour is a clear sky?", "choices": [" green", " blue", " red"], "answer": 1},
]
PROMPTS = [
    {"prompt": "The capital of France is", "target": " Paris"},
    {"prompt": "One, two, three,", "target": " four"},
]
MC_TASK = """task: pagedserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pagedserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


def write_task(folder: Path, name: str, template: str, rows: list[dict]) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(template.format(data=data))


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_local_completions_scores_as_transformers(stack_scoring, tokenizer, hf_models, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_task(tasks, "pagedserve_mc", MC_TASK, QUESTIONS)
    write_task(tasks, "pagedserve_gen", GEN_TASK, PROMPTS)
    out = tmp_path / "out"
    model_args = f"base_url={stack_scoring.http_url}/completions,model={SCORING_NAMES[0]},max_retries=1"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "pagedserve_mc,pagedserve_gen", "--include_path", str(tasks), "--batch_size", "4",
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "remote tokenizer" in run.stderr.lower(), "lm-eval took the server's tokenizer (/tokenize)"
    model = hf_models(torch.float32)
    scored = samples(out, "pagedserve_mc")
    assert len(scored) == len(QUESTIONS)
    for sample in scored:
        # NOTE: the samples file holds each request's (context, continuation) and (loglikelihood, is_greedy)
        # as text.
        for args, ((recorded, _),) in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation, loglikelihood = args["arg_0"], args["arg_1"], float(recorded)
            context_ids = tokenizer.encode(context, add_special_tokens=False)
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            with torch.inference_mode():
                logprobs = model(torch.tensor([whole])).logits[0, :-1].float().log_softmax(-1)
            targets = torch.tensor(whole[len(context_ids) :])
            expected = logprobs[len(context_ids) - 1 :].gather(1, targets[:, None]).sum().item()
            assert abs(loglikelihood - expected) <= TOL_PER_TOKEN * len(targets), (continuation, expected)
    generated = samples(out, "pagedserve_gen")
    with stack_scoring.client(timeout=120) as client:
        for sample in generated:
            prompt = sample["doc"]["prompt"]
            ours = client.generate(token_ids=tokenizer.encode(prompt, add_special_tokens=False), max_tokens=8,
                                   temperature=0, stop=["\n"])  # fmt: skip
            assert sample["resps"] == [[ours.text]], prompt

"""A short soak as a user runs it (`pagedserve bench --workload soak`), bounded to two kills: a stack of the
tiny random model under `up`, the mixed workload, the cache and then the gateway killed (SIGKILL, the
schedule of seed 1, at 7.5 s and 15 s: both inside the first pass, whose 48 requests arrive over 22.6 s,
so the soak is that one pass). Its report holds real figures: every request completed and identical to the
fault-free pass (greedy and seeded), both faults recovered, latency around them, each service's memory,
nothing left in the cache or /dev/shm."""

import json
import subprocess

import pytest

from tests.helpers import PAGEDSERVE, ROOT
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """The tiny model, long enough for the mixed workload's prompts (up to 1,024 tokens)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-2k", initializer_range=0.3,
                           max_position_embeddings=2048)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


def test_a_short_soak_reports_every_request_identical_and_nothing_left(model, tmp_path):
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "soak", "--model", str(model), "--dtype", "float32",
         "--duration", "20", "--kill-every", "7.5", "--seed", "1", "--json", str(tmp_path / "soak.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert json.loads(out.stdout) == result
    requests = result["requests"]
    assert requests["sent"] >= 48 and requests["sent"] % 48 == 0, "whole passes of the mixed workload"
    assert requests["completed"] == requests["identical"] == requests["sent"], requests
    assert requests["failed"] == 0 and requests["resumed"] >= 1, "the gateway's kill broke streams"
    faults = result["faults"]
    assert [f["service"] for f in faults] == ["cache", "gateway"]
    for fault in faults:
        # NOTE: a token already on its way when the service was killed may arrive within the millisecond
        # next_token_s is rounded to: 0.0 then; None would mean no stream went on
        assert fault["back_s"] > 0 and fault["next_token_s"] is not None and fault["next_token_s"] >= 0, fault
    latency = result["latency"]
    assert latency["around_faults"]["requests"] >= 1
    assert latency["around_faults"]["requests"] + latency["away_from_faults"]["requests"] == requests["sent"]
    for figures in (latency["fault_free_pass"], latency["around_faults"]):
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert 0 < figures["itl_p50_ms"] <= figures["itl_p99_ms"] <= figures["itl_max_ms"]
    memory = result["memory"]
    assert memory.keys() == {"cache", "compute", "gateway"}
    assert all(m["rss_start_mib"] > 10 and m["rss_peak_mib"] >= m["rss_end_mib"] for m in memory.values())
    assert (memory["cache"]["processes"], memory["gateway"]["processes"], memory["compute"]["processes"]) == (
        2, 2, 1
    )  # fmt: skip
    end = result["end"]
    assert (end["used_blocks"], end["num_sequences"]) == (0, 0)
    assert end["total_blocks"] > 0 and end["live_cache_files"] >= 1
    assert (end["stray_files"], end["left_after_stop"]) == (0, 0)
    assert (result["duration_s"], result["kill_every_s"]) == (20, 7.5) and result["machine"]

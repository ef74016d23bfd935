"""The dashboard in headless Chromium (Debian's chromium and chromium-driver, driven by selenium through the
system chromedriver) against a real stack (`pagedserve up`, a tiny random-weight model, API keys): the page
loads without console errors, draws one cell per block, shows used cells while requests run and hovering a
sequence lights its blocks, and the cells go back to free or cached once they end. The test writes a
screenshot to its tmp dir, and to $PAGEDSERVE_DASHBOARD_PNG too when set (then the requests run 15 s longer
first, so the charts show a trace): `docs/dashboard.png` is made so.
"""

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cli.launch import Stack, free_port
from protos import cache_pb2
from sdk.client import Client
from tests.helpers import ROOT
from tests.tiny_model import save_tiny_llama

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        shutil.which("chromium") is None or shutil.which("chromedriver") is None,
        reason="chromium or chromedriver missing: run `make setup`",
    ),
]
KEYS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef"}
NUM_BLOCKS = 300
MAX_MODEL_LEN = 4096
SCREENSHOT_ENV = "PAGEDSERVE_DASHBOARD_PNG"
# With SCREENSHOT_ENV set, the requests run this much longer before the screenshot (the charts get a trace).
SCREENSHOT_DWELL_S = 15
# Long enough that no request ends by itself while the test looks (it cancels them).
LONG = dict(max_tokens=MAX_MODEL_LEN - 200, ignore_eos=True, temperature=0.8)
WAIT_S = 30
CELL_STATES = "JSON.stringify(Array.from(document.querySelectorAll('#grid .cell'), c => c.className))"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    tmp = tmp_path_factory.mktemp("dashboard")
    model = save_tiny_llama(
        tmp / "tiny", initializer_range=0.3, max_position_embeddings=MAX_MODEL_LEN, vocab_size=len(tokenizer)
    )
    tokenizer.save_pretrained(model)
    keys = tmp / "api-keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    keys.chmod(0o600)
    http_port = free_port()
    stack = Stack.start(
        "--model", str(model), "--dtype", "float32", "--kv-blocks", str(NUM_BLOCKS), "--api-keys", str(keys),
        "--http-port", str(http_port), log_dir=tmp, cwd=ROOT, timeout=300,
    )  # fmt: skip
    stack.http = f"http://127.0.0.1:{http_port}"
    try:
        yield stack
    finally:
        assert stack.stop() == 0


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # NOTE: the system chromedriver, named: selenium-manager would try to download one.
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver, stack: Stack, key: str | None) -> None:
    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(f"{stack.http}/dashboard" + (f"#key={key}" if key else ""))


def wait_for(driver, condition, message: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: condition(d), message)


def updated(driver, after: int) -> int | None:
    """The page's poll count once it has drawn more than `after` states."""
    count = int(driver.execute_script("return document.body.dataset.updates || 0"))
    return count if count > after else None


def cell_states(driver) -> list[str]:
    """Each cell's state letter: f free, u used, s shared, c cached."""
    return [name.split()[1] for name in json.loads(driver.execute_script(f"return {CELL_STATES}"))]


def errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def state(stack: Stack, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{stack.http}/dashboard/state", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@contextmanager
def generating(stack: Stack, key: str, prompt: str, **kwargs) -> Iterator[list[int]]:
    """A streamed request in a thread while the block runs, cancelled when it ends; yields its token count."""
    tokens, stop, failure = [0], threading.Event(), []

    def run() -> None:
        try:
            with Client(stack.target, api_key=key, timeout=300) as client:
                for chunk in client.stream(prompt, **LONG, **kwargs):
                    tokens[0] += len(chunk.token_ids)
                    if stop.is_set():
                        break
        except Exception as err:  # noqa: BLE001 - reported by the test thread
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield tokens
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and not failure, failure


def test_the_page_draws_one_cell_per_block_without_console_errors(stack, browser):
    with Client(stack.target, api_key=KEYS["alice"]) as client:
        assert client.info().num_blocks == NUM_BLOCKS
    open_page(browser, stack, KEYS["alice"])
    wait_for(browser, lambda d: updated(d, 1), "the page never drew two states")
    states = cell_states(browser)
    assert len(states) == NUM_BLOCKS
    assert set(states) <= set("fusc")
    assert browser.find_element("id", "status").text.startswith("live")
    assert "viewing as alice" in browser.find_element("id", "meta").text
    assert errors(browser) == []


def test_cells_are_used_while_requests_run_and_hovering_one_lights_its_blocks(stack, browser, tmp_path):
    system = "You are a careful assistant who answers in one short paragraph. " * 30  # ~22 blocks
    with Client(stack.target, api_key=KEYS["alice"]) as client:
        # both leave their full blocks cached: the first's for the long request to share, the other's unused
        client.generate(system + "Say hello.", max_tokens=4)
        client.generate("An unrelated question about the weather in spring. " * 20, max_tokens=4)
    open_page(browser, stack, KEYS["alice"])
    with (
        generating(stack, KEYS["alice"], system + "Tell a long story.", n=2, request_id="dash-long") as ours,
        generating(stack, KEYS["bob"], "Count to a thousand, slowly. " * 40, request_id="dash-bob"),
    ):
        row = ".seq.own"  # a row of alice's
        wait_for(browser, lambda d: len(d.find_elements("css selector", row)) == 2, "alice's 2 samples")
        wait_for(browser, lambda d: cell_states(d).count("u") >= 4, "no used cells while requests run")
        assert "s" in cell_states(browser), "the samples share their prompt's blocks"
        time.sleep(SCREENSHOT_DWELL_S if os.environ.get(SCREENSHOT_ENV) else 0)
        lit = wait_for(browser, hover_own, "hovering a sequence lit none of its blocks")
        assert len(lit["cells"]) >= 4 and lit["cells"] == lit["chips"]
        assert "dash-long" in lit["row"]
        assert browser.save_screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get(SCREENSHOT_ENV):
            shutil.copyfile(tmp_path / "dashboard.png", os.environ[SCREENSHOT_ENV])
        assert ours[0] > 0, "alice's request streams while the page shows it"
        check_the_state_endpoint(stack)
    wait_for(browser, lambda d: not set("us") & set(cell_states(d)), "used cells stayed after the requests")
    wait_for(browser, lambda d: not d.find_elements("css selector", ".seq"), "sequences stayed listed")
    after = cell_states(browser)
    assert after.count("c") >= 4, "the requests' written full blocks stay cached"
    assert errors(browser) == []
    stats = stack.cache().GetStats(cache_pb2.GetStatsRequest(), timeout=10)
    block_map = stack.cache().GetBlockMap(cache_pb2.GetBlockMapRequest(), timeout=10)
    assert (after.count("f"), after.count("c")) == (stats.free_blocks, stats.cached_blocks)
    assert list(block_map.states).count(cache_pb2.BLOCK_STATE_CACHED) == stats.cached_blocks
    assert block_map.num_blocks == NUM_BLOCKS and not any(block_map.refcounts)


def hover_own(driver) -> dict | None:
    """Hovers alice's first row; its lit blocks (see lit_blocks) and its text, or None to try again (the
    page redraws the rows every poll, so the row may be replaced under the pointer)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains

    try:
        ActionChains(driver).move_to_element(driver.find_element("css selector", ".seq.own")).perform()
        lit = lit_blocks(driver)
        return lit and {**lit, "row": driver.find_element("css selector", ".seq.hl").text}
    except (NoSuchElementException, StaleElementReferenceException):
        return None


def lit_blocks(driver) -> dict | None:
    """The lit cells and the hovered row's block chips, read at one moment; None until the lit cells are the
    row's and all used (the block map and the tables are fetched apart, so a poll may see them differ)."""
    found = driver.execute_script(
        "const row = document.querySelector('.seq.hl');"
        "return JSON.stringify({cells: Array.from(document.querySelectorAll('#grid .cell.hl'),"
        "  c => [Number(c.dataset.id), c.classList[1]]),"
        "  chips: row ? Array.from(row.querySelectorAll('.blk'), c => Number(c.textContent)) : []});"
    )
    found = json.loads(found)
    cells = sorted(block for block, _ in found["cells"])
    used = all(state in "us" for _, state in found["cells"])
    if not cells or not used or cells != sorted(found["chips"]):
        return None
    return {"cells": cells, "chips": sorted(found["chips"])}


def check_the_state_endpoint(stack: Stack) -> None:
    """During the requests: no key, no state; bob sees alice's sequences without their ids."""
    status, body = state(stack, None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = state(stack, KEYS["bob"])
    assert status == 200 and body["viewer"] == "bob"
    own = [seq for seq in body["sequences"] if seq["own"]]
    others = [seq for seq in body["sequences"] if not seq["own"]]
    assert [seq["request_id"] for seq in own] == ["dash-bob"]
    assert len(others) == 2 and all(seq["request_id"] == "" and seq["blocks"] for seq in others)
    assert "dash-long" not in json.dumps(body)


def test_without_a_key_the_page_says_how_to_give_one(stack, browser):
    open_page(browser, stack, None)
    wait_for(browser, lambda d: "API key" in d.find_element("id", "status").text, "no key message")
    assert browser.find_elements("css selector", "#grid .cell") == []
    logged = errors(browser)
    assert logged and all("401" in entry["message"] for entry in logged), logged


def test_the_page_takes_the_key_as_a_query_parameter_too(stack, browser):
    browser.get(f"{stack.http}/dashboard?key={KEYS['bob']}")
    wait_for(browser, lambda d: updated(d, 0), "the page never drew a state")
    assert "viewing as bob" in browser.find_element("id", "meta").text
    assert len(cell_states(browser)) == NUM_BLOCKS

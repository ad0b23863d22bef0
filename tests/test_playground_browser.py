"""The playground in a real browser: Chromium (Debian's package) driven by Selenium through Debian's
chromedriver, against a real server. The page loads, a prompt streams, coloured tokens appear and
their counts are the request's own (``usage.speculative``), the side-by-side texts are equal, an API
key is honoured; a screenshot is written (``AUGUR_ARTIFACTS``, default ``.artifacts/``). Skipped where
Chromium, chromedriver or Selenium are missing (``.ci/run`` installs them)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from test_ngram import target  # noqa: F401

from server.app import ServerSettings, create_app
from servers import engine_factory, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver") if CHROMIUM and DRIVER else None
pytestmark = pytest.mark.skipif(webdriver is None, reason="needs chromium, chromedriver and selenium")
ARTIFACTS = Path(os.environ.get("AUGUR_ARTIFACTS", Path(__file__).resolve().parents[1] / ".artifacts"))


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(driver, condition, timeout: float = 120.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))


def fill(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def run_page(driver, mode: str, prompt: str, max_tokens: int, depth: str = "") -> dict:
    """Run one request from the page (with its side-by-side run); what the page then shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    wait_for(driver, lambda d: d.find_element(By.ID, "status").text in ("ready", "done"))
    Select(driver.find_element(By.ID, "mode")).select_by_value(mode)
    fill(driver, "prompt", prompt)
    fill(driver, "max_tokens", str(max_tokens))
    fill(driver, "temperature", "0")
    fill(driver, "num_draft_tokens", depth)
    driver.find_element(By.ID, "run").click()
    wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")
    assert driver.find_element(By.ID, "status").text == "done", driver.find_element(By.ID, "status").text
    spans = driver.find_elements(By.CSS_SELECTOR, "#tokens-spec .tok")
    body = driver.find_element(By.TAG_NAME, "body")
    return {
        "kinds": [s.get_attribute("data-kind") for s in spans],
        "titles": [s.get_attribute("title") for s in spans],
        "plain_kinds": [
            s.get_attribute("data-kind") for s in driver.find_elements(By.CSS_SELECTOR, "#tokens-plain .tok")
        ],
        "strip": driver.find_element(By.ID, "strip-spec").text,
        "verdict": driver.find_element(By.ID, "verdict").text,
        "spec_text": body.get_attribute("data-spec-text"),
        "plain_text": body.get_attribute("data-plain-text"),
    }


def test_the_page_streams_coloured_tokens_whose_counts_are_the_requests(browser, target):  # noqa: F811
    # (the target drafting for itself as a draft model: greedy drafts it always keeps, and plain steps)
    factory = engine_factory(target, speculative_method="draft", draft_model=str(target))
    with serve(create_app(ServerSettings(served_model_name="tiny"), factory)) as srv:
        browser.get(srv.base + "/")  # (it points to the playground)
        shown = run_page(browser, "completion", "a b c a b c a b c a b c a b", 48, depth="4")
        kinds = shown["kinds"]
        assert len(kinds) == 48 and set(kinds) <= {"accepted", "bonus", "recovered", "forced", "plain"}
        assert "accepted" in kinds and "bonus" in kinds, "its own drafts: the target keeps them"
        accepted = int(re.search(r"server: [\w+-]+, (\d+) accepted", shown["strip"])[1])
        assert kinds.count("accepted") == accepted  # the page's colours are the server's own count
        assert shown["strip"].startswith("48 tokens")
        assert all(t.startswith(("accepted · draft", "bonus · draft", "recovered · draft", "plain · no draft"))
                   for t in shown["titles"])  # fmt: skip
        assert set(shown["plain_kinds"]) == {"plain"} and len(shown["plain_kinds"]) == 48
        assert shown["spec_text"] == shown["plain_text"] and shown["verdict"].startswith("Identical text")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "playground.png"))
        chat = run_page(browser, "chat", "say a b c", 16)
        assert len(chat["kinds"]) == 16 and chat["spec_text"] == chat["plain_text"]


def test_the_demo_pair_and_an_api_key(browser, tiny_demo):
    """Against the demo pair (its draft model), behind a key: without it the page says so; with it the
    request runs."""
    from selenium.webdriver.common.by import By

    factory = engine_factory(tiny_demo / "target", draft_model=str(tiny_demo / "draft"), speculative_method="draft")
    settings = ServerSettings(served_model_name="augur-demo", api_key="secret")
    with serve(create_app(settings, factory)) as srv:
        browser.get(srv.base + "/playground")
        wait_for(browser, lambda d: "API key" in d.find_element(By.ID, "status").text)
        fill(browser, "key", "secret")
        browser.find_element(By.ID, "prompt").click()  # (the key's change event)
        shown = run_page(browser, "chat", "Write one sentence about the sea.", 24, depth="3")
        assert len(shown["kinds"]) == 24 and shown["spec_text"] == shown["plain_text"]
        assert any(t.split(" · ")[1] == "draft" for t in shown["titles"] if not t.startswith("plain"))

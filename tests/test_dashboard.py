"""The dashboard in a real browser (Debian's headless Chromium, driven by selenium) against a
live 4-worker swarm: the page loads with no console errors, shows every node on the map, a
worker killed for real turns red within seconds and a spare takes its layers, a request's
timeline comes up from its id. A screenshot is saved ($CELLSWARM_ARTIFACTS, else the test's
temporary folder). Without Chromium the test skips, unless CELLSWARM_REQUIRE_BROWSER=1 (CI
installs it and sets that: there it must run)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm

webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.common.by import By  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CELLSWARM_REQUIRE_BROWSER") == "1":
            pytest.fail("no chromium/chromedriver: apt-get install chromium chromium-driver")
        pytest.skip("no chromium/chromedriver (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def until(what: Callable[[], Any], timeout_s: float, why: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {why}")


def node_map(driver: Any) -> dict[str, tuple[str, str]]:
    """node -> (state, layers) as the page shows it now."""
    out = {}
    for el in driver.find_elements(By.CSS_SELECTOR, "[data-node]"):
        try:
            out[el.get_attribute("data-node")] = (el.get_attribute("data-state"),
                                                  el.get_attribute("data-layers"))  # fmt: skip
        except Exception:  # replaced by the next refresh while we read it
            return {}
    return out


def severe(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_dashboard_shows_the_swarm_and_a_killed_worker_turns_red(
    demo_path: Path, tmp_path: Path, browser: Any
) -> None:
    artifacts = Path(os.environ.get("CELLSWARM_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    with LocalSwarm(str(demo_path), 4, "200M", tmp_path, stages=2) as swarm:
        swarm.wait_ready()
        rid = client.submit(swarm.url, {"prompt": "The capital of France is", "max_tokens": 8})
        assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
        browser.get(swarm.url + "/")
        assert "cellswarm" in browser.title
        nodes = until(lambda: len(m := node_map(browser)) == 4 and m, 20, "4 nodes on the map")
        assert sorted(nodes) == [f"worker-{i}" for i in range(4)]
        held = {n: layers for n, (state, layers) in nodes.items() if state == "assigned"}
        assert sorted(held.values()) == ["0..14", "15..29"], nodes
        assert [s for s, _ in nodes.values()].count("spare") == 2
        until(lambda: browser.find_elements(By.CSS_SELECTOR, "[data-queue='done'] td")
              and browser.find_element(By.CSS_SELECTOR, "[data-queue='done'] td").text == "1",
              10, "the queue panel shows the done request")  # fmt: skip

        # a request's timeline from its id
        box = browser.find_element(By.ID, "request-id")
        box.send_keys(rid)
        browser.find_element(By.CSS_SELECTOR, "#request-form button").click()
        table = until(lambda: browser.find_elements(By.CSS_SELECTOR, f"[data-request='{rid}']"),
                      10, "the request's timeline")  # fmt: skip
        assert "submitted" in table[0].text

        victim = sorted(held)[0]
        swarm.kill(victim)
        t0 = time.monotonic()
        until(lambda: node_map(browser).get(victim, ("", ""))[0] == "lost", 15,
              f"{victim} shown lost")  # fmt: skip
        red_s = time.monotonic() - t0
        el = browser.find_element(By.CSS_SELECTOR, f"[data-node='{victim}']")
        assert "state-lost" in (el.get_attribute("class") or "")
        assert el.value_of_css_property("border-left-color") == "rgba(217, 54, 54, 1)"
        taken = until(lambda: [n for n, (s, layers) in node_map(browser).items()
                               if n != victim and s == "assigned" and layers == held[victim]],
                      60, f"a spare takes {held[victim]}")  # fmt: skip
        assert taken[0] not in held, (taken, held)  # a former spare, not the other stage
        shot = artifacts / "dashboard.png"
        browser.save_screenshot(str(shot))
        print(f"{victim} red after {red_s:.1f} s; {taken[0]} holds {held[victim]}; {shot}")
        errors = severe(browser)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert not errors, errors

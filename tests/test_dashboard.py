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


def shoot(driver: Any, path: Path) -> None:
    """The whole page from the top (the window as tall as the page, up to 2,400 px)."""
    driver.execute_script("window.scrollTo(0, 0)")
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, min(max(height, 1000), 2400))
    driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def text_of(driver: Any, css: str) -> str:
    """The text of what `css` matches now, read in one script (htmx replaces panels every
    second: an element found in one call may be gone in the next)."""
    return str(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)"
        ".join(' ')", css))  # fmt: skip


def attr_of(driver: Any, css: str, name: str) -> str:
    return str(driver.execute_script(
        "const e = document.querySelector(arguments[0]); "
        "return e ? (e.getAttribute(arguments[1]) || '') : ''", css, name))  # fmt: skip


def click(driver: Any, css: str) -> None:
    driver.execute_script("document.querySelector(arguments[0]).click()", css)


def test_the_dashboard_monitors_the_swarm_idle_busy_a_node_lost_and_not_placeable(
    demo_path: Path, tmp_path: Path, browser: Any
) -> None:
    artifacts = Path(os.environ.get("CELLSWARM_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    with LocalSwarm(str(demo_path), 4, "200M", tmp_path, stages=2) as swarm:
        swarm.wait_ready()
        browser.get(swarm.url + "/")
        assert "cellswarm" in browser.title
        nodes = until(lambda: len(m := node_map(browser)) == 4 and m, 20, "4 nodes on the map")
        assert sorted(nodes) == [f"worker-{i}" for i in range(4)]
        held = {n: layers for n, (state, layers) in nodes.items() if state == "assigned"}
        assert sorted(held.values()) == ["0..14", "15..29"], nodes
        assert [s for s, _ in nodes.values()].count("spare") == 2
        # idle: the ring in token order, each stage a link to its node with address and beat
        ring = until(lambda: browser.execute_script(
            "return [...document.querySelectorAll(\"[data-ring='0'] li\")].map(li => "
            "[li.dataset.stageNode, li.textContent, li.querySelector('a').href])"), 10,
            "the ring")  # fmt: skip
        assert [held[n] for n, _, _ in ring] == ["0..14", "15..29"]
        assert "127.0.0.1:" in ring[0][1] and "beat" in ring[0][1]
        assert ring[0][2].endswith(f"#node-{ring[0][0]}")
        shoot(browser, artifacts / "dashboard-idle.png")

        # busy: a batch, its bar in colour with a rate and an ETA; requests listed as they end
        items = [{"messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                  "max_tokens": 24} for i in range(24)]
        batch = client.call(swarm.url, "/v1/batches", {"items": items, "name": "numbers"})
        bid = batch["batch_id"]
        until(lambda: "done" in text_of(browser, f"[data-batch='{bid}'] .facts"), 60,
              "the batch's bar has done jobs")  # fmt: skip
        bar = text_of(browser, f"[data-batch='{bid}']")
        assert "items/s" in bar and ("ETA" in bar or "finished" in bar), bar
        colour = browser.execute_script(
            "return getComputedStyle(document.querySelector(arguments[0])).backgroundColor",
            f"[data-batch='{bid}'] [data-segment='done']")  # fmt: skip
        assert colour == "rgb(46, 158, 79)", colour
        until(lambda: browser.find_elements(By.CSS_SELECTOR, "[data-recent]"), 20,
              "recent requests")  # fmt: skip
        ticks = text_of(browser, "[data-chart='rate'] svg")
        assert "now" in ticks and "min" in ticks and "tok/s" in ticks
        shoot(browser, artifacts / "dashboard-batch.png")
        until(lambda: client.call(swarm.url, f"/v1/batches/{bid}")["finished"] == 24, 180,
              "the batch ends")  # fmt: skip

        # a recent request, one click from the waterfall of its events
        rid = attr_of(browser, "[data-recent]", "data-recent")
        click(browser, f"[data-recent='{rid}'] a")
        until(lambda: browser.find_elements(By.CSS_SELECTOR, f"[data-request='{rid}'] .wfbar"),
              10, "the request's waterfall")  # fmt: skip
        assert "leased" in text_of(browser, f"[data-request='{rid}']")
        # the time range: 1 minute
        click(browser, "[data-range='60']")
        until(lambda: "on" in attr_of(browser, "[data-range='60']", "class"), 10,
              "1 min chosen")  # fmt: skip
        assert "-1 min" in text_of(browser, "[data-chart='latency'] svg")

        # the chat box asks the swarm
        browser.find_element(By.ID, "chat-input").send_keys("What is the capital of France?")
        browser.find_element(By.CSS_SELECTOR, "#chat-form button").click()
        until(lambda: browser.find_element(By.ID, "chat-status").text == "done", 60,
              "the chat's answer")  # fmt: skip
        assert browser.find_element(By.ID, "chat-answer").text.strip()

        # a node lost: red within seconds, a spare takes its layers
        victim = sorted(held)[0]
        swarm.kill(victim)
        t0 = time.monotonic()
        until(lambda: node_map(browser).get(victim, ("", ""))[0] == "lost", 15,
              f"{victim} shown lost")  # fmt: skip
        red_s = time.monotonic() - t0
        assert "state-lost" in attr_of(browser, f"[data-node='{victim}']", "class")
        colour = browser.execute_script(
            "return getComputedStyle(document.querySelector(arguments[0])).borderLeftColor",
            f"[data-node='{victim}']")  # fmt: skip
        assert colour == "rgb(217, 54, 54)", colour
        taken = until(lambda: [n for n, (s, layers) in node_map(browser).items()
                               if n != victim and s == "assigned" and layers == held[victim]],
                      60, f"a spare takes {held[victim]}")  # fmt: skip
        assert taken[0] not in held, (taken, held)  # a former spare, not the other stage
        shoot(browser, artifacts / "dashboard-lost.png")

        # not placeable: one worker left of four cannot make a 2-stage ring
        for name in sorted(set(node_map(browser)) - {victim})[:2]:
            swarm.kill(name)
        banner = until(lambda: text_of(browser, "[data-problem]"), 60, "the cannot-place banner")
        assert "cannot place the model" in banner
        shoot(browser, artifacts / "dashboard-not-placeable.png")
        print(f"{victim} red after {red_s:.1f} s; {taken[0]} holds {held[victim]}; {artifacts}")
        errors = severe(browser)
    assert not errors, errors

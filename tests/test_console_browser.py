"""The operator console in a real browser, over the whole stack.

Headless Chromium (Debian's `chromium` and `chromium-driver` packages; `.ci/run` installs
them) driven by Selenium opens the console that a real `vigil console` process serves, while
real `ingest`, `worker` (echo agent) and `dispatcher` processes move chat messages through
the real broker and ledger to a webhook receiver on 127.0.0.1. One user's reply is refused
by the receiver (dead at once); the operator revives it from the page and it is delivered.
Screenshots of the overview, a timeline and the partitions go to `.run/screenshots/` (not
committed).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from console_support import XSS
from dispatcher_support import Receiver
from ingest_support import cli, create_token
from support import REPO, scalar, wait_for
from vigil_dev.devstack import free_port
from worker_support import FAST

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = REPO / ".run" / "screenshots"


@pytest.fixture
def browser():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("the console's browser tests need Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")

    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def no_alert_open(driver) -> bool:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
    except NoAlertPresentException:
        return True
    return alert is None


def shot(driver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    # The whole page, not the window: set the window to the document's height first.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(height, 600), 4000))
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path


@pytest.mark.slow
def test_operator_follows_a_message_through_the_console_and_revives_a_dead_delivery(
    spawn, vigil_env, ledger, browser, tmp_path
):
    from selenium.webdriver.common.by import By

    refuse = threading.Event()
    refuse.set()
    # bob's receiver refuses with a 400 (dead at once) until the operator has fixed it.
    receiver = Receiver(answer=lambda r: (400, {}) if r.user == "bob" and refuse.is_set() else (200, {})).start()
    try:
        for user in ("alice", "bob"):
            cli(ledger, "channels", "set", user, "--type", "webhook", "--url", receiver.url, "--json")
        token = create_token(ledger, "oncall-erin")["token"]
        ports = {n: int(vigil_env[f"VIGIL_{n.upper()}_PORT"]) for n in ("worker", "ingest", "dispatcher")}
        ports["console"] = free_port()
        spawn(["worker"], {**vigil_env, **FAST, "VIGIL_AGENT": "echo"}, name="worker").wait_healthy(ports["worker"])
        spawn(["ingest"], vigil_env, name="ingest").wait_healthy(ports["ingest"])
        dispatcher_env = {**vigil_env, "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1"}
        spawn(["dispatcher"], dispatcher_env, name="dispatcher").wait_healthy(ports["dispatcher"])
        console_env = {**vigil_env, "VIGIL_CONSOLE_PORT": str(ports["console"])}
        spawn(["console"], console_env, name="console").wait_healthy(ports["console"])

        for user, text in (("alice", "hello " + XSS), ("bob", "are you there?")):
            answer = httpx.post(
                f"http://127.0.0.1:{ports['ingest']}/v1/users/{user}/messages",
                json={"text": text},
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            assert answer.status_code == 202, answer.text
        wait_for(lambda: [r for r in receiver.got() if r.user == "alice"], 90, "alice's reply at the receiver")
        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE user_id = 'bob' AND status = 'dead'") == 1,
            90,
            "bob's delivery dead after the receiver's 400",
        )

        console = f"http://127.0.0.1:{ports['console']}"
        # Not logged in: every page sends the browser to the login form.
        browser.get(console + "/")
        assert "/login" in browser.current_url
        browser.find_element(By.NAME, "token").send_keys(token)
        browser.find_element(By.CSS_SELECTOR, "form.login button").click()
        wait_for(lambda: browser.find_elements(By.ID, "card-pending"), 15, "the overview after logging in")
        cookie = browser.get_cookie("vigil_console")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert cookie["value"] != token and "expiry" in cookie  # a session id with Max-Age, not the token
        assert "Dead in the last hour" in browser.page_source
        assert "1 messages" in browser.find_element(By.ID, "card-dead").text
        overview_png = shot(browser, "overview")

        # Search the user who got a message: straight to her timeline.
        box = browser.find_element(By.CSS_SELECTOR, "header form.search input[name=q]")
        box.send_keys("alice")
        box.submit()
        wait_for(lambda: browser.find_elements(By.ID, "timeline-user"), 15, "alice's timeline")
        assert browser.find_element(By.ID, "timeline-user").text == "alice"
        # The hostile payload is text on the page, and nothing ran.
        assert XSS in browser.find_element(By.TAG_NAME, "main").text
        assert no_alert_open(browser)
        assert browser.execute_script("return document.scripts.length") == 0
        timeline_png = shot(browser, "timeline")

        # event -> run -> delivery, by the links on the pages.
        browser.find_element(By.CSS_SELECTOR, "li.event a[href^='/events/']").click()
        wait_for(lambda: browser.find_elements(By.ID, "payload"), 15, "the event page")
        assert XSS in browser.find_element(By.ID, "payload").text and no_alert_open(browser)
        assert "chat.message" in browser.page_source
        browser.find_element(By.CSS_SELECTOR, "main a[href^='/runs/']").click()
        wait_for(lambda: "Events it took" in browser.page_source, 15, "the run page")
        browser.find_element(By.CSS_SELECTOR, "main a[href^='/deliveries/']").click()
        wait_for(lambda: browser.find_elements(By.ID, "delivery-attempts"), 15, "the delivery page")
        alice_delivery = browser.current_url.rsplit("/", 1)[1]
        assert "delivered" in browser.find_element(By.CSS_SELECTOR, "h1").text
        assert alice_delivery in {r.id for r in receiver.got() if r.user == "alice"}

        # The dead delivery: fix the receiver, revive it from the dead letters page.
        refuse.clear()
        browser.find_element(By.LINK_TEXT, "Dead letters").click()
        wait_for(lambda: "Dead deliveries" in browser.page_source, 15, "the dead letters page")
        row = browser.find_element(By.CSS_SELECTOR, "tr[id^='dead-']")
        bob_delivery = row.get_attribute("id").removeprefix("dead-")
        assert "bob" in row.text and "400" in row.text
        row.find_element(By.TAG_NAME, "button").click()
        wait_for(lambda: browser.find_elements(By.ID, "flash"), 15, "the revived delivery's page")
        assert "Revived" in browser.find_element(By.ID, "flash").text
        wait_for(
            lambda: [r for r in receiver.got() if r.user == "bob" and r.id == bob_delivery and r.bodies],
            60,
            "bob's revived delivery accepted by the receiver, under its own id",
        )

        def shows_delivered():
            browser.get(f"{console}/deliveries/{bob_delivery}")
            return "delivered" in browser.find_element(By.CSS_SELECTOR, "h1").text

        wait_for(shows_delivered, 30, "the delivery page showing it delivered", interval=0.5)
        actor = scalar(ledger, "SELECT actor FROM audit WHERE action = 'delivery.revive'")
        assert actor.startswith("oncall-erin (tok_") and actor.endswith("via console")
        assert no_alert_open(browser)

        # The partitions: every message the broker holds is recorded (lag 0 everywhere, from the
        # broker's end offsets and the ledger's positions), nothing pending.
        def caught_up():
            browser.get(f"{console}/partitions")
            lags = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#partitions td.lag")]
            return len(lags) == int(vigil_env["VIGIL_PARTITIONS"]) and set(lags) == {"0"}

        wait_for(caught_up, 30, "every partition's lag 0 on the partitions page", interval=1.0)
        assert {c.text for c in browser.find_elements(By.CSS_SELECTOR, "#partitions td.pending")} == {"0"}
        partitions_png = shot(browser, "partitions")

        # Log out: the session ends in the ledger, and the pages send the browser to log in again.
        browser.find_element(By.CSS_SELECTOR, "form.logout button").click()
        wait_for(lambda: "/login" in browser.current_url, 15, "the login form after logging out")
        assert scalar(ledger, "SELECT count(*) FROM console_sessions WHERE ended_at IS NOT NULL") == 1
        browser.get(console + "/")
        assert "/login" in browser.current_url
    finally:
        receiver.stop()
    # Keep a copy beside the test's own files too, for the report of this run.
    for png in (overview_png, timeline_png, partitions_png):
        shutil.copy(png, tmp_path / png.name)
        print(f"screenshot: {png}")

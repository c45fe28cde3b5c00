"""The dashboard in a real headless browser (Chromium and its driver from the distribution's packages,
driven by Selenium): the page loads with the run's token, its curves draw from live data, and its
controls steer the run — a live change, then stop."""
import json
import os
import shutil
import urllib.error
import urllib.request

import pytest
from test_control import start_run

from asyncrl.control.access import read_token
from asyncrl.rundir import RunDir
from asyncrl.store.ledger import Ledger, audit

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Chromium and its driver: "
                       "apt-get install chromium chromium-driver (scripts/test.sh does)"),
]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1050"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


@pytest.mark.long
def test_the_dashboard_draws_live_data_and_steers_the_run(tiny_model, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    proc, run_dir = start_run(tmp_path, tiny_model, **{"run.steps": 400})  # long enough to stop from the page
    driver = None
    try:
        url = json.loads(RunDir(run_dir).control.read_text())["url"]
        with pytest.raises(urllib.error.HTTPError) as refused:  # the page needs the token too
            urllib.request.urlopen(url + "/", timeout=10)
        assert refused.value.code == 401
        driver = browser()
        driver.get(f"{url}/?token={read_token(run_dir)}")
        wait = WebDriverWait(driver, 60, poll_frequency=0.2)
        assert driver.current_url == url + "/"  # the token went into a cookie, out of the address bar
        trained = lambda d: d.execute_script("return state.steps.length")  # noqa: E731
        first = wait.until(lambda d: trained(d) >= 2 and trained(d))
        wait.until(lambda d: trained(d) > first)  # live: new steps arrive without a reload
        drawn = driver.execute_script("return [state.charts.reward.data[0].length, "
                                      "document.querySelectorAll('.chart canvas').length]")
        assert drawn[0] > first and drawn[1] == 4
        assert "steps trained" in driver.find_element(By.ID, "where").text
        assert "trainer" in driver.find_element(By.ID, "roles").text

        Select(driver.find_element(By.ID, "key")).select_by_visible_text("trainer.lr")
        driver.find_element(By.ID, "value").send_keys("3e-5")
        driver.find_element(By.ID, "apply").click()
        wait.until(lambda d: "trainer.lr = 0.00003: recorded" in d.find_element(By.ID, "answer").text)
        wait.until(lambda d: "0.00003" in d.find_element(By.ID, "changes").text
                   and "pending" not in d.find_element(By.ID, "changes").text)
        driver.find_element(By.ID, "value").clear()
        driver.find_element(By.ID, "value").send_keys("-1")
        driver.find_element(By.ID, "apply").click()  # refused, with the reason on the page
        wait.until(lambda d: "greater than 0" in d.find_element(By.ID, "answer").text)
        if os.environ.get("ASYNCRL_DASHBOARD_SCREENSHOT"):
            driver.save_screenshot(os.environ["ASYNCRL_DASHBOARD_SCREENSHOT"])
        driver.find_element(By.ID, "stop").click()
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if driver is not None:
            driver.quit()
        proc.kill()
    lr, stop = Ledger(run_dir).changes()
    assert (lr["key"], lr["value"], stop["key"]) == ("trainer.lr", 3e-5, "run.steps")
    end = stop["value"]
    report = audit(run_dir, 1)
    assert end < 400 and report["problems"] == [] and report["steps"] == report["steps_committed"] == end

"""The built site in headless Chromium: pages render without console errors, search finds QLoRA, screenshots saved
in docs/screenshots/ (git-ignored); skipped without Chromium, failed instead under WGPU_TRAIN_REQUIRE_BROWSER=1."""
from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "docs" / "screenshots"
PAGES = {"home": ("", "wgpu-train"), "guide": ("guides/qlora-memory/", "QLoRA and memory"),
         "cli-reference": ("reference/cli/", "Command-line reference")}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):     # noqa: A002 - argparse's name; the test's output stays readable
        pass


def _missing() -> list[str]:
    missing = [tool for tool in ("chromium", "chromedriver") if not shutil.which(tool)]
    return missing + [module for module in ("mkdocs", "selenium") if importlib.util.find_spec(module) is None]


@pytest.fixture(scope="module")
def site_url(tmp_path_factory):
    """The site built from this checkout, served on 127.0.0.1 for the module's tests."""
    missing = _missing()
    if missing:
        reason = f"needs {', '.join(missing)} (apt-get install chromium chromium-driver; pip install -e '.[docs]')"
        if os.environ.get("WGPU_TRAIN_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + " and WGPU_TRAIN_REQUIRE_BROWSER=1")
        pytest.skip(reason)
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                   cwd=REPO, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser(site_url):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(120)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.mark.parametrize("name", PAGES)
def test_page_renders_without_console_errors(browser, site_url, name):
    from selenium.webdriver.common.by import By

    path, title = PAGES[name]
    browser.get(site_url + path)
    heading = browser.find_element(By.CSS_SELECTOR, "article h1").text
    shot = SCREENSHOTS / f"{name}.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert title in heading
    assert browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary"), "no sidebar navigation"
    assert console_errors(browser) == []


def test_search_finds_qlora(browser, site_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site_url)
    box = WebDriverWait(browser, 30).until(ready.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.click()
    box.send_keys("QLoRA")
    results = WebDriverWait(browser, 60).until(
        lambda driver: driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    shot = SCREENSHOTS / "search-qlora.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    links = [item.find_element(By.TAG_NAME, "a").get_attribute("href") for item in results]
    assert any("guides/qlora-memory/" in link for link in links), links
    assert console_errors(browser) == []

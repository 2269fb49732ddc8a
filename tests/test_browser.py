"""Real-browser smoke test: the README's run command serves the app on localhost; headless
Chromium opens every page, waits for its charts, runs a small evaluation and saves a
screenshot per page under artifacts/screenshots/."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = ROOT / "artifacts" / "screenshots"
PAGES = [("Model & data", 0), ("Softmax explorer", 4), ("LayerNorm explorer", 3), ("Massive activations", 0),
         ("Quantizer lab", 2),
         ("Evaluate", 0), ("Export", 0)]

if not CHROMIUM and not os.environ.get("CI"):
    pytest.skip("Chromium is not installed (CI installs it: apt-get install chromium)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    # the digits model keeps this walk fast; the real-ViT default is covered by tests/pages
    env = {**os.environ, "VIZQ_HOME": str(tmp_path_factory.mktemp("home")), "VIZQ_DASHBOARD_MODEL": "vizq-vit-tiny"}
    proc = subprocess.Popen([str(ROOT / "run.sh"), "--server.port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        pytest.fail("the dashboard did not start: " + proc.stdout.read().decode(errors="replace")[-2000:])
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=20)


def test_server_binds_to_localhost_only(server):
    port = int(server.rsplit(":", 1)[1])
    ips = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None) if a[0] == socket.AF_INET} - {"127.0.0.1"}
    for ip in ips:
        with socket.socket() as s:
            s.settimeout(1)
            assert s.connect_ex((ip, port)) != 0, f"reachable on {ip}"


def test_every_page_in_a_real_browser(server):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "CI must install Chromium"
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):  # this test's own screenshots from an earlier run
        old.unlink()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(120_000)  # a loaded 2-core CI machine can take over 30 s to redraw a page
        page.goto(server, wait_until="networkidle")
        page.get_by_role("heading", name="Model & data").first.wait_for(timeout=120_000)
        # the first page is open: wait for its capture (a click now would rerun it and start the capture again)
        page.get_by_text("Captured", exact=False).first.wait_for(timeout=120_000)
        for i, (title, charts) in enumerate(PAGES):
            if i:
                page.get_by_role("link", name=title).first.click()
            page.get_by_role("heading", name=title).first.wait_for(timeout=120_000)
            if charts:
                page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {charts}", timeout=120_000)
            if title == "Massive activations":  # the scan runs on arrival; shoot its result, not "Scanning…"
                page.get_by_text("sites with massive values").first.wait_for(timeout=120_000)
            if title == "Evaluate":
                box = page.get_by_label("Evaluation images (disjoint from calibration)")
                box.fill("100")
                box.press("Enter")  # a short run: this walk checks the page, not the numbers
                page.get_by_text("evaluate on 100 of the").first.wait_for(timeout=60_000)
                page.get_by_role("button", name="Run evaluation").click()
                page.get_by_text("agreement", exact=False).first.wait_for(timeout=180_000)
                page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 1", timeout=60_000)
            page.wait_for_timeout(800)
            assert page.locator("[data-testid='stException']").count() == 0, title
            page.screenshot(path=str(SHOTS / f"{i + 1}_{title.split()[0].lower().replace('&', '')}.png"), full_page=True)
        browser.close()
    assert len(list(SHOTS.glob("*.png"))) == len(PAGES)


def _browser(p):
    return p.chromium.launch(executable_path=CHROMIUM, headless=True,
                             args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                   "--disable-component-update", "--disable-sync", "--no-first-run"])


def test_three_uploaded_images_are_what_evaluate_uses_and_nothing_leaves_the_machine(server, tmp_path):
    """Upload 3 photographs on Model & data, evaluate: the result names the 3 uploads and says
    there are no labels (before the service layer it reported the bundled digits). Every
    request the page makes goes to the dashboard itself."""
    import numpy as np
    from PIL import Image
    from playwright.sync_api import sync_playwright

    rng = np.random.default_rng(0)
    files = []
    for i in range(3):
        f = tmp_path / f"photo{i}.png"
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(f)
        files.append(str(f))
    host = server.split("//", 1)[1]
    outside: list[str] = []
    with sync_playwright() as p:
        browser = _browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(120_000)
        page.on("request", lambda r: None if r.url.split("//", 1)[-1].startswith(host) or r.url.startswith(("data:", "blob:"))
                else outside.append(r.url))
        page.goto(server, wait_until="networkidle")
        page.get_by_role("heading", name="Model & data").first.wait_for(timeout=120_000)
        page.get_by_text("Upload images", exact=True).click()
        page.locator("input[type='file']").nth(1).set_input_files(files)
        page.wait_for_timeout(1500)
        page.get_by_role("button", name="Use this data").click()
        page.get_by_text("3 uploaded file(s)").first.wait_for(timeout=60_000)  # the sidebar, after the rerun
        page.get_by_role("link", name="Evaluate").first.click()
        page.get_by_role("heading", name="Evaluate").first.wait_for(timeout=60_000)
        page.get_by_role("button", name="Run evaluation").click()
        result = page.locator("[data-testid='stAlertContentSuccess']").first
        result.wait_for(timeout=180_000)
        text = result.inner_text()
        page.screenshot(path=str(tmp_path / "upload-eval.png"), full_page=True)
        browser.close()
    assert "3 uploaded file(s)" in text and "no labels" in text, text
    assert "calibrated on 1 image, evaluated on 2 images" in text, text
    assert outside == [], outside[:5]

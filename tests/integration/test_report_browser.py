"""The run report in a real browser: headless Chromium loads index.html from disk, every
plot decodes, and a screenshot shows the page.

Needs Debian's `chromium` package (`apt-get install -y chromium`); skipped without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvswap.cli import main
from kvswap.obs.plots import PLOT_FILES
from tests.unit.obs_fakes import TINY_CLI_ARGS, one_torch_thread

CHROMIUM = os.environ.get("KVSWAP_CHROMIUM", "/usr/bin/chromium")
WINDOW = (1400, 2400)

pytestmark = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason=f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)",
)


def chromium(profile: Path, *args: str) -> str:
    """Run headless Chromium offline (no network services, no sandbox in containers)."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def report_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    with one_torch_thread():
        assert main(["run", *TINY_CLI_ARGS, "--quiet", "--report", str(out)]) == 0
    return out / "index.html"


def test_every_plot_loads_in_chromium(report_page: Path, tmp_path: Path) -> None:
    # The page's inline script marks <body> once every <img> has decoded (naturalWidth > 0).
    dom = chromium(
        tmp_path / "profile", "--virtual-time-budget=10000", "--dump-dom", report_page.as_uri()
    )
    images = re.findall(r'<img src="([^"]+)"', dom)
    assert sorted(images) == sorted(PLOT_FILES.values())
    assert f'data-images-loaded="{len(images)}/{len(images)}"' in dom
    assert 'data-all-images-loaded="true"' in dom
    assert "Diagnosis" in dom and "Configuration" in dom and "token latency (ms)" in dom


def test_the_page_renders_to_a_screenshot(report_page: Path, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "report.png"
    chromium(
        tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--virtual-time-budget=10000", report_page.as_uri(),
    )  # fmt: skip
    with Image.open(shot) as image:
        assert image.size == WINDOW
        # A rendered page with plots has many colours; a blank or error page has a few.
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 200

"""The built documentation site, read as a student's browser reads it.

``make test`` runs this module after ``make docs-check`` has built the site
into ``docs/_build/check`` (``SITE_DIR`` selects another build, for example
``docs/_build/html`` after ``make docs``); without a build every test here
skips and says so.  Every test is marked ``site``.

Without a browser:

* every page's ``<title>`` (the browser tab) is free of raw LaTeX;
* MathJax is served by the site itself, and no page loads a script from
  another host;
* every lesson page has a download link to its own notebook, which exists,
  and states its run time.

With Chromium and its driver from the system packages (``.ci/run`` installs
them where it can; otherwise the browser tests skip and print why), driven by
Selenium, headless, with every host name but the local server's unresolvable
(so nothing can come from a network), over the site served by a local HTTP
server, on one derivation page, one lesson page and the course page:

* the math rendered: MathJax's output elements are present, and no raw
  ``\\(``, ``\\[`` or ``$$`` is left in the visible text;
* every figure loaded (``complete`` with a nonzero natural width), and the
  lesson page and the course page have at least one;
* the navigation works: every link of the sidebar and the previous/next
  links answer 200 from the server, and following "next" in the browser lands
  on the page it names.

Each page's screenshot is saved in ``<build>/_screenshots/``.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

try:
    from selenium.webdriver.support.wait import WebDriverWait
except ImportError:  # the browser fixture skips with the reason
    WebDriverWait = None

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SITE_DIR", ROOT / "docs" / "_build" / "check")).resolve()
LESSONS = sorted(p.stem for p in (ROOT / "tutorials").glob("[0-9][0-9]_*.ipynb"))
PAGES = {"derivation": "derivations/gma.html", "lesson": "tutorials/02_gma.html", "course": "course.html"}

pytestmark = [
    pytest.mark.site,
    pytest.mark.skipif(not (SITE / "index.html").exists(),
                       reason=f"no built site in {SITE}: run `make docs-check` (make test does) or set SITE_DIR"),
]


def _pages() -> list[Path]:
    return sorted(p for p in SITE.rglob("*.html") if "_static" not in p.parts and "_modules" not in p.parts)


class _Head(HTMLParser):
    """The document's <title> (the first one: icons inside <svg> have their own) and its <script src=...>."""

    def __init__(self):
        super().__init__()
        self.title, self.scripts, self.links = None, [], []
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "title" and self.title is None:
            self._in_title, self.title = True, ""
        elif tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])
        elif tag == "a" and attrs.get("href"):
            self.links.append((attrs.get("class", ""), attrs["href"]))

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _parse(page: Path) -> _Head:
    head = _Head()
    head.feed(page.read_text(encoding="utf-8"))
    return head


RAW_TEX = re.compile(r"\\\(|\\\[|\$|\\[a-zA-Z]+")


def test_the_pattern_of_raw_latex_finds_it():
    assert RAW_TEX.search(r"a rank-\(K\) affinity") and RAW_TEX.search("bounds for $x$")
    assert RAW_TEX.search(r"\gamma") and not RAW_TEX.search("Lesson 2: Gaussian Mixture Attention")


def test_browser_tab_titles_show_no_raw_latex():
    bad = [f"{p.relative_to(SITE)}: {_parse(p).title!r}" for p in _pages() if RAW_TEX.search(_parse(p).title or "")]
    assert not bad, "page titles with raw LaTeX (take the math out of the page's first heading):\n" + "\n".join(bad)


def test_mathjax_comes_from_the_site_and_no_script_from_elsewhere():
    bundle = SITE / "_static" / "mathjax" / "tex-chtml.js"
    assert bundle.is_file(), f"{bundle} is missing: MathJax would not load offline"
    for page in (SITE / p for p in PAGES.values()):
        scripts = _parse(page).scripts
        assert any(re.search(r"(^|/)_static/mathjax/tex-chtml\.js", s) for s in scripts), (page, scripts)
        remote = [s for s in scripts if re.match(r"^(https?:)?//", s)]
        assert not remote, f"{page.relative_to(SITE)} loads scripts from the network: {remote}"


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_page_offers_its_notebook_and_states_its_run_time(lesson):
    page = SITE / "tutorials" / f"{lesson}.html"
    downloads = [href for cls, href in _parse(page).links if "download" in cls.split()]
    ours = [h for h in downloads if h.endswith(f"/{lesson}.ipynb")]
    assert ours, f"{page.name} has no download link to {lesson}.ipynb (found {downloads})"
    assert (page.parent / ours[0]).resolve().is_file(), f"{ours[0]} is not in the build"
    assert "Run time:" in page.read_text(encoding="utf-8"), f"{page.name} does not state its run time"


# --- in a real browser ---------------------------------------------------------------------------------------
def _browser_paths() -> tuple[str | None, str | None]:
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    return browser, driver


@pytest.fixture(scope="module")
def server():
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the browser closing a connection early (it has what it needs) is no error of the site


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = _browser_paths()
    if chromium is None or chromedriver is None:
        reason = ("no Chromium and chromedriver on PATH (Debian/Ubuntu: apt-get install chromium chromium-driver; "
                  ".ci/run installs them when it runs as root)")
        print(f"browser tests skipped: {reason}")
        pytest.skip(reason)
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,2000",
                # no host name resolves but the local server's: a page that needs the network shows it here
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def _open(browser, url: str, name: str):
    browser.get(url)
    # MathJax typesets after the load event; its startup promise resolves when the page is done
    state = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) { done('no MathJax'); return; }"
        "MathJax.startup.promise.then(() => done('ok')).catch(e => done('error: ' + e));"
    )
    shots = SITE / "_screenshots"
    shots.mkdir(exist_ok=True)
    browser.save_screenshot(str(shots / f"{name}.png"))
    return state


@pytest.mark.parametrize("name", list(PAGES))
def test_the_math_renders_in_a_browser(browser, server, name):
    state = _open(browser, server + PAGES[name], name)
    assert state == "ok", f"{PAGES[name]}: MathJax did not finish: {state}"
    # Sphinx marks every formula with class "math"; MathJax puts its output in an mjx-container inside it
    formulas, unrendered = browser.execute_script(
        "const m = Array.from(document.querySelectorAll('article .math'));"
        "return [m.length, m.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 80))];")
    assert formulas > 0, f"{PAGES[name]} has no math to render"
    assert not unrendered, f"{PAGES[name]}: {len(unrendered)} of {formulas} formulas not rendered: {unrendered[:5]}"
    text = browser.execute_script("return document.querySelector('article').innerText")
    raw = re.findall(r"\\\(|\\\[|\$\$", text)
    assert not raw, f"{PAGES[name]}: raw LaTeX left in the text: {raw[:5]}"


@pytest.mark.parametrize("name", list(PAGES))
def test_the_figures_load_in_a_browser(browser, server, name):
    _open(browser, server + PAGES[name], name)
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('article img'))"
        ".map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
    broken = [src for src, complete, width in images if not (complete and width > 0)]
    assert not broken, f"{PAGES[name]}: figures that did not load: {broken}"
    if name in ("lesson", "course"):
        assert images, (f"{PAGES[name]} shows no figure: for a lesson page, run the notebook tests first "
                        "(they save the executed notebooks that make docs-check shows)")


@pytest.mark.parametrize("name", list(PAGES))
def test_the_navigation_works_in_a_browser(browser, server, name):
    _open(browser, server + PAGES[name], name)
    hrefs = browser.execute_script(
        "return Array.from(document.querySelectorAll('.sidebar-tree a.reference, a.next-page, a.prev-page'))"
        ".map(a => a.href)")
    assert len(hrefs) > 10, f"{PAGES[name]}: only {len(hrefs)} navigation links"
    for href in sorted(set(h.split("#")[0] for h in hrefs)):
        assert href.startswith(server), f"{PAGES[name]}: navigation leaves the site: {href}"
        try:
            status = urllib.request.urlopen(href, timeout=30).status
        except urllib.error.HTTPError as err:
            status = err.code
        assert status == 200, f"{PAGES[name]}: {href} answers {status}"
    following = browser.execute_script(
        "const a = document.querySelector('a.next-page'); if (!a) return null;"
        "return [a.href, a.querySelector('.title').innerText];")
    assert following, f"{PAGES[name]} has no 'next' link"
    href, expected = following
    # a click as a reader makes it (the element's own click: the theme's floating buttons may cover its centre)
    browser.execute_script("document.querySelector('a.next-page').click()")
    WebDriverWait(browser, 30).until(lambda b: b.current_url.split("#")[0] == href.split("#")[0])
    heading = browser.execute_script("return document.querySelector('article h1').innerText")
    assert heading.replace("#", "").strip() == expected.strip(), (heading, expected)

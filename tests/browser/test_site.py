"""The course's website as a reader uses it, in headless Chromium (README, "The course as a
website"):

    python -m pytest tests/browser -p no:xdist

Both editions: the English site and the Chinese one in ``zh/`` (the page checks run on each,
parametrised by ``edition``), the language switch between them, and the Chinese search.
The site is built here, from the stored notebooks, with the network cut off (a new network
namespace, ``unshare -n``), into a temporary folder, and served on 127.0.0.1 (a free port) by a
server thread of this process, shut down whatever happens. Every request the pages make to any
other host is refused and counted as a failure: the site must read with no network at all.
Screenshots land in tests/artifacts/ (site-*.png).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

from helpers import ARTIFACTS, ROOT

BUILD_LIMIT_S = 300  # measured: about 10 s on the 2-core CI machine; both editions: 45-85 s here
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}  # an iPhone 12-14's CSS viewport
EDITIONS = ["en", "zh"]
ROOTS = {"en": "", "zh": "zh/"}  # where each edition lies in the site


def _network_cutter() -> list[str] | None:
    """The command prefix that runs a program in a new network namespace (loopback only):
    ``unshare -n`` as root, ``unshare -rn`` (a user namespace) otherwise; None where neither
    works here (then the offline build is skipped with the reason)."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


class BuiltSite:
    def __init__(self, out: Path, log: str, offline: list[str] | None, seconds: float):
        self.out, self.log, self.offline, self.seconds = out, log, offline, seconds


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> BuiltSite:
    """README's site command, run with the network cut off, into a temporary folder."""
    base = tmp_path_factory.mktemp("site")
    out = base / "_site"
    offline = _network_cutter()
    cmd = (offline or []) + [sys.executable, str(ROOT / "website" / "build.py"),
                             "--out", str(out), "--work", str(base / "work")]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_LIMIT_S, cwd=ROOT)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, f"the site build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return BuiltSite(out, proc.stdout + proc.stderr, offline, seconds)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test reports what matters; no line per request
        pass


@pytest.fixture(scope="module")
def site_url(built_site):
    """The built site over HTTP on 127.0.0.1 (port chosen by the OS when binding: no race)."""
    handler = functools.partial(_Quiet, directory=str(built_site.out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class Reader:
    """A browser context with everything that goes wrong recorded: console errors, uncaught
    page errors, failed requests, HTTP errors, and any request to a host other than ours
    (refused)."""

    def __init__(self, browser, base: str, viewport: dict):
        self.base = base
        self.problems: list[str] = []
        self.context = browser.new_context(viewport=viewport)
        self.context.set_default_timeout(30_000)
        host = urlsplit(base).netloc
        def route(r):
            url = r.request.url
            if urlsplit(url).netloc == host:
                r.continue_()
            else:
                self.problems.append(f"request to another host: {url}")
                r.abort()
        self.context.route("**/*", route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(
            f"console error: {m.text} ({m.location.get('url', '')})"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        # ERR_ABORTED is a request the browser itself dropped because the page was left (the
        # favicon of a page the test has already moved on from); a missing file is an HTTP 404,
        # recorded below, and a request elsewhere is refused and recorded above.
        self.page.on("requestfailed", lambda r: "ERR_ABORTED" not in (r.failure or "") and
                     self.problems.append(f"request failed: {r.url} ({r.failure})"))
        self.page.on("response", lambda r: r.status >= 400 and self.problems.append(
            f"HTTP {r.status}: {r.url}"))

    def open(self, path: str) -> None:
        self.page.goto(urljoin(self.base, path), wait_until="load", timeout=30_000)

    def path(self) -> str:
        return urlsplit(self.page.url).path.lstrip("/")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def reader(browser, site_url):
    r = Reader(browser, site_url, DESKTOP)
    try:
        yield r
    finally:
        r.close()


def shot(page, name: str, full_page: bool = False) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)


def _notebook(path: str, edition: str = "en") -> dict:
    """A page's notebook: the English one, or the Chinese one (zh/ + the same path)."""
    return json.loads((ROOT / ROOTS[edition] / path).read_text())


def _lesson(number: str, edition: str = "en") -> str:
    """lessons/NN_*.ipynb, relative to the root (the page's path in either edition); a test of
    the Chinese edition is skipped while that lesson has no Chinese notebook yet."""
    found = sorted((ROOT / "lessons").glob(f"{number}_*.ipynb"))
    assert found, f"no lesson {number}"
    path = found[0].relative_to(ROOT).as_posix()
    if not (ROOT / ROOTS[edition] / path).exists():
        pytest.skip(f"no Chinese notebook for {path} yet")
    return path


def _html(notebook: str, edition: str = "en") -> str:
    """The page of a notebook in the built site, relative to the site's root."""
    return ROOTS[edition] + notebook.removesuffix(".ipynb") + ".html"


def _pages(out: Path, edition: str) -> list[str]:
    """The pages of one edition, relative to the site's root (not the theme's template
    fragments copied into _static/, nor the other edition)."""
    root = out / ROOTS[edition]
    pages = []
    for p in root.rglob("*.html"):
        rel = p.relative_to(root)
        if any(part.startswith("_") for part in rel.parts) or (edition == "en" and rel.parts[0] == "zh"):
            continue
        pages.append(ROOTS[edition] + rel.as_posix())
    return sorted(pages)


def _folded(cell: dict) -> bool:
    hidden = cell.get("metadata", {}).get("jupyter", {})
    return bool(hidden.get("source_hidden") or hidden.get("outputs_hidden"))


def _texts(cell: dict, mime: str) -> list[str]:
    found = []
    for out in cell.get("outputs", []):
        if mime == "stdout" and out.get("output_type") == "stream" and out.get("name") == "stdout":
            text = out["text"]
        else:
            text = out.get("data", {}).get(mime, "")
        found.append("".join(text) if isinstance(text, list) else text)
    return [t for t in found if t]


def _claims(nb: dict) -> list[str]:
    """The ✔ lines the lesson printed outside folded cells (what a reader sees unclicked)."""
    return [line.strip() for cell in nb["cells"] if not _folded(cell)
            for text in _texts(cell, "stdout") for line in text.splitlines()
            if line.strip().startswith("✔")]


def _captions(nb: dict, cell: dict | None = None) -> list[str]:
    cells = [cell] if cell else [c for c in nb["cells"] if not _folded(c)]
    return [t.strip("*\n ") for c in cells for t in _texts(c, "text/markdown")
            if t.startswith("*Figure")]


def _images_decoded(page, limit_ms: int = 20_000) -> list[str]:
    """Load every image (lazy ones too) and return the sources of those not decoded."""
    page.evaluate("() => document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; })")
    try:
        page.wait_for_function("() => [...document.images].every(i => i.complete)",
                               timeout=limit_ms)
    except Exception:  # noqa: BLE001 — reported below as the images that did not decode
        pass
    return page.evaluate("() => [...document.images].filter(i => !(i.complete && "
                         "i.naturalWidth > 0)).map(i => i.currentSrc || i.src)")


# ---------------------------------------------------------------------------------------------


def test_the_site_builds_with_the_network_cut_off(built_site):
    if built_site.offline is None:
        pytest.skip("cannot cut the network here (neither `unshare -n` nor `unshare -rn` "
                    "works): the site was built with the network on")
    assert (built_site.out / "index.html").exists()
    assert (built_site.out / "zh" / "index.html").exists()  # the Chinese edition
    assert '<html lang="zh-CN"' in (built_site.out / "zh" / "index.html").read_text()
    # nothing is written beside the output folder (in README's build: the repository's root)
    assert sorted(p.name for p in built_site.out.parent.iterdir()) == ["_site", "work"]
    assert "site:" in built_site.log, built_site.log[-2000:]
    assert "jieba" not in built_site.log, built_site.log[-2000:]  # installed, and quiet
    html = "\n".join((built_site.out / page).read_text()
                     for edition in EDITIONS for page in _pages(built_site.out, edition))
    # every link between the editions was made relative (build.py's relink)
    assert "dpcourse.invalid" not in html
    # nothing a page loads comes from elsewhere, and no placeholder is left for the address
    assert not re.search(r"""<(?:script|img|link)[^>]+(?:src|href)=["'](?:https?:)?//""",
                         html.replace('rel="canonical"', "")), "a page loads a remote file"
    assert "<owner>" not in html and "{repo" not in html
    print(f"built offline in {built_site.seconds:.1f} s")


@pytest.mark.parametrize("edition", EDITIONS)
def test_every_page_loads_without_an_error_a_broken_link_or_an_undecoded_image(built_site,
                                                                                reader, edition):
    # the pages, not the theme's template fragments copied into _static/
    pages = _pages(built_site.out, edition)
    assert len(pages) >= 30, pages
    ids_of: dict[str, set[str]] = {}

    def ids(rel: str) -> set[str]:
        if rel not in ids_of:
            text = (built_site.out / rel).read_text()
            ids_of[rel] = set(re.findall(r'\bid="([^"]+)"', text))
        return ids_of[rel]

    broken, undecoded = [], []
    for rel in pages:
        reader.open(rel)
        undecoded += [f"{rel}: {src}" for src in _images_decoded(reader.page)]
        for href in reader.page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)"):
            parts = urlsplit(href)
            if parts.scheme not in ("http", "https") or parts.netloc != urlsplit(reader.base).netloc:
                continue
            target = unquote(parts.path).lstrip("/") or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if not (built_site.out / target).is_file():
                broken.append(f"{rel} -> {href}")
            elif parts.fragment and target.endswith(".html") and \
                    unquote(parts.fragment) not in ids(target):
                broken.append(f"{rel} -> {href} (no such anchor)")
    assert not reader.problems, "\n".join(reader.problems[:30])
    assert not broken, "\n".join(broken[:30])
    assert not undecoded, "\n".join(undecoded[:30])


@pytest.mark.parametrize("edition", EDITIONS)
def test_lesson_06_shows_the_ring_stepper_figure_and_the_claims(reader, edition):
    notebook = _lesson("06", edition)
    nb = _notebook(notebook, edition)
    reader.open(_html(notebook, edition))
    text = reader.page.inner_text("main")
    # every ✔ claim line the lesson printed is on the page
    claims = _claims(nb)
    assert claims
    missing = [c for c in claims if c not in text]
    assert not missing, missing
    # the stepper's place holds its one-line fallback and the static figure of every step
    cell = next(c for c in nb["cells"] for o in c.get("outputs", [])
                if "stepper" in json.dumps(o.get("data", {}).get("text/plain", "")).lower()
                and any("image/png" in p.get("data", {}) for p in c["outputs"]))
    fallback = next(t for t in _texts(cell, "text/plain") if "stepper" in t.lower())
    output = reader.page.locator("div.cell_output", has_text=fallback[:40]).first
    output.scroll_into_view_if_needed()
    image = output.locator("img").first
    image.wait_for(state="visible", timeout=10_000)
    assert image.evaluate("i => i.complete && i.naturalWidth > 0")
    for caption in _captions(nb, cell):
        assert caption[:60] in output.inner_text(), caption
    shot(reader.page, f"site-{edition}-lesson06-stepper-figure")
    # the check-yourself questions are readable, their answers folded until clicked
    answers = reader.page.locator("details", has=reader.page.locator(
        "summary", has_text=re.compile("Answers|答案"))).last
    assert not answers.evaluate("d => d.open")
    answers.locator("summary").first.click()
    assert answers.evaluate("d => d.open")
    reader.open(_html(notebook, edition))
    shot(reader.page, f"site-{edition}-lesson06")
    assert not reader.problems, "\n".join(reader.problems)


@pytest.mark.parametrize("edition", EDITIONS)
def test_lesson_08_shows_its_zero_memory_figures(reader, edition):
    notebook = _lesson("08", edition)
    nb = _notebook(notebook, edition)
    reader.open(_html(notebook, edition))
    pngs = sum("image/png" in out.get("data", {}) for cell in nb["cells"]
               for out in cell.get("outputs", []))
    images = reader.page.locator("div.cell_output img")
    assert pngs >= 2 and images.count() == pngs, (pngs, images.count())
    assert _images_decoded(reader.page) == []
    text = reader.page.inner_text("main")
    captions = _captions(nb)  # those outside folded cells, which a reader sees unclicked
    assert any("ZeRO" in c for c in captions), captions
    for caption in captions:
        assert caption[:60] in text, caption
    figure = reader.page.locator("div.cell_output", has_text="ZeRO").locator("img").first
    figure.scroll_into_view_if_needed()
    shot(reader.page, f"site-{edition}-lesson08-zero-figure")
    assert not reader.problems, "\n".join(reader.problems)


@pytest.mark.parametrize("edition", EDITIONS)
def test_a_folded_reference_answer_opens_on_click(reader, edition):
    lessons = sorted((ROOT / ROOTS[edition] / "lessons").glob("*.ipynb"))
    folded = [p.relative_to(p.parents[1]).as_posix() for p in lessons
              if any(c.get("metadata", {}).get("jupyter", {}).get("source_hidden")
                     for c in json.loads(p.read_text())["cells"])]
    assert folded, "no lesson has a folded cell"
    reader.open(_html(folded[0], edition))
    block = reader.page.locator("details.hide").first
    code = block.locator("div.cell_input").first
    assert not block.evaluate("d => d.open") and not code.is_visible()
    block.locator("summary").first.click()
    code.wait_for(state="visible", timeout=10_000)
    assert block.evaluate("d => d.open")
    shot(reader.page, f"site-{edition}-folded-answer-opened")
    assert not reader.problems, "\n".join(reader.problems)


def test_search_for_set_epoch_lists_the_lessons_that_use_it(reader):
    expected = [_html(p.relative_to(ROOT).as_posix())
                for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
                if "set_epoch" in p.read_text()]
    assert _html(_lesson("03")) in expected, expected
    reader.open("search.html?q=set_epoch")
    results = reader.page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=30_000)
    # the result list fills in as the index is searched: wait until it says it is done
    reader.page.wait_for_function(
        "() => { const p = document.querySelector('#search-results p.search-summary');"
        " return p && /found|did not match/i.test(p.textContent); }", timeout=30_000)
    found = {urlsplit(h).path.lstrip("/") for h in
             results.evaluate_all("as => as.map(a => a.href)")}
    missing = [page for page in expected if page not in found]
    assert not missing, (missing, sorted(found))
    shot(reader.page, "site-search-set_epoch")
    assert not reader.problems, "\n".join(reader.problems)


@pytest.mark.parametrize("edition", EDITIONS)
def test_next_walks_the_course_in_order_from_lesson_00_to_lesson_10(reader, edition):
    base = ROOT / ROOTS[edition]  # the Chinese walk: the pages with a Chinese notebook
    lessons = [_html(p.relative_to(base).as_posix(), edition)
               for p in sorted((base / "lessons").glob("[0-9][0-9]_*.ipynb"))]
    labs = {p.name[3:5]: _html(p.relative_to(base).as_posix(), edition)
            for p in sorted((base / "labs").glob("lab[0-9][0-9]_*.ipynb"))}
    reader.open(lessons[0])
    walked = [reader.path()]
    for _ in range(len(lessons) + len(labs) + 5):  # bounded: the course's pages and a margin
        if reader.path() == lessons[-1]:
            break
        nxt = reader.page.locator("a.right-next").first
        nxt.click()
        reader.page.wait_for_url(lambda url: urlsplit(url).path.lstrip("/") != walked[-1],
                                 timeout=15_000)
        walked.append(reader.path())
        # and previous leads back
    assert walked[-1] == lessons[-1], walked
    root = ROOTS[edition]
    assert [p for p in walked if p.startswith(f"{root}lessons/")] == lessons, walked
    for page in walked:  # each lab right after its lesson
        if page.startswith(f"{root}labs/"):
            number = page[len(root) + 8:len(root) + 10]
            assert walked[walked.index(page) - 1].startswith(f"{root}lessons/{number}_"), walked
    # previous goes back one page at a time
    reader.page.locator("a.left-prev").first.click()
    reader.page.wait_for_url(lambda url: urlsplit(url).path.lstrip("/") == walked[-2],
                             timeout=15_000)
    assert not reader.problems, "\n".join(reader.problems)


@pytest.mark.parametrize("edition", EDITIONS)
def test_pages_read_on_a_phone_without_horizontal_scrolling(browser, site_url, edition):
    phone = Reader(browser, site_url, PHONE)
    try:
        for path in [ROOTS[edition] + "index.html", _html(_lesson("03", edition), edition),
                     _html(_lesson("06", edition), edition), _html(_lesson("08", edition), edition)]:
            phone.open(path)
            wide = phone.page.evaluate(
                "() => ({page: document.documentElement.scrollWidth, view: window.innerWidth,"
                # the prose: paragraphs and list items of the article (a wide table or code
                # block scrolls inside its own box, which is how it reads on a phone)
                " prose: [...document.querySelectorAll('article p, article li')].filter(p =>"
                "   !p.closest('table, pre, .highlight') && p.offsetParent !== null &&"
                "   p.getBoundingClientRect().right > window.innerWidth + 1)"
                "   .map(p => p.textContent.slice(0, 60))})")
            assert wide["page"] <= wide["view"] + 1 and wide["prose"] == [], (path, wide)
            # the language switch is there on a phone too, near the top
            switch = phone.page.locator("a.dpcourse-language").first
            assert switch.is_visible() and switch.bounding_box()["y"] < 120, path
            if path.endswith("index.html"):
                shot(phone.page, f"site-{edition}-home-phone")
        assert not phone.problems, "\n".join(phone.problems)
    finally:
        phone.close()


@pytest.mark.parametrize("edition", EDITIONS)
def test_home_page_screenshots_and_the_run_links(reader, built_site, edition):
    import tomllib
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    reader.open(ROOTS[edition] + "index.html")
    assert reader.page.locator("nav.bd-docs-nav a", has_text="Lesson 03").count() \
        or reader.page.locator("nav.bd-docs-nav a").count() >= 30
    shot(reader.page, f"site-{edition}-home")
    notebook = _lesson("03", edition)
    reader.open(_html(notebook, edition))
    box = reader.page.locator(".dpcourse-run").first
    assert ("运行本页" if edition == "zh" else "Run this page") in box.inner_text()
    owner_repo = repo.removeprefix("https://github.com/")
    opened = ROOTS[edition] + notebook  # a Chinese page opens the Chinese notebook
    hrefs = box.locator("a").evaluate_all("as => as.map(a => a.href)")
    assert any(h.startswith(f"https://mybinder.org/v2/gh/{owner_repo}/") and h.endswith(opened)
               for h in hrefs), hrefs
    assert any(h == f"https://colab.research.google.com/github/{owner_repo}/blob/main/{opened}"
               for h in hrefs), hrefs
    shot(reader.page, f"site-{edition}-lesson03")
    box.scroll_into_view_if_needed()
    shot(reader.page, f"site-{edition}-lesson03-run-box")
    assert not reader.problems, "\n".join(reader.problems)


def _switch(reader) -> None:
    """Click the language switch at the top of the page and wait for the other page."""
    before = reader.page.url
    switch = reader.page.locator("a.dpcourse-language").first
    assert switch.is_visible() and switch.bounding_box()["y"] < 150, "no switch near the top"
    switch.click()
    reader.page.wait_for_url(lambda url: url != before, timeout=15_000)
    reader.page.wait_for_load_state("load")


def test_the_language_switch_goes_to_the_same_page_and_back(reader):
    lesson = _lesson("03", "zh")
    pages = [_html(lesson), "index.html"]
    lab = sorted((ROOT / "zh" / "labs").glob("lab*.ipynb"))
    if lab:
        pages.append(_html(lab[0].relative_to(ROOT / "zh").as_posix()))
    for page in pages:
        reader.open(page)
        assert reader.page.locator("a.dpcourse-language").inner_text().strip() == "中文"
        _switch(reader)
        assert reader.path() == "zh/" + page, (page, reader.path())
        assert reader.page.evaluate("document.documentElement.lang") == "zh-CN"
        assert re.search(r"[\u4e00-\u9fff]", reader.page.locator("main h1").first.inner_text())
        if page == pages[0]:
            shot(reader.page, "site-switched-to-zh")
        assert reader.page.locator("a.dpcourse-language").inner_text().strip() == "English"
        _switch(reader)
        assert reader.path() == page, (page, reader.path())
        assert reader.page.evaluate("document.documentElement.lang") == "en"
    # a page the Chinese edition does not have: its switch leads to the Chinese home page
    reader.open("ARCHITECTURE.html")
    _switch(reader)
    assert reader.path() == "zh/index.html"
    assert not reader.problems, "\n".join(reader.problems)


def _search(reader, path: str) -> set[str]:
    """The pages a search page lists, once it says it is done."""
    reader.open(path)
    reader.page.wait_for_function(
        "() => { const p = document.querySelector('#search-results p.search-summary');"
        " return p && /found|did not match|搜索完成|没有任何文档/i.test(p.textContent); }",
        timeout=30_000)
    results = reader.page.locator("#search-results ul.search li a")
    return {urlsplit(h).path.lstrip("/") for h in
            results.evaluate_all("as => as.map(a => a.href)")}


def _article_texts(out: Path) -> dict[str, str]:
    """Each Chinese page's own text (its article, not the sidebar that lists every title)."""
    texts = {}
    for page in _pages(out, "zh"):
        html = (out / page).read_text()
        match = re.search(r"<article[^>]*>(.*?)</article>", html, re.S)
        if match:
            texts[page] = re.sub(r"<[^>]+>", " ", match.group(1))
    return texts


def test_search_on_the_chinese_site_finds_a_chinese_word(reader, built_site):
    texts = _article_texts(built_site.out)
    for word in ("梯度", "数据并行"):
        holding = {page for page, text in texts.items() if word in text}
        assert holding, word
        found = _search(reader, f"zh/search.html?q={word}")
        assert found, f"the Chinese search found no page for {word}"
        assert found <= holding, (word, sorted(found - holding))  # Chinese pages that hold it
        assert len(found) >= 0.8 * len(holding), (word, sorted(holding - found))
        if word == "梯度":
            shot(reader.page, "site-zh-search")
    assert not reader.problems, "\n".join(reader.problems)


def test_the_chinese_search_index_maps_chinese_words_to_their_pages(built_site):
    """No browser: the Chinese searchindex.js holds Chinese words (jieba cut them), each mapped
    to the pages whose text holds it."""
    js = (built_site.out / "zh" / "searchindex.js").read_text()
    index = json.loads(js[js.index("(") + 1:js.rindex(")")])
    texts = _article_texts(built_site.out)
    for word in ("梯度", "数据并行", "集合通信"):
        found = set()
        for key in ("terms", "titleterms"):
            ids = index[key].get(word, [])
            found |= {"zh/" + index["docnames"][i] + ".html"
                      for i in ([ids] if isinstance(ids, int) else ids)}
        holding = {page for page, text in texts.items() if word in text}
        assert found and found <= holding, (word, sorted(found - holding))
        assert len(found) >= 0.8 * len(holding), (word, sorted(holding - found))

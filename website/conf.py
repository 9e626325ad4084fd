"""Sphinx configuration of the course's website (built by ``python website/build.py``).

The build renders the notebooks' stored outputs (CI executed and compared them); it never runs
a notebook, and every file the pages load comes from installed packages: no CDN, no theme
download, no web font, so it builds and reads the same with the network cut off.
"""

import json
import os
from pathlib import Path

REPOSITORY = os.environ["DPCOURSE_SITE_REPOSITORY"]  # set by build.py from pyproject.toml
BRANCH = "main"

project = "dpcourse"
author = "the dpcourse authors"
copyright = "dpcourse authors, MIT licence"
html_title = "dpcourse — data parallelism, from one device to a ring"

extensions = ["myst_nb"]
nb_execution_mode = "off"  # the stored outputs are the page: never execute a notebook
nb_merge_streams = True
# Widgets need a kernel; their stored fallback (text and the static figure) is what a reader
# sees, and no ipywidgets/require.js script is fetched from a CDN.
nb_ipywidgets_js = {}
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
templates_path = ["_templates"]
html_css_files = ["site.css"]
html_favicon = "_static/favicon.svg"  # a local file: no request for a missing /favicon.ico
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
# light by default: the figures are drawn on white; a reader may still switch
html_context = {"default_mode": "light"}
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": BRANCH,
    "path_to_docs": "",
    "use_repository_button": True,
    "use_download_button": False,  # it links the staged copy; GitHub, Binder and Colab are the sources
    "launch_buttons": {"binderhub_url": "https://mybinder.org",
                       "colab_url": "https://colab.research.google.com",
                       "notebook_interface": "jupyterlab"},
    "show_toc_level": 2,
    # the language switch (English <-> 中文) beside the sidebar button, at the top of every page
    "article_header_start": ["toggle-primary-sidebar.html", "dpcourse-language.html"],
    "home_page_in_toc": True,
    "navigation_with_keys": False,
}


# The language switch. build.py stages each edition with ``_switch.json``: every page's link to
# the same page in the other edition (or to its home page), relative, computed once there.
def _language_switch(app, pagename, templatename, context, doctree):
    if not hasattr(app, "dpcourse_switch"):
        path = Path(app.srcdir) / "_switch.json"
        app.dpcourse_switch = json.loads(path.read_text()) if path.exists() else {}
    context["dpcourse_switch"] = app.dpcourse_switch.get(pagename)


def _chinese_search(app, config):
    """The Chinese edition's search (language zh_CN): Sphinx cuts Chinese text into words with
    jieba (build.py hands it the glossary's terms as whole words). Two repairs: jieba's start-up
    lines on stderr are not a build message; and Sphinx 9.0's Chinese search page finds nothing
    (its language_data.js ends ``window.Stemmer = ChineseStemmer`` while the stemmer it ships is
    the English one: "ChineseStemmer is not defined", sphinx-doc/sphinx#14229, fixed by #14416
    after 9.0.4), so the search language is registered again naming the stemmer it ships."""
    if not (config.language or "").startswith("zh"):
        return
    import logging

    from sphinx.search.zh import SearchChinese

    try:
        import jieba
        jieba.setLogLevel(logging.WARNING)
    except ImportError:  # build.py says what that costs: the index holds no Chinese word
        pass

    class SearchChineseEnglishStemmer(SearchChinese):
        # the JS class of js_stemmer_rawcode ("english-stemmer.js") is EnglishStemmer
        language_name = "English"

    app.add_search_language(SearchChineseEnglishStemmer)


def setup(app):
    app.connect("config-inited", _chinese_search)
    app.connect("html-page-context", _language_switch)

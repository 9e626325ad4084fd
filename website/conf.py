"""Sphinx configuration of the course's website (built by ``python website/build.py``).

The build renders the notebooks' stored outputs (CI executed and compared them); it never runs
a notebook, and every file the pages load comes from installed packages: no CDN, no theme
download, no web font, so it builds and reads the same with the network cut off.
"""

import os

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
    "home_page_in_toc": True,
    "navigation_with_keys": False,
}

"""Let the singlehtml builder render what the html builder renders (for `make pdf`).

Sphinx looks up the visitors of an extension's nodes under the builder's name and, only when no
extension registered any visitor under that name, under its format: ``singlehtml`` falls back to
``html``. sphinx-exercise registers its nodes for ``singlehtml`` too, so that fallback never
happens and the nodes that other extensions registered for ``html`` only (sphinx-proof's
``definition_node``, ``proof_node`` ...) stop the build with "unknown node type". This extension
(listed in _config.yml under ``sphinx.local_extensions``) gives the singlehtml builder every
html visitor it lacks, when that builder starts. It does nothing for any other builder.
"""

from __future__ import annotations


def _inherit_html_visitors(app) -> None:
    if app.builder.name != "singlehtml":
        return
    handlers = app.registry.translation_handlers
    single = handlers.setdefault("singlehtml", {})
    for node, visitors in handlers.get("html", {}).items():
        single.setdefault(node, visitors)


def setup(app):
    app.connect("builder-inited", _inherit_html_visitors)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

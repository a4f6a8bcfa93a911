"""MkDocs hooks (mkdocs.yml's ``hooks:``): the docstrings' Sphinx roles shown as plain code.

jaxrm's docstrings name other objects as Sphinx does (``:class:`jaxrm.scoring.loading.ScoringInfo```);
mkdocstrings renders the name as code and leaves the role in front of it. The role is dropped.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html, **kwargs):
  return _ROLE.sub("", html)

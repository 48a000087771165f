"""The role templates (railyard/roles/<role>/templates/*.j2): text people read, every value
through the `q` filter (railyard.transport.q)."""

from __future__ import annotations

import json

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from ..inventory import ROLES_DIR
from ..transport import q


def render(role: str, name: str, **values) -> str:
    env = Environment(loader=FileSystemLoader(str(ROLES_DIR / role / "templates")), undefined=StrictUndefined,
                      keep_trailing_newline=True, autoescape=False, trim_blocks=True,
                      lstrip_blocks=True)
    env.filters["q"] = lambda v: q(v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    return env.get_template(name).render(**values)

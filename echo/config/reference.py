"""The config reference (docs/config.md), generated from the typed config itself: every key,
its type and limits, its default, and its meaning, taken from the comments beside it in
echo/config/__init__.py. tests/test_config.py fails when the file is behind the code.

    .venv/bin/python -m echo.config.reference > docs/config.md
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic.fields import FieldInfo

import echo.config as config_module
from echo.config import EchoConfig

HEADER = """# Config reference

Generated from `echo/config/__init__.py` by `python -m echo.config.reference`: do not edit by hand.
A run's config is a TOML file (`--config run.toml`) with these sections, or `--set
section.key=value` on the command line of `up`, `trainer`, `sampler` and `eval`. An unknown key or a bad value stops the process at
start, naming the field.
"""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> its comment: the block just above it and the comment on its line."""
    comments: dict[int, str] = {}  # line -> comment text
    standalone: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
            if not token.line[: token.start[1]].strip():
                standalone.add(token.start[0])
    found: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            block, line = [], item.lineno - 1
            while line in standalone:
                block.insert(0, comments[line])
                line -= 1
            trailing = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments
                        and n not in standalone]
            found[(node.name, item.target.id)] = " ".join(block + trailing)
    return found


def _type(field: FieldInfo) -> str:
    if get_origin(field.annotation) is Literal:
        text = "one of " + ", ".join(f'`"{v}"`' for v in get_args(field.annotation))
    else:
        text = getattr(get_origin(field.annotation) or field.annotation, "__name__", str(field.annotation))
    limits = []
    for rule in field.metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(rule, name, None) is not None:
                limits.append(f"{sign} {getattr(rule, name)}")
        if getattr(rule, "pattern", None):
            limits.append(f"matches `{rule.pattern}`")
    return ", ".join([text, *limits])


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "generated" if isinstance(value, str) else repr(value)
    return "`" + repr(field.default).replace("'", '"') + "`"


def reference() -> str:
    comments = field_comments(Path(config_module.__file__).read_text())
    parts = [HEADER]
    for section, section_field in EchoConfig.model_fields.items():
        model = section_field.annotation
        parts.append(f"\n## [{section}]\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |")
        for key, field in model.model_fields.items():
            cells = [f"`{section}.{key}`", _type(field), _default(field), comments.get((model.__name__, key), "")]
            parts.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(reference(), end="")

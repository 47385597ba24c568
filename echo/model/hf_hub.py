"""Models named by their Hugging Face Hub id, `owner/name` or `owner/name@revision`. Pure:
parsing only; echo/model/loading.py downloads. A trainer pins the revision to its commit hash before the
run starts, so every process of the run loads the same bytes, whatever the branch does later."""

from __future__ import annotations

import re

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.][\w./-]*))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_id(name: str) -> tuple[str, str | None] | None:
    """(repository, revision or None) for a name shaped as a hub id; None for any other name."""
    found = HUB_ID.match(name)
    return (found["repo"], found["revision"]) if found else None


def pinned(repo: str, commit: str) -> str:
    return f"{repo}@{commit}"


def is_pinned(name: str) -> bool:
    """A hub id at a commit hash: names one set of files, which a branch or tag does not."""
    parsed = hub_id(name)
    return parsed is not None and parsed[1] is not None and COMMIT.match(parsed[1]) is not None

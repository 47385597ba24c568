"""Build `dist/echo-sampler`: one file that runs a sampler on any box with this Python version,
this platform and torch (`make worker`). It holds echo-rl's code and every package of its base
install (pyproject's `dependencies`, the edge sampler's set), copied from this environment, less
torch and what torch itself requires: the box brings a torch built for its hardware.
workers/operator/edge_main.py is its entry point.

    .venv/bin/python -m workers.operator.edge_bundle [--out dist/echo-sampler]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import platform
import sysconfig
import zipfile
from pathlib import Path

import orjson
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import echo
import streams
import workers
from workers.operator.edge_main import SITE

BOX_PROVIDES = "torch"  # with its own requirements


def closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions these requirements need, transitively, by canonical name
    (markers evaluated here, extras followed)."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(Requirement(r), "") for r in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = dist = metadata.distribution(requirement.name)
        for spec in dist.requires or []:
            for wanted in ("", *requirement.extras):
                pending.append((Requirement(spec), wanted))
    return found


def base_requirements() -> list[str]:
    """echo-rl's own requirements without an extra: what a sampler needs."""
    return [r for r in metadata.distribution("echo-rl").requires or [] if "extra ==" not in r]


def bundled_distributions() -> dict[str, metadata.Distribution]:
    on_box = closure([BOX_PROVIDES])
    return {name: dist for name, dist in closure(base_requirements()).items() if name not in on_box}


def bundled_files(distributions: dict[str, metadata.Distribution]) -> dict[str, Path]:
    """Path in the bundle's site directory -> file here: the distributions' and echo-rl's own."""
    files: dict[str, Path] = {}
    for dist in distributions.values():
        for entry in dist.files or []:
            if entry.parts[0] == ".." or "__pycache__" in entry.parts:  # scripts outside site-packages; caches
                continue
            files[entry.as_posix()] = Path(entry.locate())
    for package in (echo, streams, workers):
        root = Path(package.__file__).parent
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files[path.relative_to(root.parent).as_posix()] = path
    return files


def build(out: Path) -> dict:
    """Write the bundle to `out`; returns its description (bundle.json)."""
    distributions = bundled_distributions()
    files = bundled_files(distributions)
    digest = hashlib.sha256()
    for name, path in sorted(files.items()):
        digest.update(name.encode() + b"\0" + path.read_bytes())
    description = {
        "id": digest.hexdigest()[:16],
        "python": list(platform.python_version_tuple()[:2]),
        "platform": sysconfig.get_platform(),
        "packages": {d.metadata["Name"]: d.version for d in distributions.values()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")  # a zip may start with anything: `./echo-sampler` runs it
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
            z.write(Path(__file__).with_name("edge_main.py"), "__main__.py")
            z.writestr("bundle.json", orjson.dumps(description, option=orjson.OPT_INDENT_2))
            for name, path in sorted(files.items()):
                z.write(path, SITE + name)
    out.chmod(0o755)
    return description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("dist/echo-sampler"))
    args = parser.parse_args()
    description = build(args.out)
    size = args.out.stat().st_size / 2**20
    print(f"{args.out}: {size:.0f} MiB, {len(description['packages'])} packages besides torch's, for Python "
          f"{'.'.join(description['python'])} on {description['platform']}; its first run unpacks it into "
          "~/.cache/echo-sampler")


if __name__ == "__main__":
    main()

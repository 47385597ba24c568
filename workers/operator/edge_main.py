"""echo-sampler: a sampler in one file, for an edge box that has Python and torch.

The file is a zip (workers/operator/edge_bundle.py builds it): echo-rl's code and the packages a sampler
needs besides torch, built for one Python version and platform. Compiled modules cannot be
imported from inside a zip, so the first run unpacks it once into ~/.cache/echo-sampler/<id>
(ECHO_SAMPLER_CACHE to put it elsewhere); later runs start from there.

    python3 echo-sampler --nats nats://hub:4222 --run-id RUN --id NAME [--creds FILE --tls-ca FILE]

Every argument is `echo-rl sampler`'s. Standard library only until the bundle is on the path.
"""

import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

SITE = "site/"  # the bundle's packages, inside the zip


def unpacked(bundle: Path, bundle_id: str) -> Path:
    """The bundle's packages on disk, unpacked on the first run of this bundle."""
    cache = Path(os.environ.get("ECHO_SAMPLER_CACHE") or Path.home() / ".cache" / "echo-sampler") / bundle_id
    if cache.exists():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".unpacking-"))
    with zipfile.ZipFile(bundle) as z:
        z.extractall(staging, [n for n in z.namelist() if n.startswith(SITE)])
    try:
        os.rename(staging, cache)  # atomic: a sampler starting beside this one sees all or nothing
    except OSError:  # that one unpacked it first
        shutil.rmtree(staging, ignore_errors=True)
    return cache


def main() -> int:
    bundle = Path(__file__).resolve().parent  # the zip itself: __main__.py lies at its root
    with zipfile.ZipFile(bundle) as z:
        built = json.loads(z.read("bundle.json"))
    here = {"python": platform.python_version_tuple()[:2], "platform": sysconfig.get_platform()}
    if [built["python"], built["platform"]] != [list(here["python"]), here["platform"]]:
        print(f"echo-sampler: built for Python {'.'.join(built['python'])} on {built['platform']}, this is Python "
              f"{'.'.join(here['python'])} on {here['platform']}: build one where echo-rl is installed in "
              "this Python (make worker), or pip install echo-rl here", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is None:  # the one package left to the box: its build fits the hardware
        print("echo-sampler: needs PyTorch on this machine: pip install torch (see pytorch.org for a GPU build)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(unpacked(bundle, built["id"]) / SITE))
    from workers.cli import main as cli

    return cli(["sampler", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())

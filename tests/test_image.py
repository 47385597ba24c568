"""compose/Dockerfile against what its final image lacks, without Docker: python:3.11-slim has no C
compiler, so every package the image installs must come as a binary wheel, be pure Python, or be
built as a wheel in an earlier stage that has a compiler. A dependency that joins without a wheel
for this platform broke `docker compose up` once (pycosat, before the wheels stage) while `make test` stayed green.

What pip would install is read from this venv, which `make` installed from the same extras: a
package pip compiled here carries a wheel tag of the plain `linux_*` platform (PyPI's binary wheels
are `manylinux`/`musllinux`; pure ones `any`). This checks the image's platform as this machine's
(x86_64, CPython 3.11); an arm64 build may lack wheels that x86_64 has."""

import shlex
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent.parent
PROJECT = "echo-rl"
VALUED = {"--index-url", "--extra-index-url", "--find-links", "-f", "--wheel-dir", "-w", "-c", "--constraint"}


def stages(dockerfile: str) -> list[dict]:
    """The Dockerfile's stages in order: {"name", "run": [commands], "copied_from": {stage names}}."""
    text = dockerfile.replace("\\\n", " ")
    found: list[dict] = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        instruction = words[0].upper()
        if instruction == "FROM":
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else str(len(found))
            found.append({"name": name, "run": [], "copied_from": set()})
        elif instruction == "RUN" and found:
            found[-1]["run"].append(line.split(None, 1)[1])
        elif instruction == "COPY" and found:
            found[-1]["copied_from"] |= {w.split("=", 1)[1] for w in words if w.startswith("--from=")}
    return found


def pip_commands(run: str, verb: str) -> list[tuple[list[str], set[str]]]:
    """Each `pip <verb>` in a RUN command: (its requirement arguments, its flags)."""
    commands = []
    for part in run.split("&&"):
        words = shlex.split(part)
        if words[:2] != ["pip", verb]:
            continue
        requirements, flags, skip = [], set(), False
        for word in words[2:]:
            if skip:
                skip = False
            elif word in VALUED:
                skip = True
            elif word.startswith("-"):
                flags.add(word.split("=", 1)[0])
            else:
                requirements.append(word)
        commands.append((requirements, flags))
    return commands


def installed_closure(roots: list[tuple[str, set[str]]]) -> dict[str, metadata.Distribution]:
    """The installed distributions that these (name, extras) roots require, transitively."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        key = canonicalize_name(dist.metadata["Name"])
        if key in found and not extras:
            continue
        found[key] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((requirement.name, set(requirement.extras)))
    return found


def compiled_here(dist: metadata.Distribution) -> bool:
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    return any(tag.split("-")[2].startswith("linux_") for tag in tags)


def needs_a_compiler(dockerfile: str) -> set[str]:
    """What the Dockerfile's final image would compile: packages its installs need that pip built
    from source in this venv and that no earlier stage it copies from builds as a wheel."""
    *earlier, final = stages(dockerfile)
    built = {canonicalize_name(Requirement(r).name)
             for stage in earlier if stage["name"] in final["copied_from"]
             for run in stage["run"] for requirements, _ in pip_commands(run, "wheel") for r in requirements}
    closure: dict[str, metadata.Distribution] = {}
    for run in final["run"]:
        for requirements, flags in pip_commands(run, "install"):
            for r in requirements:
                if r.startswith("/"):  # a path: an earlier stage's wheel
                    continue
                if r.startswith("."):  # the project itself, with its extras
                    root = (PROJECT, {e for e in r.partition("[")[2].rstrip("]").split(",") if e})
                else:
                    root = (Requirement(r).name, set())
                if "--no-deps" in flags:
                    closure[canonicalize_name(root[0])] = metadata.distribution(root[0])
                else:
                    closure |= installed_closure([root])
    return {name for name, dist in closure.items() if compiled_here(dist)} - built


def test_every_package_the_worker_image_installs_has_a_wheel_or_is_built_in_a_stage_with_a_compiler():
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert needs_a_compiler(dockerfile) == set(), (
        "compose/Dockerfile's final image (python:3.11-slim, no compiler) would build these from source: "
        "add them to its wheels stage, then run `make test-compose`")


def test_the_guard_names_what_the_image_would_compile_without_its_wheels_stage():
    """The Dockerfile as it was before its wheels stage (one stage): pycosat, which reasoning-gym needs and
    which has no wheel for linux x86_64, is named."""
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    final = dockerfile[dockerfile.rindex("\nFROM "):]
    one_stage = final.replace("COPY --from=wheels /wheels /wheels\n", "").replace(
        "RUN pip install --no-cache-dir /wheels/*.whl\n", "")
    assert needs_a_compiler(one_stage) == {"pycosat"}

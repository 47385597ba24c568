"""The layers stay as docs/design.md draws them: echo/ (pure: no broker, no process) <- streams/ (all
NATS) <- workers/ (processes) <- bench/. No module imports from a layer above its own, even
lazily inside a function; and only streams/ and workers/ speak to NATS."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FORBIDDEN = {"echo": {"nats", "streams", "workers", "bench"}, "streams": {"workers", "bench"}, "workers": {"bench"}}


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def imported_by_each(files: list[Path]) -> dict[str, list[str]]:
    """`imported` of each file, worked out in a process of its own: CPython 3.11's AST builder
    counts its recursion depth per interpreter, not per thread, so a thread of this test process
    formatting a traceback (3.11 parses the line to place its carets) at the same moment made
    ast.parse here fail with "AST constructor recursion depth mismatch" (seen in a CI run)."""
    script = ("import json, sys; from pathlib import Path; from tests.test_layers import imported; "
              "print(json.dumps({f: sorted(imported(Path(f))) for f in sys.argv[1:]}))")
    out = subprocess.run([sys.executable, "-c", script, *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_module_imports_from_a_layer_above_its_own(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    wrong = {str(Path(f).relative_to(ROOT)): sorted(set(names) & FORBIDDEN[layer])
             for f, names in imported_by_each(files).items()}
    assert {f: names for f, names in wrong.items() if names} == {}


LAYERS = ("echo", "streams", "workers")


def modules_of(*packages: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for package in packages for p in (ROOT / package).rglob("*.py")}


def our_imports(path: Path) -> set[str]:
    """The modules of ours `path` imports, lazily inside a function too (a name imported from a
    package is its submodule where there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(LAYERS):
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith(LAYERS)}
    return found


def import_graph(*packages: str) -> dict[str, set[str]]:
    modules = modules_of(*packages)
    return {name: (our_imports(path) & modules.keys()) - {name} for name, path in modules.items()}


def test_no_import_cycle_anywhere():
    """A cycle is dodged with imports inside functions (echo/tasks/dataset.py <-> math.py was;
    so were the page and `status`, and the command line, `up`, the swarm and its forked child):
    every module of ours is imported one way."""
    graph = import_graph(*LAYERS)
    done, cycles = set(), []

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(path[path.index(name):] + [name])
            return
        if name in done:
            return
        for imported_name in sorted(graph[name]):
            visit(imported_name, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_the_trainers_wing_imports_nothing_of_the_operators():
    """The trainer's process runs without the operator's tools: what both use lives below them."""
    graph = import_graph("workers")
    assert {(name, other) for name, imported in graph.items() if name.startswith("workers.trainer")
            for other in imported if other.startswith("workers.operator")} == set()


def test_no_file_name_twice_in_workers():
    """A wing's rooms and the operator's commands each have one name in workers/ (status.py once,
    not a view, a page and a command of the same name): a reader finds a room by its name."""
    names = [f.name for f in (ROOT / "workers").rglob("*.py") if f.name != "__init__.py"]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def constructor_parameters(path: Path) -> dict[str, int]:
    """Each class in `path` with an `__init__` of its own: how many parameters it takes (self not
    counted). A dataclass is a record of values, not a wiring of collaborators: not counted."""
    counts = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for init in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
                a = init.args
                counts[f"{path.relative_to(ROOT)}::{node.name}"] = (
                    len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg))
    return counts


def test_no_constructor_takes_more_than_six_parameters():
    """Collaborators are built in one place (a wing's open(), or a config object) and handed over
    together: a class wired by hand from many parts was hard to read and to test."""
    counts = {}
    for layer in FORBIDDEN:
        for path in sorted((ROOT / layer).rglob("*.py")):
            counts |= constructor_parameters(path)
    assert counts, "no constructor found: the walk is broken"
    assert {name: n for name, n in counts.items() if n > 6} == {}


def class_lengths(path: Path) -> dict[str, int]:
    return {f"{path.relative_to(ROOT)}::{node.name}": node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def test_no_class_in_workers_runs_past_120_lines_and_the_step_loops_file_past_300():
    """A concern added to a process gets a room of its own (the trainer's holders, publishing,
    rooms; the intake's tally), not more lines in a class that already holds one: the trainer's
    loop and its classes grew back past these once, each addition reasonable alone."""
    lengths = {}
    for path in sorted((ROOT / "workers").rglob("*.py")):
        lengths |= class_lengths(path)
    assert lengths, "no class found: the walk is broken"
    assert {name: n for name, n in lengths.items() if n > 120} == {}
    assert len((ROOT / "workers" / "trainer" / "trainer.py").read_text().splitlines()) <= 300


def layout_paths(design: str) -> set[str]:
    """The paths docs/design.md's layout names: one entry a line, nested by two spaces."""
    block = design.split("## Layout\n\n```\n", 1)[1].split("```", 1)[0]
    paths, parents = set(), []
    for line in block.splitlines():
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        parents = parents[:depth] + [name]
        paths.add("".join(parents))
    return paths


def test_the_design_docs_layout_names_every_module_and_nothing_else():
    named = layout_paths((ROOT / "docs" / "design.md").read_text())
    modules = {str(f.relative_to(ROOT)) for layer in FORBIDDEN for f in (ROOT / layer).rglob("*.py")
               if f.name != "__init__.py"}
    assert modules - named == set(), "modules missing from docs/design.md's layout"
    assert {p for p in named if p.endswith(".py")} - modules == set(), "docs/design.md's layout names modules that are gone"
    assert all((ROOT / p).exists() for p in named)


def test_the_design_docs_rollout_path_is_at_most_eight_rooms_each_dealing_in_its_form():
    """docs/design.md draws a rollout's path room by room with the form it leaves in: the walk
    stays short (at most 8 rooms, each once), and each room's code names the form it hands on."""
    design = (ROOT / "docs" / "design.md").read_text()
    table = design.split("## A rollout's path\n", 1)[1].split("\n\n| # |", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    rooms = [room for _, room, _, _ in rows]
    assert 0 < len(rooms) <= 8 and len(set(rooms)) == len(rooms), rooms
    for _, room, _, form in rows:
        assert re.search(rf"\b{form}\b", (ROOT / room).read_text()), (room, form)


def group_forms() -> dict[str, str]:
    """Every class the trainer builds around a rollout group (class -> module): a RolloutGroup or
    Delivery, and each class whose fields hold one of those forms or that extends one, to a fixed
    point (a callable's argument is not a field's form)."""
    rooms = [*(ROOT / "workers" / "trainer").glob("*.py"), ROOT / "streams" / "inbox.py",
             *(ROOT / "echo" / "train").glob("*.py")]
    classes = {}
    for path in rooms:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                held = {name for field in node.body if isinstance(field, ast.AnnAssign)
                        and "Callable" not in (annotation := ast.unparse(field.annotation))
                        for name in re.findall(r"\w+", annotation)}
                classes[node.name] = (str(path.relative_to(ROOT)), held | {ast.unparse(b) for b in node.bases})
    forms = {"RolloutGroup": "echo/wire/messages.py", "Delivery": "streams/inbox.py"}
    while grown := {name: path for name, (path, held) in classes.items() if name not in forms and held & forms.keys()}:
        forms |= grown
    return forms


def test_the_design_docs_rollout_path_names_every_form_the_trainer_builds_of_a_group():
    """The one record through the trainer: whatever form the code gives a group on its way to the
    learner is one docs/design.md's rollout path names (found in a process of its own, as
    imported_by_each is)."""
    script = "import json; from tests.test_layers import group_forms; print(json.dumps(group_forms()))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    forms = json.loads(out.stdout)
    assert {"Case", "Accepted", "Rewarded", "Batch"} <= forms.keys(), forms  # the walk finds what it must
    path = (ROOT / "docs" / "design.md").read_text().split("## A rollout's path\n", 1)[1].split("\n## ", 1)[0]
    unnamed = {name: where for name, where in forms.items() if f"`{name}`" not in path}
    assert not unnamed, f"forms of a group docs/design.md's rollout path does not name: {unnamed}"


def test_no_test_module_imports_another():
    """Shared helpers live in tests/conftest.py (fixtures, processes), tests/groups.py (rollout
    groups) and tests/swarms.py (`echo-rl up` runs), never in a test module another imports. (Read
    as text, not parsed: see imported_by_each.)"""
    wrong = {f.name: found for f in sorted((ROOT / "tests").glob("test_*.py"))
             if (found := re.findall(r"^\s*(?:from|import) (tests\.test_\w+)", f.read_text(), re.M))}
    assert wrong == {}


def _sleeps(statement: ast.stmt) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    call = call.value if isinstance(call, ast.Await) else call
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "sleep"


def test_no_test_polls_by_hand():
    """A test waits for a condition through conftest's `eventually` (or `eventually_async`): one
    deadline, and a failure that says what was last seen. A loop that only sleeps and looks (its
    body: sleeps, assignments, asserts, ifs, tries) is such a wait written by hand; a loop that
    also acts (publishes, renews) is not. Checked by putting one back."""
    looks = (ast.Assign, ast.AnnAssign, ast.Assert, ast.If, ast.Try, ast.Pass, ast.Continue, ast.Break, ast.Return)
    by_hand = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and f.name in ("eventually", "eventually_async") for n in ast.walk(f)}
        by_hand += [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.While) and node not in helpers and any(map(_sleeps, node.body))
                    and all(_sleeps(s) or isinstance(s, looks) for s in node.body)]
    assert by_hand == []


def test_tasks_sit_below_the_episodes_that_play_them():
    """echo/tasks/episodes.py plays what echo/tasks/ defines (Step, Environment live in echo.tasks):
    no task module imports it back."""
    graph = import_graph("echo")
    assert [name for name, imported in graph.items()
            if name.startswith("echo.tasks") and name != "echo.tasks.episodes" and "echo.tasks.episodes" in imported] == []


def test_echo_is_in_rooms_each_saying_what_lives_there():
    """No loose module in echo/ beside its __init__.py, and every room's __init__.py has a docstring."""
    assert sorted(p.name for p in (ROOT / "echo").glob("*.py")) == ["__init__.py"]
    for room in (ROOT / "echo").rglob("*/"):
        if room.name != "__pycache__" and any(room.glob("*.py")):
            init = room / "__init__.py"
            assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), room


# Prints OMP_WAIT_POLICY as it is when torch is first imported (OpenMP reads it then, once), and
# stops there: what torch would load after it is not the question, and takes seconds.
TORCH_LOADED_WITH = """
import importlib, os, sys

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(os.environ.get("OMP_WAIT_POLICY"), flush=True)
            os._exit(0)

sys.meta_path.insert(0, Watch())
for module in sys.argv[1:]:  # as a process of ours imports them: workers.cli, then a command's modules
    importlib.import_module(module)
"""


@pytest.mark.parametrize("modules, given, expected", [
    ("workers.cli workers.trainer.model", None, "PASSIVE"), ("workers.cli workers.sampler.sampler", None, "PASSIVE"),
    ("bench.load", None, "PASSIVE"), ("tests.conftest", None, "PASSIVE"), ("echo.train.learner", "ACTIVE", "ACTIVE")])
def test_torch_is_loaded_with_passive_openmp_threads_unless_the_user_says_otherwise(modules, given, expected):
    """Spinning OpenMP threads (libgomp's default) beside another busy process made generation
    150x slower on this 2-core box; echo/__init__.py asks for passive ones before torch loads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env |= {"OMP_WAIT_POLICY": given} if given else {}
    out = subprocess.run([sys.executable, "-c", TORCH_LOADED_WITH, *modules.split()], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected], (out.stdout, out.stderr[-2000:])

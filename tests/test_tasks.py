"""The three workloads and the task plug-in interface. Generators are deterministic, puzzles are
well-posed (unique solutions, solvable rooms), and verifiers accept right answers in several
formats and reject wrong and malformed ones."""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from echo.config import ConfigError, TaskConfig
from echo.tasks import Prompt, load_task
from echo.tasks.knights_knaves import KINDS, NAMES, KnightsKnaves, make_puzzle, solutions
from echo.tasks.math import Math
from echo.tasks.sokoban import Room, Sokoban, SokobanParams, make_room


@pytest.mark.parametrize("name", ["math", "knights_knaves", "sokoban"])
def test_generators_are_deterministic_and_the_held_out_set_is_disjoint(name):
    a, b = load_task(TaskConfig(name=name)), load_task(TaskConfig(name=name))
    assert [a.prompt(i) for i in range(20)] == [b.prompt(i) for i in range(20)]
    held_out = a.held_out(10)
    assert held_out == b.held_out(10) and len(held_out) == 10
    training = {a.prompt(i).messages[-1]["content"] for i in range(300)}
    assert not training & {p.messages[-1]["content"] for p in held_out}
    for p in held_out:  # the ground truth scores full marks
        assert a.score(right_answer(name, p), p).correct


def right_answer(name: str, prompt: Prompt) -> str:
    if name == "math":
        return f"\\boxed{{{prompt.answer}}}"
    if name == "knights_knaves":
        return "<answer>" + "\n".join(pair.replace(":", ": ") for pair in prompt.answer.split(",")) + "</answer>"
    return "<answer>" + " ".join(Room.parse(prompt.answer).solve(50)) + "</answer>"


MATH = Math({"levels": [1, 2, 3]})


@pytest.mark.parametrize(
    "answer, completion, reward, format_ok",
    [
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0, True),
        ("\\frac{1}{2}", "so it is \\boxed{1/2}.", 1.0, True),
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0, True),
        ("-4", "4 - 8 = \\boxed{-4}", 1.0, True),
        ("-4", "\\boxed{ -4 }", 1.0, True),
        ("12", "\\boxed{3} no, \\boxed{12}", 1.0, True),  # the last boxed answer counts
        ("12", "\\boxed{13}", 0.1, True),
        ("12", "12", 0.0, False),  # no \boxed{}
        ("12", "\\boxed{}", 0.0, False),
        ("12", "", 0.0, False),
        ("12", "\\boxed{12", 0.0, False),  # never closed
        ("1000", "\\boxed{1,000.0}", 1.0, True),
        ("-\\frac{3}{4}", "\\boxed{\\dfrac{-3}{4}}", 1.0, True),
        # A verifier bomb: sympy computed such a power tower in full (minutes, and memory, each); a number
        # is compared, and nothing is evaluated.
        ("7", "\\boxed{7^{9^{8}}}", 0.1, True),
        ("7", "\\boxed{100000000!}", 0.1, True),
        ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", 1.0, True),  # not a number: math-verify, equivalent forms count
    ],
)
def test_math_verifier(answer, completion, reward, format_ok):
    score = MATH.score(completion, Prompt(0, [], answer))
    assert (score.reward, score.format_ok, score.correct) == (reward, format_ok, reward == 1.0)


def test_math_verifier_scores_alike_off_the_main_thread():
    """A sampler scores its completions in a worker thread, the trainer in its main thread: the
    verdicts must agree (math-verify's signal-based timeouts raised off the main thread, so a
    sampler claimed 0 for every boxed answer and was quarantined for reward mismatches; seen on
    SmolLM2, whose answers are often right)."""
    prompt = Prompt(0, [], "\\frac{1}{2}")
    completions = ["\\boxed{0.5}", "\\boxed{3}", "no box", "\\boxed{" + "1+" * 500 + "1}"]
    in_main = [MATH.score(c, prompt) for c in completions]
    with ThreadPoolExecutor(1) as pool:
        in_thread = list(pool.map(lambda c: MATH.score(c, prompt), completions))
    assert in_thread == in_main
    assert [s.reward for s in in_main[:3]] == [1.0, 0.1, 0.0]


def test_math_levels_are_graded():
    questions = {level: Math({"levels": [level]}).prompt(0).messages[-1]["content"] for level in (1, 2, 3)}
    assert " + " in questions[1] or " - " in questions[1]
    assert questions[1] != questions[2] != questions[3]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_math_reads_a_local_dataset(tmp_path, suffix):
    rows = [{"question": f"Tom has {i} cats and gets {i} more. How many?", "answer": f"He has {i}+{i}.\n#### {2 * i}"}
            for i in range(60)]
    path = tmp_path / f"gsm{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    task = Math({"dataset": str(path), "example": False})
    prompt = task.prompt(3)
    assert "Put the final answer in \\boxed{}" in prompt.messages[-1]["content"]
    assert task.score(f"\\boxed{{{prompt.answer}}}", prompt).correct
    held_out = {p.messages[-1]["content"] for p in task.held_out(100)}
    training = {task.prompt(i).messages[-1]["content"] for i in range(60)}
    assert held_out and training and not held_out & training and len(held_out | training) == 60


def test_math_dataset_without_the_field_fails_clearly(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "1+1", "solution": "2"}))
    with pytest.raises(ValueError, match="no field 'question'"):
        Math({"dataset": str(path)})


@pytest.mark.parametrize("n", range(2, 9))
def test_every_knights_and_knaves_puzzle_has_exactly_one_solution(n):
    rng = random.Random(n)
    for _ in range(30):
        truth, statements = make_puzzle(rng, n)
        assert solutions(n, statements) == [truth]
        assert {kind for kind, _, _ in statements} <= KINDS.keys()


KK = KnightsKnaves({"people": [3], "partial_credit": 0.6})
KK_PROMPT = Prompt(0, [], "Alice:knight,Bob:knave,Carol:knave")


@pytest.mark.parametrize(
    "completion, reward, format_ok",
    [
        ("<answer>Alice: knight\nBob: knave\nCarol: knave</answer>", 1.0, True),
        ("<answer>Alice is a knight, Bob is a knave, Carol is a knave.</answer>", 1.0, True),
        ("thinking... <answer>\nalice: Knight\n</answer>", 0.0, False),  # names must be capitalised and all there
        ("<answer>Alice: Knight\nBob: KNAVE\nCarol: knave</answer>", 1.0, True),
        ("<answer>Alice: knight\nBob: knight\nCarol: knave</answer>", 0.4, True),  # partial: 2 of 3 x 0.6
        ("<answer>Alice: knave\nBob: knight\nCarol: knight</answer>", 0.1, True),  # all wrong: format reward
        ("<answer>Alice: knight\nBob: knave</answer>", 0.0, False),  # Carol missing
        ("<answer>Alice: knight\nAlice: knave\nBob: knave\nCarol: knave</answer>", 0.0, False),  # contradicts itself
        ("Alice: knight\nBob: knave\nCarol: knave", 0.0, False),  # no tags
    ],
)
def test_knights_and_knaves_verifier(completion, reward, format_ok):
    score = KK.score(completion, KK_PROMPT)
    assert (score.reward, score.format_ok, score.correct) == (pytest.approx(reward), format_ok, reward == 1.0)


def test_knights_and_knaves_prompt_names_everyone():
    prompt = KnightsKnaves({"people": [5]}).prompt(7)
    assert all(name in prompt.messages[-1]["content"] for name in NAMES[:5])


@pytest.mark.parametrize("boxes", [1, 2])
def test_every_sokoban_room_is_solvable_and_its_solution_verifies(boxes):
    params = SokobanParams(width=5, height=5, boxes=boxes)
    task = Sokoban(params.model_dump())
    rng = random.Random(boxes)
    for _ in range(20):
        room, solution = make_room(rng, params)
        assert 1 <= len(solution) <= params.max_solution
        assert room.play(solution) == room.goals
        prompt = Prompt(0, [], room.render())
        assert task.score(f"<answer>{' '.join(solution)}</answer>", prompt).correct
        assert Room.parse(room.render()).render() == room.render()


ROOM = "#####\n#P_X#\n#__O#\n#####"  # a box at (1,3) over its goal (2,3): push it down from above


@pytest.mark.parametrize("params, named", [
    ({"width": 3, "height": 3, "boxes": 4}, "do not fit a 3 x 3 floor"),  # 4 boxes, 4 goals, the player: 9 + 2 walls
    ({"boxes": 4, "max_solution": 1}, "no room of 4 boxes"),  # no four pushes in one move
])
def test_sokoban_settings_no_room_can_meet_fail_at_start_naming_them(params, named):
    with pytest.raises(ConfigError, match="task.params") as e:
        Sokoban(params)
    assert named in str(e.value)


def test_sokoban_rules():
    room = Room.parse("######\n#PX_O#\n######")
    assert room.play("R") == {(1, 3)}
    assert room.play("RR") == {(1, 4)}
    assert room.play("RRR") == {(1, 4)}  # a box against the wall does not move
    assert room.play("U") == room.boxes  # walking into a wall does nothing


@pytest.mark.parametrize(
    "completion, reward, format_ok",
    [
        ("<answer>R R</answer>", 1.0, True),
        ("<answer>r, r</answer>", 1.0, True),
        ("<answer>RR</answer> then more words", 1.0, True),
        ("<answer>R</answer>", 0.1, True),  # legal but unsolved
        ("<answer>R Q</answer>", 0.0, False),
        ("<answer></answer>", 0.0, False),
        ("R R", 0.0, False),
    ],
)
def test_sokoban_verifier(completion, reward, format_ok):
    prompt = Prompt(0, [], "######\n#PX_O#\n######")
    score = Sokoban({}).score(completion, prompt)
    assert (score.reward, score.format_ok, score.correct) == (reward, format_ok, reward == 1.0)


def test_sokoban_partial_credit():
    two = Prompt(0, [], "#######\n#PX_O_#\n#_X_O_#\n#######")
    task = Sokoban({"partial_credit": 0.5})
    assert task.score("<answer>RR</answer>", two).reward == 0.25  # one of two boxes home


def test_user_task_from_a_file_and_bad_names(tmp_path):
    (tmp_path / "mytask.py").write_text(
        "from echo.tasks import GeneratedTask, Score\n"
        "class Echo(GeneratedTask):\n"
        "    name = 'echo'\n"
        "    def __init__(self, params):\n"
        "        self.word = params.get('word', 'hi')\n"
        "    def generate(self, rng):\n"
        "        return [{'role': 'user', 'content': f'Say {self.word} {rng.randint(0, 99)}'}], self.word\n"
        "    def score(self, completion, prompt):\n"
        "        ok = prompt.answer in completion\n"
        "        return Score(float(ok), ok, ok)\n"
    )
    task = load_task(TaskConfig(name=f"{tmp_path}/mytask.py:Echo", params={"word": "yo"}))
    assert task.prompt(1).answer == "yo" and task.score("yo!", task.prompt(1)).correct
    with pytest.raises(ConfigError, match="not a built-in task"):
        load_task(TaskConfig(name="chess"))
    with pytest.raises(ConfigError, match="No module named"):
        load_task(TaskConfig(name="no_such_module:Task"))
    with pytest.raises(ConfigError, match="task.params.boxes"):
        load_task(TaskConfig(name="sokoban", params={"boxes": 9}))
    with pytest.raises(ConfigError, match="task.params.colour: unknown field"):
        load_task(TaskConfig(name="math", params={"colour": "red"}))

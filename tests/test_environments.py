"""Multi-turn episodes (echo/tasks/episodes.py): built token-in token-out as a sampler builds them,
replayed by the trainer, and refused when a sampler lies about what the environment said."""

from pathlib import Path

import numpy as np
import pytest

from echo.config import ConfigError, TaskConfig
from echo.model.loading import byte_tokenizer, encode_chat
from echo.tasks import is_environment
from echo.tasks.episodes import EpisodeBuilder, SingleTurn, load_environment, observation_tokens, rerun
from echo.tasks.math import Math, calculate
from echo.tasks.sokoban import Room, SokobanGame
from echo.wire.messages import Observation

TOKENIZER = byte_tokenizer()
EOS = TOKENIZER.eos_token_id
GAME = SokobanGame({"max_turns": 4})


def turn(text: str, end: bool = True) -> tuple[list[int], list[float]]:
    """A model turn as the engine gives it: the text's ids (and the end-of-turn token), log-probs."""
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + ([EOS] if end else [])
    return ids, [-0.25] * len(ids)


def play(env, index: int, texts: list[str], max_tokens: int = 4096, last_ends: bool = True) -> EpisodeBuilder:
    prompt = env.prompt(index)
    episode = EpisodeBuilder(env, TOKENIZER, prompt, encode_chat(TOKENIZER, prompt.messages), max_tokens)
    for i, text in enumerate(texts):
        assert not episode.done
        episode.add_turn(*turn(text, end=last_ends or i < len(texts) - 1))
    return episode


def solution(index: int) -> str:
    room = Room.parse(GAME.prompt(index).answer)
    return room.solve(GAME.p.max_solution)


def test_an_observation_is_the_chat_templates_rendering_of_that_turn_after_a_model_turn():
    ids = observation_tokens(TOKENIZER, [{"role": "user", "content": "board"}])
    assert TOKENIZER.decode(ids) == "\n<|im_start|>user\nboard<|im_end|>\n<|im_start|>assistant\n"
    # As the template renders the whole conversation: the model's turn, then exactly these.
    whole = encode_chat(TOKENIZER, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                    {"role": "user", "content": "board"}])
    start = encode_chat(TOKENIZER, [{"role": "user", "content": "q"}]) + turn("a")[0]
    assert whole == start + ids


def test_a_game_played_turn_by_turn_is_replayed_to_the_same_reward():
    moves = solution(3)
    first, rest = moves[:1], moves[1:]
    episode = play(GAME, 3, [f"<answer>{first}</answer>", f"<answer>{' '.join(rest)}</answer>"])
    assert episode.done and episode.reward == pytest.approx(1.0)
    completion = episode.completion()
    assert len(completion.observations) == 1 and completion.model_mask().sum() < len(completion.token_ids)
    observed = completion.token_ids[completion.observations[0].at:][:completion.observations[0].tokens]
    assert "Your next moves?" in TOKENIZER.decode(observed.tolist())
    assert rerun(GAME, TOKENIZER, GAME.prompt(3), completion, 4096) == (pytest.approx(1.0), None)


def test_an_unsolved_game_ends_at_its_turn_limit_with_the_format_reward():
    episode = play(GAME, 3, ["<answer>U</answer>", "<answer>D</answer>"] * 2)
    assert episode.done and len(episode.actions) == 4 and episode.reward < 0.1 + 1e-9
    replayed = rerun(GAME, TOKENIZER, GAME.prompt(3), episode.completion(), 4096)
    assert replayed.reason is None and replayed.reward == pytest.approx(episode.reward)


def _lied(completion, **changes):
    return completion.replaced(**changes)


def test_a_sampler_lying_about_the_environment_is_refused_with_a_reason():
    completion = play(GAME, 3, ["<answer>U</answer>", "<answer>D</answer>", "<answer>L</answer>", "<answer>R</answer>"]).completion()
    prompt = GAME.prompt(3)
    ids = completion.token_ids.copy()
    o = completion.observations[0]
    ids[o.at + 3] = TOKENIZER("#", add_special_tokens=False)["input_ids"][0] ^ 1  # a board it was not shown
    assert rerun(GAME, TOKENIZER, prompt, completion.replaced(token_ids=ids), 4096).reason == "observation_mismatch"
    # Cut short after two turns (the rest dropped): the game was not over.
    end = completion.observations[1].at
    short = completion.replaced(token_ids=completion.token_ids[:end], logprobs=completion.logprobs[:end],
                                observations=completion.observations[:1])
    assert rerun(GAME, TOKENIZER, prompt, short, 4096).reason == "episode_cut_short"
    # More turns than the environment allows, and a turn after the game ended.
    assert rerun(SokobanGame({"max_turns": 2}), TOKENIZER, prompt, completion, 4096).reason == "too_many_turns"
    solved = play(GAME, 3, [f"<answer>{solution(3)}</answer>"]).completion()
    board = observation_tokens(TOKENIZER, [{"role": "user", "content": "what next?"}])
    more, logprobs = turn("<answer>U</answer>")
    went_on = solved.replaced(token_ids=np.concatenate([solved.token_ids, board, more]),
                              logprobs=np.concatenate([solved.logprobs, [0.0] * len(board), logprobs]),
                              observations=[Observation(at=len(solved.token_ids), tokens=len(board))])
    assert rerun(GAME, TOKENIZER, prompt, went_on, 4096).reason == "episode_went_on"


def test_an_episode_ends_when_a_turn_is_cut_or_no_room_is_left_for_another():
    cut = play(GAME, 3, ["<answer>U</answer", ], last_ends=False)
    assert cut.done and cut.finish_reason == "length"
    assert rerun(GAME, TOKENIZER, GAME.prompt(3), cut.completion(), 4096).reason is None
    tight = play(GAME, 3, ["<answer>U</answer>"], max_tokens=40)  # the board would not fit
    assert tight.done and not tight.completion().observations


def test_a_single_turn_task_is_the_one_step_case():
    math = load_environment(TaskConfig(name="math"))
    assert isinstance(math, SingleTurn) and math.max_turns == 1
    prompt = math.prompt(12)
    episode = play(math, 12, [f"\\boxed{{{prompt.answer}}}"])
    assert episode.done and episode.reward == Math({}).score(f"\\boxed{{{prompt.answer}}}", prompt).reward == 1.0
    assert not episode.completion().observations
    assert rerun(math, TOKENIZER, prompt, episode.completion(), 4096) == (1.0, None)
    assert isinstance(load_environment(TaskConfig(name="sokoban_game")), SokobanGame)


def test_an_episode_with_no_room_for_the_next_board_is_over_for_the_trainer_too():
    tight = play(GAME, 3, ["<answer>U</answer>"], max_tokens=60)
    assert tight.done and not tight.completion().observations
    assert rerun(GAME, TOKENIZER, GAME.prompt(3), tight.completion(), 60).reason is None
    assert rerun(GAME, TOKENIZER, GAME.prompt(3), tight.completion(), 4096).reason == "episode_cut_short"


def test_the_documented_plug_in_environment_plays_and_replays(tmp_path):
    """docs/operations.md's example environment, as a user would name it (`file.py:Class`)."""
    text = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    section = text[text.index("### Multi-turn environments"):]
    (tmp_path / "guess.py").write_text(section.split("```python\n")[1].split("```")[0])
    env = load_environment(TaskConfig(name=f"{tmp_path / 'guess.py'}:Guess"))
    prompt = env.prompt(5)
    episode = play(env, 5, ["50", "25", prompt.answer])
    completion = episode.completion()
    assert episode.done and completion.claimed_reward == 1.0 and len(completion.observations) == 2
    assert rerun(env, TOKENIZER, prompt, completion, 4096) == (1.0, None)


def test_a_task_declares_whether_it_is_an_environment_and_a_mismatch_is_refused_at_start(tmp_path):
    """Whether a task plays episodes is what it declares (`environment = True`), never guessed
    from its methods: the documented environment without its declaration, or a plain task that
    declares itself one, stops at start with the field named."""
    text = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    guess = text[text.index("### Multi-turn environments"):].split("```python\n")[1].split("```")[0]
    assert "environment = True" in guess
    (tmp_path / "undeclared.py").write_text(guess.replace("    environment = True  # it plays episodes\n", ""))
    with pytest.raises(ConfigError, match="environment = False but it plays episode"):
        load_environment(TaskConfig(name=f"{tmp_path / 'undeclared.py'}:Guess"))
    (tmp_path / "claims.py").write_text("from echo.tasks.math import Math\n\n\nclass Claims(Math):\n"
                                        "    environment = True\n")
    with pytest.raises(ConfigError, match="environment = True but it has no episode"):
        load_environment(TaskConfig(name=f"{tmp_path / 'claims.py'}:Claims"))
    assert not is_environment(load_environment(TaskConfig(name="math")).task)  # a plain task, one turn


def test_a_calculator_call_is_answered_and_a_lie_about_its_result_is_refused():
    tools = load_environment(TaskConfig(name="math_tools", params={"levels": [2]}))
    prompt = tools.prompt(3)
    episode = play(tools, 3, ["let me see <calc>(2 + 3) * 4</calc>", f"so \\boxed{{{prompt.answer}}}"])
    completion = episode.completion()
    assert episode.done and completion.claimed_reward == 1.0 and len(completion.observations) == 1
    answer = completion.token_ids[completion.observations[0].at:][:completion.observations[0].tokens]
    assert TOKENIZER.decode(answer.tolist()) == "\n<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n"
    assert rerun(tools, TOKENIZER, prompt, completion, 4096) == (1.0, None)
    ids = completion.token_ids.copy()
    ids[completion.observations[0].at + 7] = TOKENIZER("1", add_special_tokens=False)["input_ids"][0]  # 20 said 10
    assert rerun(tools, TOKENIZER, prompt, completion.replaced(token_ids=ids), 4096).reason == "observation_mismatch"


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(1 + 2) / 4", "0.75"), ("-3 - 4", "-7"), ("10 / 0", "error: ZeroDivisionError"),
    ("__import__('os').system('true')", "error: ValueError"), ("2 ** 99999", "error: ValueError"),
    ("1e308 * 10", "error: overflow"), ("x" * 300, "error: too long"),
])
def test_the_calculator_computes_arithmetic_and_nothing_else(expression, value):
    assert calculate(expression) == value


class _Broken(SingleTurn):
    def episode(self, prompt):
        return self

    def step(self, action):
        raise RuntimeError("a bug in the environment")


def test_an_environment_that_raises_ends_the_episode_and_the_trainer_refuses_it():
    broken = _Broken(Math({}))
    episode = play(broken, 12, ["\\boxed{1}"])
    assert episode.done and episode.reward == 0.0
    assert rerun(broken, TOKENIZER, broken.prompt(12), episode.completion(), 4096).reason == "environment_error"

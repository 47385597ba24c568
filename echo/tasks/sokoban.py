"""Sokoban: push every box onto a goal. Rooms are generated at a configurable size and box
count and kept only if a breadth-first search solves them; the verifier plays the model's moves.

Map symbols: # wall, _ floor, O goal, X box, V box on goal, P player, S player on goal.
"""

from __future__ import annotations

import random
import re
from collections import deque

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo.config import ConfigError
from echo.tasks import GeneratedTask, Prompt, Score, Step, parse_params

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}

Cell = tuple[int, int]


class SokobanParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(5, ge=3, le=10)  # of the floor inside the outer wall
    height: int = Field(5, ge=3, le=10)
    boxes: int = Field(1, ge=1, le=4)
    walls: int = Field(2, ge=0)  # extra wall cells inside the room
    max_solution: int = Field(12, ge=1)  # keep rooms whose shortest solution is at most this long
    partial_credit: float = Field(0.0, ge=0, le=1)  # weight of the fraction of boxes on goals
    format_reward: float = Field(0.1, ge=0, le=1)  # a well-formed move list that does not solve it

    @model_validator(mode="after")
    def _fits(self):
        if self.walls + 2 * self.boxes + 1 > self.width * self.height:
            raise ValueError(f"walls + 2 x boxes + the player ({self.walls + 2 * self.boxes + 1} cells) do not fit "
                             f"a {self.width} x {self.height} floor")
        return self


class Room:
    def __init__(self, walls: set[Cell], goals: frozenset[Cell], boxes: frozenset[Cell], player: Cell, shape: Cell):
        self.walls, self.goals, self.boxes, self.player, self.shape = walls, goals, boxes, player, shape

    def render(self) -> str:
        rows = []
        for r in range(self.shape[0]):
            row = ""
            for c in range(self.shape[1]):
                cell, goal = (r, c), (r, c) in self.goals
                if cell in self.walls:
                    row += "#"
                elif cell in self.boxes:
                    row += "V" if goal else "X"
                elif cell == self.player:
                    row += "S" if goal else "P"
                else:
                    row += "O" if goal else "_"
            rows.append(row)
        return "\n".join(rows)

    @classmethod
    def parse(cls, text: str) -> "Room":
        walls, goals, boxes, player = set(), set(), set(), None
        rows = text.split("\n")
        for r, row in enumerate(rows):
            for c, ch in enumerate(row):
                if ch == "#":
                    walls.add((r, c))
                if ch in "OVS":
                    goals.add((r, c))
                if ch in "XV":
                    boxes.add((r, c))
                if ch in "PS":
                    player = (r, c)
        return cls(walls, frozenset(goals), frozenset(boxes), player, (len(rows), len(rows[0])))

    def step(self, player: Cell, boxes: frozenset[Cell], move: str) -> tuple[Cell, frozenset[Cell]]:
        """One move; a move into a wall or into a box that cannot be pushed does nothing."""
        dr, dc = MOVES[move]
        target = (player[0] + dr, player[1] + dc)
        if target in self.walls:
            return player, boxes
        if target in boxes:
            beyond = (target[0] + dr, target[1] + dc)
            if beyond in self.walls or beyond in boxes:
                return player, boxes
            boxes = (boxes - {target}) | {beyond}
        return target, boxes

    def play(self, moves: str) -> frozenset[Cell]:
        player, boxes = self.player, self.boxes
        for move in moves:
            player, boxes = self.step(player, boxes, move)
        return boxes

    def solve(self, max_depth: int, max_states: int = 200_000) -> str | None:
        """A shortest solution by breadth-first search, or None within the limits."""
        start = (self.player, self.boxes)
        seen, queue = {start: ""}, deque([start])
        while queue and len(seen) < max_states:
            player, boxes = queue.popleft()
            path = seen[(player, boxes)]
            if boxes == self.goals:
                return path
            if len(path) == max_depth:
                continue
            for move in MOVES:
                state = self.step(player, boxes, move)
                if state not in seen:
                    seen[state] = path + move
                    queue.append(state)
        return None


ROOM_ATTEMPTS = 1000  # random rooms tried for one that solves within max_solution


def make_room(rng: random.Random, p: SokobanParams) -> tuple[Room, str]:
    """A random room with a solution of 1..max_solution moves, and that solution."""
    shape = (p.height + 2, p.width + 2)
    border = {(r, c) for r in range(shape[0]) for c in range(shape[1]) if r in (0, shape[0] - 1) or c in (0, shape[1] - 1)}
    floor = [(r, c) for r in range(1, shape[0] - 1) for c in range(1, shape[1] - 1)]
    for _ in range(ROOM_ATTEMPTS):
        cells = rng.sample(floor, p.walls + 2 * p.boxes + 1)
        walls = border | set(cells[: p.walls])
        goals = frozenset(cells[p.walls : p.walls + p.boxes])
        boxes = frozenset(cells[p.walls + p.boxes : p.walls + 2 * p.boxes])
        room = Room(walls, goals, boxes, cells[-1], shape)
        solution = room.solve(p.max_solution)
        if solution:
            return room, solution
    raise ConfigError(f"task.params: no room of {p.boxes} boxes and {p.walls} walls solved within max_solution "
                      f"{p.max_solution} moves in {ROOM_ATTEMPTS} tries: allow more moves, or fewer boxes or walls")


class Sokoban(GeneratedTask):
    name = "sokoban"

    def __init__(self, params: dict):
        self.p = parse_params(SokobanParams, params)
        make_room(random.Random(0), self.p)  # settings no room can meet fail here, at start

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        room, _ = make_room(rng, self.p)
        question = (
            "Solve this Sokoban puzzle: push every box onto a goal. You can push a box but not pull it.\n"
            "# wall, _ floor, O goal, X box, V box on goal, P you, S you on a goal.\n\n"
            f"{room.render()}\n\n"
            "Rows are numbered from the top. U moves up, D down, L left, R right. "
            "Answer with the moves inside <answer></answer>, like <answer>R R U</answer>."
        )
        return [{"role": "user", "content": question}], room.render()

    def score(self, completion: str, prompt: Prompt) -> Score:
        moves = _moves(completion)
        if not moves:
            return Score(0.0, format_ok=False, correct=False)
        room = Room.parse(prompt.answer)
        on_goal = len(room.play(moves) & room.goals)
        if on_goal == len(room.goals):
            return Score(1.0, format_ok=True, correct=True)
        reward = max(self.p.format_reward, self.p.partial_credit * on_goal / len(room.goals))
        return Score(reward, format_ok=True, correct=False)


class GameParams(SokobanParams):
    max_turns: int = Field(8, ge=1, le=64)  # model turns an episode may take


GAME_RULES = ("Push every box onto a goal. You can push a box but not pull it.\n"
              "# wall, _ floor, O goal, X box, V box on goal, P you, S you on a goal. "
              "U moves up, D down, L left, R right.")


class SokobanGame(Sokoban):
    """Sokoban played a few moves a turn (an environment, echo/tasks/episodes.py): the model
    answers with its next moves, and sees the board they lead to, until every box is on a goal
    or its turns run out. The reward: 1 when it solves the room; a well-formed turn that does
    not earns format_reward / max_turns; a turn with no well-formed moves is told so, and sees
    the board again."""

    name = "sokoban_game"
    environment = True

    def __init__(self, params: dict):
        self.p = parse_params(GameParams, params)
        self.max_turns = self.p.max_turns
        make_room(random.Random(0), self.p)

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        room, _ = make_room(rng, self.p)
        question = (f"Let's play Sokoban. {GAME_RULES}\n\n{room.render()}\n\n"
                    "Answer with your next move or few inside <answer></answer>, like <answer>R U</answer>; "
                    "you will see the board after them.")
        return [{"role": "user", "content": question}], room.render()

    def episode(self, prompt: Prompt) -> "Game":
        return Game(Room.parse(prompt.answer), self.p)


class Game:
    """One episode of SokobanGame: the room as the moves so far left it."""

    def __init__(self, room: Room, p: GameParams):
        self.room, self.p = room, p
        self.player, self.boxes, self.earned = room.player, room.boxes, 0.0

    def step(self, action: str) -> Step:
        moves = _moves(action)
        for move in moves:
            self.player, self.boxes = self.room.step(self.player, self.boxes, move)
        if self.boxes == self.room.goals:
            return Step([], 1.0 - self.earned, done=True)
        reward = self.p.format_reward / self.p.max_turns if moves else 0.0
        self.earned += reward
        board = Room(self.room.walls, self.room.goals, self.boxes, self.player, self.room.shape).render()
        said = "Your next moves?" if moves else "No moves found: answer like <answer>R U</answer>. Your next moves?"
        return Step([{"role": "user", "content": f"{board}\n\n{said}"}], reward, done=False)


def _moves(text: str) -> str:
    """The moves in the last <answer></answer> of `text` ("" when there is none or one is not a move)."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    moves = re.sub(r"[\s,]", "", found[-1]).upper() if found else ""
    return "" if set(moves) - set(MOVES) else moves

"""Reading rows from a user's file, a batch at a time: JSON Lines, a JSON array, parquet, an arrow
stream, or a folder a `datasets` Dataset was saved to. Used by the dataset task
(echo/tasks/dataset.py) and the math task's own problems (echo/tasks/math.py); no I/O but the
file's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson

from echo.config import ConfigError

BATCH_ROWS = 4096  # rows read from a file at a time


def read_rows(path: str, split: str = "train", field: str = "task.params.path") -> Iterator[list[dict]]:
    """The file's rows, a batch at a time; a file that is not what its name says is one line
    naming `field`, the config's key that gave the path."""
    where = existing(path, field)
    try:
        if where.is_dir():
            yield from _saved_dataset(where, split)
        elif where.suffix == ".parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(where).iter_batches(batch_size=BATCH_ROWS):
                yield batch.to_pylist()
        elif where.suffix == ".arrow":
            yield from _arrow_stream(where)
        elif where.suffix in (".jsonl", ".json"):
            yield from _json_rows(where, field)
        else:
            raise ConfigError(f"{field} {path}: not .jsonl, .json, .parquet, .arrow or a saved dataset's "
                              "folder")
    except ConfigError:
        raise
    except ImportError:
        raise ConfigError(f"{field} {path}: reading it needs pyarrow (pip install 'echo-rl[full]')") from None
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"{field} {path}: not a {where.suffix or 'dataset'} file it can read "
                          f"({str(e).splitlines()[0][:200]})") from None


def existing(path: str, field: str = "task.params.path") -> Path:
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"{field} {path}: no such file or folder")
    return where


def _json_rows(path: Path, field: str) -> Iterator[list[dict]]:
    with open(path, "rb") as f:
        first = f.read(1024).lstrip()[:1]
        f.seek(0)
        if first == b"[":  # a JSON array is read whole: JSON Lines or parquet for a large file
            rows = orjson.loads(f.read())
            for start in range(0, len(rows), BATCH_ROWS):
                yield rows[start : start + BATCH_ROWS]
            return
        batch = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                batch.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                raise ConfigError(f"{field} {path}, line {number}: not JSON ({e})") from None
            if len(batch) == BATCH_ROWS:
                yield batch
                batch = []
        yield batch


def _arrow_stream(path: Path) -> Iterator[list[dict]]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        for batch in pa.ipc.open_stream(source):
            yield batch.to_pylist()


def _saved_dataset(folder: Path, split: str) -> Iterator[list[dict]]:
    """A `datasets` Dataset's save_to_disk folder (arrow files listed in state.json), or a
    DatasetDict's (a folder a split)."""
    if (folder / "dataset_dict.json").exists():
        splits = orjson.loads((folder / "dataset_dict.json").read_bytes()).get("splits", [])
        if split not in splits:
            raise ConfigError(f"task.params.split {split!r}: {folder} holds the splits {', '.join(splits)}")
        folder = folder / split
    if not (folder / "state.json").exists():
        raise ConfigError(f"task.params.path {folder}: a folder, but not one a dataset was saved to (no state.json)")
    for data_file in orjson.loads((folder / "state.json").read_bytes())["_data_files"]:
        yield from _arrow_stream(folder / data_file["filename"])

"""Columnar corpus sources, read with pyarrow (the optional extra: `pip install 'pretraining[formats]'`).

- Parquet: a `.parquet` file, or a directory holding some (every one below it, in sorted order).
  A row's default id is `<file name>:<row>`.
- A Hugging Face `datasets` dataset saved with `Dataset.save_to_disk`: a directory holding
  `state.json`, `dataset_info.json` and Arrow IPC stream files `data-XXXXX-of-XXXXX.arrow`, read
  in the order `state.json`'s `_data_files` lists them (as `Dataset.load_from_disk` does), with
  pyarrow alone. A row's default id is `<directory name>:<row>`, counted over the whole dataset, so
  that saving it again in another number of files keeps every row's split. A `DatasetDict`
  (`dataset_dict.json` and one such directory per split) is refused: one split is passed by name.

Both read the same columns: `text_fields` maps document fields to columns (`txt` <- `text`, or
`query.txt` and `passage.txt` for pairs), and an optional id column replaces the default id. Every
file's columns are checked before the first row is read; rows are then read in record batches,
never a whole file at once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pretraining.data.documents import CorpusError, Document
from pretraining.errors import MissingExtraError

BATCH_ROWS = 1024
DATASET_FILES = ("state.json", "dataset_info.json")  # both are written by save_to_disk, and needed by load_from_disk
DATASET_DICT = "dataset_dict.json"
OPTIONS = {"txt": "--text-field", "query.txt": "--query-field", "passage.txt": "--passage-field"}


def is_table_source(path: Path) -> bool:
    """A `.parquet` file, a saved dataset (or `DatasetDict`), or a directory holding `.parquet` files."""
    if path.is_dir():
        return is_saved_dataset(path) or (path / DATASET_DICT).is_file() or any(path.rglob("*.parquet"))
    return path.suffix == ".parquet"


def _other_files(directory: Path) -> list[Path]:
    """The files of a Parquet directory that are not Parquet, leaving out hidden ones and those a writer
    adds beside its parts (Spark's `_SUCCESS`, `_metadata`)."""
    return sorted(
        path
        for path in directory.rglob("*")
        if path.is_file()
        and path.suffix != ".parquet"
        and not any(part.startswith((".", "_")) for part in path.relative_to(directory).parts)
    )


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' `Dataset.save_to_disk`."""
    return all((path / name).is_file() for name in DATASET_FILES)


def read_table_source(path: Path, text_fields: dict[str, str], id_field: str | None = None) -> Iterator[Document]:
    """The documents of a Parquet or saved-dataset source (see the module's docstring)."""
    pa = _pyarrow(path)
    if (path / DATASET_DICT).is_file():
        raise CorpusError(_dataset_dict_message(path))
    if is_saved_dataset(path):
        files = _dataset_files(path)
        for file in files:
            _check_columns(pa, file, _arrow_schema(pa, file), text_fields, id_field)
        return _documents(_arrow_batches(pa, files), text_fields, id_field, prefix=path.name)
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    if path.is_dir() and (others := _other_files(path)):
        raise CorpusError(
            f"{path} holds {len(files)} .parquet files and {len(others)} other files ({others[0]}, ...): a source is a "
            f"Parquet directory or a text directory, not both: pass the Parquet files' own directory, or move them out"
        )
    for file in files:
        _check_columns(pa, file, _parquet_schema(pa, file), text_fields, id_field)
    columns = list(dict.fromkeys([*text_fields.values(), *([id_field] if id_field else [])]))
    return _documents(_parquet_batches(pa, files, columns), text_fields, id_field)


def _documents(
    batches: Iterator[tuple[Path, Any]], text_fields: dict[str, str], id_field: str | None, prefix: str | None = None
) -> Iterator[Document]:
    """One document per row of (file, record batch); the default id is `<prefix or file name>:<row>`."""
    rows: Counter[str] = Counter()
    for file, batch in batches:
        texts = {name: batch.column(column).to_pylist() for name, column in text_fields.items()}
        ids = batch.column(id_field).to_pylist() if id_field else None
        name = prefix or file.name
        for index in range(batch.num_rows):
            row = rows[name]
            rows[name] += 1
            if ids is not None and ids[index] is None:
                message = f"{file}: row {row} of {name} has a null {id_field!r}"
                raise CorpusError(f"{message}; fill in the ids or drop --id-field")
            source_id = str(ids[index]) if ids is not None else f"{name}:{row}"
            row_texts = {field: values[index] for field, values in texts.items()}
            # A null text drops the row, counted with the undecodable documents: real tables have a few
            # such rows, and one should not stop a long build. A column that is not text stops it up front.
            if any(text is None for text in row_texts.values()):
                yield Document(source_id, None)
            else:
                yield Document(source_id, row_texts)


def _parquet_batches(pa: Any, files: list[Path], columns: list[str]) -> Iterator[tuple[Path, Any]]:
    for file in files:
        with pa.parquet.ParquetFile(file) as table:
            for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                yield file, batch


def _arrow_batches(pa: Any, files: list[Path]) -> Iterator[tuple[Path, Any]]:
    for file in files:
        with pa.memory_map(str(file)) as source:  # mapped, not read: the batches are views of the file
            for batch in pa.ipc.open_stream(source):
                yield file, batch


def _parquet_schema(pa: Any, file: Path) -> Any:
    try:
        return pa.parquet.read_schema(file)
    except pa.ArrowException as error:
        raise CorpusError(f"{file} is not a readable Parquet file ({error}); replace or remove it") from error


def _arrow_schema(pa: Any, file: Path) -> Any:
    try:
        with pa.memory_map(str(file)) as source:
            return pa.ipc.open_stream(source).schema
    except pa.ArrowException as error:
        raise CorpusError(
            f"{file} is not an Arrow IPC stream as save_to_disk writes ({error}); save the dataset again"
        ) from error


def _check_columns(pa: Any, file: Path, schema: Any, text_fields: dict[str, str], id_field: str | None) -> None:
    """Each named column exists, and each text column holds strings."""
    options = {column: OPTIONS.get(name, "--text-field") for name, column in text_fields.items()}
    for column, option in [*options.items(), *([(id_field, "--id-field")] if id_field else [])]:
        if column not in schema.names:
            present = ", ".join(repr(name) for name in schema.names[:20])
            more = f" and {len(schema.names) - 20} more" if len(schema.names) > 20 else ""
            raise CorpusError(f"{file} has no column {column!r} (it has {present}{more}); name the right one: {option}")
    for column, option in options.items():
        kind = schema.field(column).type
        value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)):
            raise CorpusError(f"column {column!r} of {file} holds {kind}, not text; name a string column with {option}")


def _dataset_files(path: Path) -> list[Path]:
    """The data files of a saved dataset, in `state.json`'s order."""
    state = path / "state.json"
    try:
        files = [path / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise CorpusError(
            f"{state} lists no _data_files ({error!r}); is {path} a dataset written by datasets' save_to_disk?"
        ) from error
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CorpusError(f"{state} lists files that are missing: {', '.join(missing)}; copy the whole directory")
    return files


def _dataset_dict_message(path: Path) -> str:
    splits = sorted(split.name for split in path.iterdir() if is_saved_dataset(split))
    example = "train" if "train" in splits else splits[0] if splits else "<split>"
    return (
        f"{path} is a datasets DatasetDict with splits {', '.join(splits) or '(none found)'}: pass one of them, "
        f"e.g. --source {path / example} (the build makes its own train/validation split by id, "
        f"so another split such as a test set must not be mixed into training unseen)"
    )


def _pyarrow(path: Path) -> Any:
    """pyarrow, imported only where it is used: it is an optional extra."""
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as error:
        raise MissingExtraError(f"reading {path} (pyarrow)", "formats") from error
    return pyarrow

"""The Ray Data source that streams raw rows from the job's files (the only data module that imports Ray Data)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from ray.data.datasource import FileBasedDatasource

from raylora.data.read import EXTENSIONS, iter_blocks


class RawRowsDatasource(FileBasedDatasource):
    """Ray Data source of ``{source, line, raw, error}`` rows, streamed from each file in blocks."""

    _FILE_EXTENSIONS = [e.lstrip(".") for e in EXTENSIONS]

    def __init__(self, paths: list[str], max_rows_per_file: int | None = None, rows_per_block: int = 2048):
        super().__init__(paths)
        self.max_rows_per_file = max_rows_per_file
        self.rows_per_block = rows_per_block

    def _open_input_source(self, filesystem, path: str, **open_args) -> pa.NativeFile:
        # Parquet needs random access (its footer comes last), and CSV a second look at its header (to read every
        # column as text); the other formats stream.
        if path.lower().endswith((".parquet", ".csv")):
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        return iter_blocks(f, path, self.max_rows_per_file, self.rows_per_block)

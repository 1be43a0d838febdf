"""JSON-lines manifests read row by row with the ``json`` module, every value as written.

``datasets.Dataset.from_json`` infers one Arrow type per column: a single row answering with a
JSON number (``"answer": 30``) turns the whole answer column into a JSON/number type, so the string
``"1.50"`` arrives as ``"1.5"``, ``"007"`` as ``"7"``, ``"1e3"`` as ``"1000.0"``, and rows whose
answer is the string ``"true"``, ``"null"`` or ``"[1, 2]"`` fail the inferred schema. Reading each
line with ``json.loads`` keeps every string byte-exact and every other value in its JSON type; the
dataset then decides what a non-string value means (``data/dataset.py`` converts a non-string
answer to its JSON text and counts it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union


class BadLine(ValueError):
    """A line that is not a JSON object (a corrupt sample: the caller skips and counts it)."""


class JsonRows:
    """The rows of one ``.jsonl`` file (or a ``.json`` file holding one array of objects).

    Args:
        path: the file. Blank lines are ignored; a line that does not parse as a JSON object is
            kept as a bad row (``__getitem__`` raises :class:`BadLine` for it).

    Attributes:
        column_names: keys of all object rows, in order of first appearance.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a JSON-array file is not UTF-8 JSON, the file holds no rows, or no row is a
            JSON object (a line that is not UTF-8 is a bad row, like one that is not JSON).
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {self.path}")
        data = self.path.read_bytes()
        self._rows: list[Union[dict, BadLine]] = []
        if data.lstrip().startswith(b"["):  # a .json file holding one array of rows
            try:
                values = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{self.path}: cannot read as a JSON array of rows: {err}") from err
            self._rows = [self._row(value, f"{self.path} element {i}") for i, value in enumerate(values)]
        else:
            for number, raw in enumerate(data.splitlines(), start=1):
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as err:
                    self._rows.append(BadLine(f"{self.path} line {number} is not UTF-8 text: {err}"))
                    continue
                except json.JSONDecodeError as err:
                    self._rows.append(BadLine(f"{self.path} line {number} is not valid JSON: {err}"))
                    continue
                self._rows.append(self._row(value, f"{self.path} line {number}"))
        if not self._rows:
            raise ValueError(f"{self.path}: the dataset is empty (0 rows)")
        if not any(isinstance(row, dict) for row in self._rows):
            raise ValueError(f"no row of {self.path} is a JSON object ({len(self._rows)} bad); first: {self._rows[0]}")
        names: dict[str, None] = {}
        for row in self._rows:
            if isinstance(row, dict):
                names.update(dict.fromkeys(row))
        self.column_names = list(names)

    @staticmethod
    def _row(value: Any, where: str) -> Union[dict, BadLine]:
        if isinstance(value, dict):
            return value
        return BadLine(f"{where} is a JSON {type(value).__name__}, expected an object with the row's columns")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict:
        """Row ``index`` as parsed (strings byte-exact).

        Raises:
            BadLine: the row's line is not a JSON object.
        """
        row = self._rows[index]
        if isinstance(row, BadLine):
            raise row
        return row

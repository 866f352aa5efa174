"""Ground-truth labels for classification: a `filename<TAB>class_index` file, or one folder per class."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qtool.errors import QtoolError

if TYPE_CHECKING:
    from qtool.data.dataset import DataSource, MemorySource

FOLDERS = "folders"


class Labels:
    def __init__(self, by_key: dict[str, int]):
        self.by_key = by_key
        self.by_name = {Path(k).name: v for k, v in by_key.items()}

    def get(self, key: str) -> Optional[int]:
        if key in self.by_key:
            return self.by_key[key]
        return self.by_name.get(Path(key).name)

    def __len__(self) -> int:
        return len(self.by_key)


def read_label_file(path: str | Path) -> Labels:
    """`filename<TAB>class_index[<TAB>anything...]` per line; '#' comments and blank lines ignored."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise QtoolError(f"cannot read labels: {exc.strerror}", path) from None
    by_key: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        try:
            by_key[fields[0].strip()] = int(fields[1])
        except (IndexError, ValueError):
            raise QtoolError(f"line {number}: expected 'filename<TAB>class_index', got {line[:60]!r}", path) from None
    if not by_key:
        raise QtoolError("no labels in file", path)
    return Labels(by_key)


def labels_from_folders(keys: list[str], root: Path) -> Labels:
    """Class = the sample's top-level folder: its number if every folder is a number,
    else its position in sorted order (as torchvision's ImageFolder does)."""
    folders = sorted({k.split("/")[0] for k in keys if "/" in k})
    if not folders:
        raise QtoolError("--labels folders needs one sub-folder per class", root)
    numeric = all(f.isdigit() for f in folders)
    index = {f: (int(f) if numeric else i) for i, f in enumerate(folders)}
    return Labels({k: index[k.split("/")[0]] for k in keys if "/" in k})


def labels_for(source: DataSource | MemorySource, labels: str | Path) -> Labels:
    """The labels of a data folder's samples: from a label file, or from the folders (`labels` = "folders")."""
    if source.root is None:
        raise QtoolError("labels name the files of a data folder; in-memory data has none (give the data as a "
                         "folder, or leave out the labels)")
    keys = [source.key(p) for p in source.files]
    if labels == FOLDERS:
        return labels_from_folders(keys, source.root)
    found = read_label_file(labels)
    if not any(found.get(k) is not None for k in keys):
        raise QtoolError(f"no file of {source.root} has a label in this file", labels)
    return found

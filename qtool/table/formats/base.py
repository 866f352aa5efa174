"""The types the format modules are written in: `TableFormat` (how to recognise, read and write one
kind of file) and the `FormatContext` a read or write gets. The package, qtool.table.formats,
lists the formats in detection order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from qtool.config import QuantizeConfig
from qtool.errors import QtoolError
from qtool.table.formats.model_view import ModelView
from qtool.table.table import CalibrationTable


@dataclass(frozen=True)
class FormatContext:
    options: QuantizeConfig = field(default_factory=QuantizeConfig)
    model: Optional[ModelView] = None
    path: object = None  # the file being read or written, for messages

    def require_model(self, format_name: str) -> ModelView:
        if self.model is None:
            raise QtoolError(f"{format_name} tables name layers, not tensors: give the model (--model) "
                             "to map them", self.path)
        return self.model


@dataclass(frozen=True)
class TableFormat:
    name: str
    description: str
    detect: Callable[[bytes], bool]
    read: Callable[[bytes, FormatContext], CalibrationTable]
    write: Callable[[CalibrationTable, FormatContext], bytes]
    by_layer: bool = False

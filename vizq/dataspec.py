"""Which data a run uses, as a value: :class:`DataSpec` (bundled / folder / uploads / text file).

Every service call takes one, every result and history record stores its :meth:`DataSpec.record`,
and the dashboard shows its :meth:`DataSpec.label`, so what the page says and what the run used
are the same thing by construction.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .data import DataError, ImageSet


class Source(str, Enum):
    BUNDLED = "bundled"  # the model family's own samples
    FOLDER = "folder"  # an ImageFolder or a flat folder of images
    UPLOAD = "upload"  # files uploaded in the dashboard (bytes)
    TEXT = "text"  # a UTF-8 file, one sentence per line (text models)


@dataclass(frozen=True)
class DataSpec:
    source: Source = Source.BUNDLED
    path: str = ""
    files: tuple[tuple[str, bytes], ...] = ()

    # ------------------------------------------------------------ constructors
    @classmethod
    def bundled(cls) -> "DataSpec":
        return cls()

    @classmethod
    def folder(cls, path: str | Path) -> "DataSpec":
        return cls(Source.FOLDER, str(Path(path).expanduser()))

    @classmethod
    def text_file(cls, path: str | Path) -> "DataSpec":
        return cls(Source.TEXT, str(Path(path).expanduser()))

    @classmethod
    def uploads(cls, files: Any) -> "DataSpec":
        files = tuple((str(n), bytes(b)) for n, b in files)
        if not files:
            raise DataError("no files were uploaded; upload images (or a text file) or pick another data source")
        return cls(Source.UPLOAD, files=files)

    @classmethod
    def of(cls, data: "DataSpec | str | Path | None") -> "DataSpec":
        """The CLI's and the library's ``data`` argument: ``None``/``'bundled'``, a folder, or a
        text file (a path to a file), or a DataSpec already."""
        if isinstance(data, DataSpec):
            return data
        if data is None or str(data) in ("", "bundled"):
            return cls()
        p = Path(str(data)).expanduser()
        return cls.text_file(p) if p.is_file() else cls.folder(p)

    # ------------------------------------------------------------ what it is
    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name, data in self.files:
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()[:12]

    def key(self) -> str:
        """Stable identity: two runs compare only when their keys are equal."""
        if self.source is Source.BUNDLED:
            return "bundled"
        if self.source is Source.UPLOAD:
            return f"upload:{self.digest}"
        return f"{self.source.value}:{self.path}"

    def record(self) -> dict[str, Any]:
        """What history records and manifests store (no bytes)."""
        out: dict[str, Any] = {"source": self.source.value, "key": self.key()}
        if self.path:
            out["path"] = self.path
        if self.files:
            out["files"] = [n for n, _ in self.files]
        return out

    def label(self, loaded: Any) -> str:
        """What the dashboard says the data is, for this model."""
        if self.source is Source.BUNDLED:
            return loaded.family.samples_label
        if self.source is Source.UPLOAD:
            return f"{len(self.files)} uploaded file(s)"
        return f"{'text file' if self.source is Source.TEXT else 'folder'} {self.path}"

    # ------------------------------------------------------------ reading
    def open(self, loaded: Any, part: str = "eval") -> ImageSet:
        """The samples, read the way ``loaded``'s family reads them; ``part`` ('calib'/'eval')
        matters only for families whose own samples are split."""
        if part not in ("calib", "eval"):
            raise DataError(f"part must be 'calib' or 'eval', got {part!r}")
        if self.source is Source.BUNDLED:
            return loaded.family.samples(part)
        if self.source is Source.UPLOAD:
            return loaded.family.open_uploads(loaded, self.files)
        return loaded.family.open(loaded, self.path)

    def own_split(self, loaded: Any) -> bool:
        """True when calibration and evaluation come from disjoint parts the family defines."""
        return self.source is Source.BUNDLED and loaded.family.own_split

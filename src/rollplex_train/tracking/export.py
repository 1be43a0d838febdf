"""Export the trained actor as a Hugging Face checkpoint directory, atomically."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from rollplex_train.tracking.checkpoint import TMP_PREFIX, fsync_tree, replace_dir

__all__ = ["EXTRA_FILE_PATTERNS", "export_hf"]

log = logging.getLogger(__name__)

# Files of the source checkpoint that the model/tokenizer do not write themselves (processor
# configs, chat templates). Copied only when the export does not already hold a file of that name.
EXTRA_FILE_PATTERNS = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template*",
)


def export_hf(
    model: Any,
    tokenizer: Any,
    out_dir: str | Path,
    extra_files_from: Optional[str | Path] = None,
) -> Path:
    """Write ``model`` (+ ``tokenizer``) as a ``from_pretrained``-loadable directory ``out_dir``.

    Steps: ``model.save_pretrained(tmp, safe_serialization=True)``,
    ``tokenizer.save_pretrained(tmp)``, copy ``preprocessor_config.json``,
    ``video_preprocessor_config.json``, ``processor_config.json`` and ``chat_template*`` from
    ``extra_files_from`` when present there and not already written, fsync every file, then rename
    ``tmp`` to ``out_dir`` atomically (an older export at ``out_dir`` is replaced). ``tmp`` is
    ``<out_dir.parent>/.tmp-<out_dir.name>-<pid>``; on any error it is removed and an older export
    is left untouched.

    Args:
        model: A ``transformers.PreTrainedModel`` (weights on any device; saved as safetensors).
        tokenizer: Anything with ``save_pretrained(dir)`` (tokenizer or processor), or ``None``.
        out_dir: Target directory, e.g. ``<output_dir>/hf_actor``.
        extra_files_from: The source checkpoint directory (``model.path``), or ``None``.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileNotFoundError: ``extra_files_from`` is given but is not a directory (named).
    """
    out_dir = Path(out_dir)
    source = Path(extra_files_from) if extra_files_from is not None else None
    if source is not None and not source.is_dir():
        raise FileNotFoundError(f"export_hf: source checkpoint directory not found: {source}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f"{TMP_PREFIX}{out_dir.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if source is not None:
            _copy_extra_files(source, tmp)
        fsync_tree(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported HF checkpoint to %s", out_dir)
    return out_dir


def _copy_extra_files(source: Path, dest: Path) -> None:
    for pattern in EXTRA_FILE_PATTERNS:
        for src in sorted(source.glob(pattern)):
            if not src.is_file():
                continue
            target = dest / src.name
            if target.exists():
                log.debug("export_hf: keeping %s written by save_pretrained over %s", target.name, src)
                continue
            shutil.copy2(src, target)

"""A candidate as the scorers see it: its model loaded once for every in-process scorer, its folder written once for
every scorer that runs a program (a command, vLLM).

A candidate built on disk is its folder. One built in memory is loaded from the base's config and the merged
tensors (``load_model``), and, when a scorer needs a folder, written to a temporary one (``io.memory.save_copy``:
model.safetensors, config, tokenizer files), removed when the candidate has been scored. Both load in float32, so
a candidate scores the same in memory and on disk.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..sweeping.build import Built


def load_model(built: Built) -> tuple[Any, Any]:
    """(float32 causal LM in eval mode, tokenizer) of a built candidate, from disk or from memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..lab.evaluate import load_checkpoint
    from ..lab.tokenizer import load_tokenizer

    if built.path is not None:  # (a reference without tokenizer files: side_dir is the base's folder)
        return load_checkpoint(built.path, built.side_dir)
    assert built.tensors is not None  # built in memory
    config = AutoConfig.from_pretrained(built.side_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in built.tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"the merged tensors do not fit {type(model).__name__}: missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}", file=str(built.side_dir))
    if (Path(built.side_dir) / "generation_config.json").is_file():  # as from_pretrained reads it from a folder
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(built.side_dir)
    model.eval()
    return model, load_tokenizer(built.side_dir)


class Subject:
    """One candidate for the scorers (a context manager: a temporary folder is removed on exit)."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self._model: tuple[Any, Any] | None = None
        self._temp: Path | None = None

    @property
    def id(self) -> str:
        return self.built.candidate.id

    def model(self) -> tuple[Any, Any]:
        """(model, tokenizer), loaded on first use."""
        if self._model is None:
            self._model = load_model(self.built)
        return self._model

    def release_model(self) -> None:
        self._model = None

    def folder(self) -> Path:
        """The candidate's checkpoint folder: where it was built, or a temporary copy of the one in memory."""
        if self.built.path is not None:
            return self.built.path
        if self._temp is None:
            from ..io.memory import save_copy

            assert self.built.tensors is not None
            files = self.built.files
            if files is None:  # a Built made outside the sweep: the base's side files
                from ..io.checkpoint import SIDE_FILES

                files = {n: (self.built.side_dir / n).read_bytes() for n in SIDE_FILES
                         if (self.built.side_dir / n).is_file()}
            temp = Path(tempfile.mkdtemp(prefix=f"rlmerge-candidate-{self.id}-"))
            self._temp = temp  # removed on exit even if writing it fails half-way
            save_copy(temp, self.built.tensors, files)
        return self._temp

    def __enter__(self) -> Subject:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release_model()
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)  # a folder this process made (mkdtemp), never followed
            self._temp = None

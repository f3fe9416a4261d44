"""A model folder's `tokenizer.json`, read with Hugging Face `tokenizers`; never fetched.

`encode` and `decode` use the library defaults (special tokens added by the file's
post-processor, skipped when decoding), as the Moondream reference does.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelLoadError
from .checkpoint import lfs_pointer


class Tokenizer:
    def __init__(self, path: Path):
        path = Path(path)
        if not path.exists():
            # Moondream 2's own code fetches its tokenizer from another repository: a folder of
            # vikhyatk/moondream2 alone may lack it, and the line says where it is
            raise ModelLoadError(f"{path} is missing: a model folder needs its tokenizer.json (Moondream 2's is "
                                 "the one of the Hugging Face repository moondream/starmie-v1)")
        if not path.is_file():  # a folder or a named pipe there had been said to be missing
            raise ModelLoadError(f"{path} is not a file")
        try:  # a file this user may not read had been "not a valid tokenizer.json: Permission denied"
            open(path, "rb").close()
        except OSError as e:
            raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            if lfs_pointer(path):  # had been "expected value at line 1 column 1"
                raise ModelLoadError(f"{path} is a Git LFS pointer, not the tokenizer (cloned without git-lfs? "
                                     "run git lfs pull there)") from None
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelLoadError(f"{path} is not a valid tokenizer.json: {first_line}") from None
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        """The largest id this tokenizer can produce (ids need not be contiguous)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

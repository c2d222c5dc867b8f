"""One wrapper of a checkpoint's tokenizer.json (the `tokenizers` library): text -> ids, with
special ids looked up by name, never assumed. Chameleon and Janus prompts read theirs through it,
and make their PromptRows with `id_rows`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence

from adt_core.families.contract import PromptRows, token_rows


class TextTokenizer:
    """Text -> ids with a `tokenizers.Tokenizer`; `ids[key]` is the id of `names[key]`.

    `added`: name -> id of special tokens declared beside the file only (tokenizer_config.json's
    added_tokens_decoder); the file's own vocabulary wins where both name a token. `kind` names
    the family in errors ("no token '<s>' (not a Chameleon tokenizer?)")."""

    def __init__(self, tokenizer, names: Mapping[str, str], source: str = "tokenizer",
                 added: Mapping[str, int] | None = None, kind: str = "matching") -> None:
        self.tok = tokenizer
        self.source = source
        self.kind = kind
        self._vocab = {**(added or {}), **tokenizer.get_vocab(with_added_tokens=True)}
        self.names = dict(names)
        self.ids = {k: self.id_of(name) for k, name in self.names.items()}

    def id_of(self, name: str) -> int:
        if name not in self._vocab:
            raise ValueError(f"{self.source}: no token {name!r} (not a {self.kind} tokenizer?)")
        return self._vocab[name]

    def tokens(self) -> Mapping[str, int]:
        """Every token name -> id this tokenizer knows (added ones included)."""
        return self._vocab

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    @property
    def size(self) -> int:
        """1 + the largest id this tokenizer can produce or names."""
        return max(self.tok.get_vocab_size(with_added_tokens=True), max(self._vocab.values()) + 1)


def tokenizer_file(path: str | Path, candidates: Sequence[str]) -> Path:
    """A tokenizer JSON file, or the first of `candidates` (relative names) in a directory."""
    p = Path(path)
    if p.is_dir():
        found = [p / f for f in candidates if (p / f).is_file()]
        if not found:
            raise FileNotFoundError(f"{p}: none of {', '.join(candidates)}")
        p = found[0]
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p}")
    return p


def read_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` of a tokenizer JSON file."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def id_rows(cond: list[list[int]], uncond: Callable[[list[int]], list[int]], cfg: bool, max_prompt: int,
            pad_id: int) -> PromptRows:
    """PromptRows of a token family: the cond id rows (one per prompt), then with CFG the
    uncond row `uncond(cond_row)` of each; a cond row longer than max_prompt is refused."""
    if not cond:
        raise ValueError("no prompts")
    longest = max(len(r) for r in cond)
    if longest > max_prompt:
        raise ValueError(f"a prompt of {longest} tokens with its template; the bundle holds {max_prompt} "
                         "(prompt.max_prompt)")
    rows = cond + [uncond(r) for r in cond] if cfg else cond
    return token_rows(rows, len(cond), pad_id=pad_id)

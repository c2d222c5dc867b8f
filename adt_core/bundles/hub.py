"""hf:// model files through huggingface_hub's own cache.

    hf://<owner>/<repo>[@<revision>]/<path in the repo>

A file (`.../t2i_XL_stage1_256.pt`) goes through `hf_hub_download`, a directory (an empty
path, one ending in "/", or a last segment with no dot: `.../llamagen_drafter`) through
`snapshot_download` with a file filter: the small files (configs, tokenizer files, vocab) and
ONE weight format, the first of safetensors, PyTorch .bin, .pt/.pth the folder has (never
every format a repository carries, e.g. google/flan-t5-xl's TF, Flax and bin copies beside
its safetensors).

Both use the standard Hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub; `models--<owner>--<repo>/snapshots/<commit>/...`), so a model
downloaded before by transformers or `hf download` is reused, and huggingface_hub's own
settings apply: HF_HUB_OFFLINE=1 reads the cache only, HF_TOKEN for gated repositories,
HF_ENDPOINT for a mirror. The caller checks the manifest's sha256 on the returned path.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from adt_core.bundles.sources import split_hf

SMALL_FILES = ("*.json", "*.model", "*.txt")  # config.json, tokenizer*.json, spiece.model, vocab.txt
WEIGHT_FORMATS = (  # in order of preference; a directory gets the first one it has
    ("*.safetensors",),
    ("*.bin",),
    ("*.pt", "*.pth"),
)
INSTALL_HINT = "pip install 'huggingface_hub>=0.34'"


def _hub():
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ImportError(f"hf:// paths need huggingface_hub: {INSTALL_HINT}") from None
    return huggingface_hub, (FileNotFoundError, errors.EntryNotFoundError)  # not cached / not in the repo


def is_directory(sub: str) -> bool:
    """A repo path names a directory when empty, ending in "/", or without a dot in its last segment."""
    return sub == "" or sub.endswith("/") or "." not in sub.rsplit("/", 1)[-1]


def allow_patterns(sub: str, weights: tuple[str, ...]) -> list[str]:
    """The filter for one directory `sub` of a repo: its small files and one weight format."""
    prefix = sub.rstrip("/") + "/" if sub.strip("/") else ""
    return [prefix + p for p in SMALL_FILES + weights]


def _has(folder: Path, patterns: tuple[str, ...]) -> bool:
    """Weights of this format directly in `folder` (where a loader looks for them)."""
    return folder.is_dir() and any(
        f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in patterns) for f in folder.iterdir())


def _not_cached(url: str, error: Exception) -> FileNotFoundError:
    """The error for a file the cache lacks (offline) or the repository lacks, with the
    command that fills the cache the way an online run would."""
    repo, revision, sub = split_hf(url)
    if is_directory(sub):
        what = " --include " + " ".join(f"'{p}'" for p in allow_patterns(sub, WEIGHT_FORMATS[0]))
        what += " (a folder without safetensors: '*.bin' instead)"
    else:
        what = f" {sub}"
    reason = str(error).splitlines()[0] if str(error) else ""
    return FileNotFoundError(
        f"{url}: not in the Hugging Face cache or not in the repository ({type(error).__name__}: {reason}); "
        f"run once with network access (HF_HUB_OFFLINE unset) or fill the cache first: "
        f"hf download {repo} --revision {revision}{what}")


def fetch_file(url: str) -> Path:
    """One file of a repo, from (or into) the Hub cache."""
    hub, missing = _hub()
    repo, revision, sub = split_hf(url)
    try:
        return Path(hub.hf_hub_download(repo, sub, revision=revision))
    except missing as e:
        raise _not_cached(url, e) from None


def fetch_directory(url: str) -> Path:
    """A directory of a repo with its small files and the first weight format it has."""
    hub, missing = _hub()
    repo, revision, sub = split_hf(url)
    first_error: Exception | None = None
    for weights in WEIGHT_FORMATS:
        try:
            snapshot = Path(hub.snapshot_download(repo, revision=revision, allow_patterns=allow_patterns(sub, weights)))
        except missing as e:  # offline: this format is not cached
            first_error = first_error or e
            continue
        folder = snapshot / sub.strip("/") if sub.strip("/") else snapshot
        if _has(folder, weights):
            return folder
    if first_error is not None:
        raise _not_cached(url, first_error) from None
    formats = ", ".join(p for w in WEIGHT_FORMATS for p in w)
    raise FileNotFoundError(f"{url}: no weights ({formats}) in {repo}@{revision}/{sub}")


def fetch_hf(url: str) -> Path:
    """A local path (in the Hub cache) for an hf:// file or directory."""
    _, _, sub = split_hf(url)
    return fetch_directory(url) if is_directory(sub) else fetch_file(url)

"""Bundle manifests: a YAML / JSON file naming the published checkpoints of one model family.

    name: llamagen-t2i-xl-stage1
    grid: 16                      # image tokens per side (or [H, W])
    target:  {path: s3://models/llamagen/t2i_XL_stage1_256.pt, sha256: <hex, optional>}
    drafter: {path: s3://models/lantern/llamagen_drafter/}     # optional; a directory
    vq:      {path: /models/llamagen/vq_ds16_t2i.pt}
    text_encoder: {type: t5, path: s3://models/google/flan-t5-xl/, dtype: bfloat16}
    sampling: {temperature: 1.0, top_k: 1000, top_p: 1.0, cfg_scale: 7.5}

A component is a path string or a mapping with `path` and optional `sha256` (a hex string for
a file, or {relative file: hex} for a directory). Paths are local (relative to the manifest's
folder; ~ and $VARS expanded), s3://bucket/key (a key ending in "/" or naming no object is a
directory prefix) or hf://<owner>/<repo>[@<revision>]/<path in the repo> (a Hugging Face Hub
repository; an empty path or one ending in "/" is a directory). Remote files are downloaded
once into a local cache (`cache_dir`, else $ADT_MODEL_CACHE, else ~/.cache/adt_core/models;
S3 under s3/<bucket>/, the Hub under hf/<owner>/<repo>/<revision>/), checked against the
sha256 when one is given, and reused afterwards without network calls. boto3 follows the
standard AWS environment (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION, credentials
chain) unless the caller passes its own client factory (`s3_client_factory`: the pipeline
passes one built from the job's --storage.* settings, so model and output storage share one
configuration); the Hub through huggingface_hub (HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE).
Nothing about credentials is logged.

`load_manifest_bundle(path)` (also reached through `adt_core.load_bundle(path)`) returns a
`Bundle`. `plan_memory` / `bundle_memory` size what one GPU needs: bytes per component and the
KV cache per image in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from adt_core.config import SamplingConfig
from adt_core.models.bundle import Bundle, build_text_encoder
from adt_core.models.checkpoints import load_lantern_drafter, load_llamagen_gpt, load_vq
from adt_core.models.drafter import Drafter, DrafterConfig
from adt_core.models.gpt import GPTConfig, LlamaGenGPT
from adt_core.models.vq import VQConfig, VQModel

log = logging.getLogger(__name__)

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
CACHE_ENV = "ADT_MODEL_CACHE"
DEFAULT_CACHE = Path("~/.cache/adt_core/models")
# LlamaGen's own sampling defaults (sample_t2i.py). LANTERN's scripts use cfg 3.0, top-k 2000.
LLAMAGEN_SAMPLING = {"temperature": 1.0, "top_k": 1000, "top_p": 1.0, "cfg_scale": 7.5}
TOP_LEVEL = {"name", "grid", "target", "drafter", "vq", "text_encoder", "sampling", "cache_dir", "dtype"}
COMPONENT_KEYS = {"target": {"path", "sha256", "n_head"}, "drafter": {"path", "sha256"}, "vq": {"path", "sha256"}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNK = 8 << 20
VQ_LIVE_MAPS = 4  # full-resolution activations alive at once in a VQ decoder res block (estimate)


class ManifestError(ValueError):
    """A manifest that cannot describe a bundle (bad field, missing file, unset variable)."""


class ChecksumError(ValueError):
    """A file whose sha256 differs from the one the manifest gives."""


# ---- manifest ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    path: str  # local path or s3:// URL, as resolved (variables expanded, relative -> absolute)
    sha256: str | dict[str, str] | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    name: str
    grid: tuple[int, int]  # (H, W) image tokens
    target: Component
    vq: Component
    drafter: Component | None
    text_encoder: dict[str, Any]  # build_text_encoder spec; its "path" may be s3://
    sampling: SamplingConfig
    dtype: str = "float32"  # dtype the weights are loaded in (the Generator casts for decoding)
    cache_dir: str | None = None
    source: str = ""


def is_manifest_path(p: str | os.PathLike) -> bool:
    path = Path(p)
    return path.suffix.lower() in MANIFEST_SUFFIXES and path.is_file()


def _expand(value: str, base: Path, what: str) -> str:
    s = os.path.expandvars(os.path.expanduser(str(value)))
    unset = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", s)
    if unset:
        raise ManifestError(f"{what}: environment variable(s) {', '.join(sorted(set(unset)))} not set in {value!r}")
    if is_s3(s) or is_hf(s) or Path(s).is_absolute():
        return s
    return str((base / s).resolve())


def _component(raw: Any, key: str, base: Path, source: str) -> Component:
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, Mapping) or "path" not in raw:
        raise ManifestError(f"{source}: {key} must be a path or a mapping with 'path'")
    unknown = set(raw) - COMPONENT_KEYS[key]
    if unknown:
        raise ManifestError(f"{source}: {key}: unknown fields {sorted(unknown)} "
                            f"(allowed: {sorted(COMPONENT_KEYS[key])})")
    sha = raw.get("sha256")
    _check_sha_field(sha, f"{source}: {key}.sha256")
    opts = {k: v for k, v in raw.items() if k not in ("path", "sha256")}
    return Component(_expand(raw["path"], base, f"{source}: {key}.path"), sha, opts)


def _check_sha_field(sha: Any, what: str) -> None:
    hexes = [sha] if isinstance(sha, str) else list(sha.values()) if isinstance(sha, Mapping) else []
    if sha is not None and not hexes:
        raise ManifestError(f"{what}: expected a hex string or a mapping of file -> hex string")
    for h in hexes:
        if not isinstance(h, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", h):
            raise ManifestError(f"{what}: {h!r} is not a 64-digit hex sha256")


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and validate a manifest file (no file is read or downloaded yet)."""
    p = Path(path)
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - parse errors of either format
        raise ManifestError(f"{p}: cannot parse: {e}") from None
    src, base = str(p), p.resolve().parent
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{src}: expected a mapping at the top level")
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise ManifestError(f"{src}: unknown fields {sorted(unknown)} (allowed: {sorted(TOP_LEVEL)})")
    missing = [k for k in ("grid", "target", "vq", "text_encoder") if k not in raw]
    if missing:
        raise ManifestError(f"{src}: missing fields {missing}")
    grid = raw["grid"]
    grid = (grid, grid) if isinstance(grid, int) else tuple(grid) if isinstance(grid, (list, tuple)) else None
    if grid is None or len(grid) != 2 or not all(isinstance(g, int) and g > 0 for g in grid):
        raise ManifestError(f"{src}: grid must be a positive int or [H, W], got {raw['grid']!r}")
    te = raw["text_encoder"]
    te = {"type": "t5", "path": te} if isinstance(te, str) else dict(te or {})
    te.setdefault("type", "t5")
    if "sha256" in te:
        _check_sha_field(te["sha256"], f"{src}: text_encoder.sha256")
    for k in ("path", "model_dir"):
        if k in te:
            te[k] = _expand(te[k], base, f"{src}: text_encoder.{k}")
    sampling = {**LLAMAGEN_SAMPLING, **(raw.get("sampling") or {})}
    try:
        samp = SamplingConfig(**sampling)
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{src}: sampling: {e}") from None
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ManifestError(f"{src}: dtype must be one of {list(DTYPES)}, got {dtype!r}")
    cache_dir = _expand(raw["cache_dir"], base, f"{src}: cache_dir") if raw.get("cache_dir") else None
    return Manifest(
        name=str(raw.get("name") or p.stem), grid=(int(grid[0]), int(grid[1])),
        target=_component(raw["target"], "target", base, src), vq=_component(raw["vq"], "vq", base, src),
        drafter=_component(raw["drafter"], "drafter", base, src) if raw.get("drafter") else None,
        text_encoder=te, sampling=samp, dtype=dtype, cache_dir=cache_dir, source=src,
    )


def load_manifest_bundle(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                         s3_client_factory: Callable[[], Any] | None = None) -> Bundle:
    """Read a manifest, fetch what lives in S3 or on the Hub into the local cache, and build the Bundle."""
    m = read_manifest(path)
    cache = LocalCache(cache_dir or m.cache_dir, s3_client_factory)
    dtype = DTYPES[m.dtype]
    t0 = time.perf_counter()
    target = load_llamagen_gpt(cache.fetch(m.target.path, m.target.sha256), grid=m.grid,
                               n_head=m.target.options.get("n_head"), dtype=dtype)
    tc = target.config
    drafter = None
    if m.drafter is not None:
        drafter = load_lantern_drafter(cache.fetch(m.drafter.path, m.drafter.sha256), tc, dtype=dtype)
    vq = load_vq(cache.fetch(m.vq.path, m.vq.sha256))
    spec = {k: v for k, v in m.text_encoder.items() if k != "sha256"}
    for k in ("path", "model_dir"):
        if k in spec:
            spec[k] = str(cache.fetch(spec[k], m.text_encoder.get("sha256")))
    if spec["type"] == "t5":
        spec.setdefault("max_tokens", tc.cls_token_num)
    text = build_text_encoder(spec)
    if (text.max_tokens, text.dim) != (tc.cls_token_num, tc.caption_dim):
        raise ManifestError(f"{m.source}: text encoder gives {text.max_tokens} x {text.dim} caption states, "
                            f"target expects {tc.cls_token_num} x {tc.caption_dim}")
    log.info("bundle %s loaded from %s in %.1f s", m.name, m.source, time.perf_counter() - t0)
    return Bundle(name=m.name, text_encoder=text, target=target, drafter=drafter, vq=vq, grid=m.grid,
                  sampling=m.sampling)


# ---- local cache and S3 ------------------------------------------------------------------
def is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def is_hf(path: str) -> bool:
    return str(path).startswith("hf://")


def split_hf(url: str) -> tuple[str, str, str]:
    """hf://owner/repo[@revision]/path -> (repo id, revision, path in the repo)."""
    parts = url[len("hf://"):].split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ManifestError(f"{url}: expected hf://<owner>/<repo>[@<revision>]/<path>")
    repo, _, revision = parts[1].partition("@")
    sub = parts[2] if len(parts) == 3 else ""
    if any(seg in (".", "..") for seg in sub.split("/")):
        raise ManifestError(f"{url}: '.' or '..' in the path")
    return f"{parts[0]}/{repo}", revision or "main", sub


def split_s3(url: str) -> tuple[str, str]:
    rest = url[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ManifestError(f"{url}: no bucket")
    return bucket, key


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_sha(path: Path, expected: str | None, what: str) -> str | None:
    if expected is None:
        return None
    got = sha256_file(path)
    if got.lower() != expected.lower():
        raise ChecksumError(f"{what}: sha256 {got} does not match the manifest's {expected.lower()}")
    return got


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`, so actors on one node download each file once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def s3_client():
    """A boto3 S3 client from the standard AWS environment (endpoint, region, credentials)."""
    try:
        import boto3
    except ImportError:
        raise ImportError("s3:// paths need boto3: pip install boto3") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.session.Session(region_name=region).client("s3", endpoint_url=endpoint)


class _Progress:
    """Byte progress: a tqdm bar on a terminal, else a log line every 10%."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.done, self.next_log = name, max(total, 1), 0, 0.1
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name, disable=None,
                            leave=False)
            if self.bar.disable:
                self.bar = None
        except ImportError:
            pass

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done / self.total >= self.next_log:
            log.info("%s: %.0f%% of %.1f MB", self.name, 100 * self.done / self.total, self.total / 1e6)
            self.next_log += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LocalCache:
    """Local files as they are; s3:// objects downloaded once under `root/s3/<bucket>/<key>`.

    A finished download leaves `<file>.meta.json` (size, ETag, sha256); a file with one is
    reused without touching the network. Delete the file (or the cache) to force a refresh.
    """

    def __init__(self, root: str | os.PathLike | None = None, s3_client_factory: Callable[[], Any] | None = None) -> None:
        root = root or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
        self.root = Path(root).expanduser()
        self._client = None
        self._client_factory = s3_client_factory or s3_client

    @property
    def client(self):
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def fetch(self, path: str, sha256: str | Mapping[str, str] | None = None) -> Path:
        """A local path for `path` (a file or a directory), downloading S3 / Hub files if needed."""
        if is_hf(path):
            return self._fetch_hf(path, sha256)
        if not is_s3(path):
            p = Path(path)
            if not p.exists():
                raise FileNotFoundError(f"model file not found: {p}")
            self._verify_local(p, sha256)
            return p
        bucket, key = split_s3(path)
        if key and not key.endswith("/"):
            local = self._local(bucket, key)
            if self._cached(local, sha256 if isinstance(sha256, str) else None):
                return local
            head = self._head(bucket, key)
            if head is not None:
                if isinstance(sha256, Mapping):
                    raise ManifestError(f"{path}: is a single object; sha256 must be a hex string")
                return self._download(bucket, key, head, sha256)
        return self._fetch_dir(bucket, key.rstrip("/") + "/" if key else "", sha256)

    # -- local files --
    def _verify_local(self, p: Path, sha256) -> None:
        if sha256 is None:
            return
        if p.is_dir():
            if not isinstance(sha256, Mapping):
                raise ManifestError(f"{p}: is a directory; sha256 must map file names to hex strings")
            for rel, h in sha256.items():
                _check_sha(p / rel, h, str(p / rel))
        else:
            if not isinstance(sha256, str):
                raise ManifestError(f"{p}: is a file; sha256 must be a hex string")
            _check_sha(p, sha256, str(p))

    # -- Hugging Face Hub --
    def _fetch_hf(self, url: str, sha256) -> Path:
        """Download a Hub file or folder into root/hf/<repo>/<revision>/ (huggingface_hub keeps
        its own metadata there, so a second call makes no download) and check its sha256."""
        try:
            import huggingface_hub
        except ImportError:
            raise ImportError("hf:// paths need huggingface_hub: pip install 'huggingface_hub>=0.24'") from None
        repo, revision, sub = split_hf(url)
        local_dir = self.root / "hf" / repo / revision
        is_dir = sub == "" or sub.endswith("/")
        if is_dir and sha256 is not None and not isinstance(sha256, Mapping):
            raise ManifestError(f"{url}: is a directory; sha256 must map file names to hex strings")
        if not is_dir and isinstance(sha256, Mapping):
            raise ManifestError(f"{url}: is a single file; sha256 must be a hex string")
        with _locked(local_dir / ".adt-download"):
            if is_dir:
                patterns = [f"{sub}*"] if sub else None
                huggingface_hub.snapshot_download(repo, revision=revision, local_dir=str(local_dir),
                                                  allow_patterns=patterns)
                out = local_dir / sub if sub else local_dir
            else:
                out = Path(huggingface_hub.hf_hub_download(repo, sub, revision=revision, local_dir=str(local_dir)))
        if not out.exists():
            raise FileNotFoundError(f"{url}: not found in {repo}@{revision}")
        self._verify_local(out, sha256)
        return out

    # -- s3 --
    def _local(self, bucket: str, key: str) -> Path:
        parts = [s for s in key.split("/") if s]
        if any(s in (".", "..") for s in parts):
            raise ManifestError(f"s3://{bucket}/{key}: '.' or '..' in the key")
        return self.root / "s3" / bucket / Path(*parts) if parts else self.root / "s3" / bucket

    @staticmethod
    def _meta(local: Path) -> Path:
        return local.with_name(local.name + ".meta.json")

    def _cached(self, local: Path, sha256: str | None) -> bool:
        meta = self._meta(local)
        if not (local.is_file() and meta.is_file()):
            return False
        try:
            info = json.loads(meta.read_text())
        except ValueError:
            return False
        if info.get("size") != local.stat().st_size:
            return False
        if sha256 is not None and str(info.get("sha256", "")).lower() != sha256.lower():
            return False
        log.info("using cached %s", local)
        return True

    def _head(self, bucket: str, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _download(self, bucket: str, key: str, head: Mapping[str, Any], sha256: str | None) -> Path:
        local = self._local(bucket, key)
        url = f"s3://{bucket}/{key}"
        with _locked(local):
            if self._cached(local, sha256):  # another process finished it while we waited
                return local
            size = int(head.get("ContentLength", 0))
            tmp = local.with_name(local.name + ".partial")
            log.info("downloading %s (%.1f MB) to %s", url, size / 1e6, local)
            t0 = time.perf_counter()
            progress = _Progress(Path(key).name, size)
            try:
                self.client.download_file(bucket, key, str(tmp), Callback=progress)
            finally:
                progress.close()
            try:
                digest = _check_sha(tmp, sha256, url) or sha256_file(tmp)
            except ChecksumError:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, local)
            meta = {"url": url, "size": local.stat().st_size, "etag": str(head.get("ETag", "")).strip('"'),
                    "sha256": digest}
            self._meta(local).write_text(json.dumps(meta, indent=1))
            dt = time.perf_counter() - t0
            log.info("downloaded %s in %.1f s (%.1f MB/s)", url, dt, size / 1e6 / max(dt, 1e-6))
            return local

    def _fetch_dir(self, bucket: str, prefix: str, sha256) -> Path:
        """Every object under `prefix` (a "directory"), each downloaded once."""
        if sha256 is not None and not isinstance(sha256, Mapping):
            raise ManifestError(f"s3://{bucket}/{prefix}: is a directory; sha256 must map file names to hex strings")
        sha256 = dict(sha256 or {})
        local_dir = self._local(bucket, prefix)
        done = self._meta(local_dir)
        if done.is_file() and local_dir.is_dir():
            files = json.loads(done.read_text()).get("files", [])
            if all(self._cached(local_dir / f, sha256.get(f)) for f in files) and set(sha256) <= set(files):
                return local_dir
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        if not keys:
            raise FileNotFoundError(f"s3://{bucket}/{prefix}: no such object or prefix")
        rels = [k[len(prefix):] for k in keys]
        absent = sorted(set(sha256) - set(rels))
        if absent:
            raise ManifestError(f"s3://{bucket}/{prefix}: sha256 given for files not there: {absent}")
        for k, rel in zip(keys, rels):
            local = self._local(bucket, k)
            if not self._cached(local, sha256.get(rel)):
                self._download(bucket, k, self.client.head_object(Bucket=bucket, Key=k), sha256.get(rel))
        local_dir.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps({"url": f"s3://{bucket}/{prefix}", "files": sorted(rels)}, indent=1))
        return local_dir


# ---- memory planning ---------------------------------------------------------------------
def dtype_bytes(dtype: str | torch.dtype) -> int:
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return torch.empty((), dtype=dt).element_size()


def kv_cache_bytes(n_layer: int, n_head: int, head_dim: int, length: int, rows: int, dtype: str | torch.dtype) -> int:
    """Keys + values for `rows` sequences of `length` positions."""
    return 2 * n_layer * rows * n_head * head_dim * length * dtype_bytes(dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU holds to decode with a bundle. Bytes; per-image figures are per image in
    flight (vanilla AR batches B images at once; the speculative loop decodes one at a time)."""

    dtype: str
    rows_per_image: int  # 2 with classifier-free guidance (cond + uncond), else 1
    weights: dict[str, int]  # per component, as placed for decoding
    target_kv_per_image: int
    drafter_kv_per_image: int
    logits_per_image: int  # fp32 logits of the widest forward (caption prefill or tree verify)
    vq_decode_per_image: int = 0  # estimate: live fp32 activations of the VQ decoder at full resolution

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def per_image(self) -> int:
        """Decoding tokens and decoding pixels happen one after the other: the larger phase."""
        tokens = self.target_kv_per_image + self.drafter_kv_per_image + self.logits_per_image
        return max(tokens, self.vq_decode_per_image)

    def max_images(self, gpu_bytes: int, headroom: float = 0.15) -> int:
        """Images in flight that fit in `gpu_bytes` after weights, keeping `headroom` free."""
        free = gpu_bytes * (1.0 - headroom) - self.weights_total
        return max(0, int(free // self.per_image))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(weights_total=self.weights_total, per_image=self.per_image)
        return d


def _numel(factory) -> int:
    with torch.device("meta"):
        m = factory()
    return sum(t.numel() for t in list(m.parameters()) + list(m.buffers()))


def plan_memory(
    target: GPTConfig,
    drafter: DrafterConfig | None = None,
    vq: VQConfig | None = None,
    text_encoder_bytes: int = 0,
    dtype: str = "bfloat16",
    cfg: bool = True,
    tree_nodes: int = 58,
    depth: int = 5,
) -> MemoryPlan:
    """Memory of a bundle from its configs alone (meta-device counts; no weights needed).

    dtype: decoding dtype of target and drafter (their KV caches too); the VQ decoder runs in
    fp32. tree_nodes / depth: the largest draft tree (EAGLE-2: 58 nodes, 5 levels); 0 for AR.
    text_encoder_bytes: the text encoder's weights when it sits on the same GPU.
    """
    size = dtype_bytes(dtype)
    rows = 2 if cfg else 1
    t, n = target.cls_token_num, target.num_image_tokens
    spec = drafter is not None and tree_nodes > 0
    weights = {"target": _numel(lambda: LlamaGenGPT(target)) * size}
    if drafter is not None:
        weights["drafter"] = _numel(lambda: Drafter(drafter)) * size
    if vq is not None:
        weights["vq"] = _numel(lambda: VQModel(vq)) * 4
    if text_encoder_bytes:
        weights["text_encoder"] = int(text_encoder_bytes)
    extra = tree_nodes + 1 if spec else 0  # Generator: T + N + tree + 1 positions
    target_kv = kv_cache_bytes(target.n_layer, target.n_head, target.head_dim, t + n + extra, rows, dtype)
    drafter_kv = 0
    if spec:
        length = n + (depth + 1) * (tree_nodes + 1)  # Generator: committed pairs + every tree level's nodes
        drafter_kv = kv_cache_bytes(1, drafter.n_head, drafter.head_dim, length, rows, dtype)
    widest = max(t, tree_nodes + 1 if spec else 1)
    logits = rows * widest * target.vocab_size * 4
    vq_act = 0
    if vq is not None:  # ~4 live feature maps of the last decoder level (ch * ch_mult[0] wide) in fp32
        pixels = target.grid_h * target.grid_w * vq.downsample_factor**2
        vq_act = VQ_LIVE_MAPS * vq.ch * vq.ch_mult[0] * pixels * 4
    return MemoryPlan(dtype if isinstance(dtype, str) else str(dtype), rows, weights, target_kv, drafter_kv, logits,
                      vq_act)


def bundle_memory(bundle: Bundle, dtype: str = "bfloat16", cfg: bool | None = None, tree_nodes: int = 58,
                  depth: int = 5, text_encoder_on_gpu: bool = True) -> MemoryPlan:
    """`plan_memory` for a loaded bundle; cfg defaults to the bundle's sampling defaults and
    the text encoder counts at its actual size when it sits on the GPU."""
    text = bundle.component_bytes().get("text_encoder", 0) if text_encoder_on_gpu else 0
    return plan_memory(
        bundle.target.config, bundle.drafter.config if bundle.drafter is not None else None, bundle.vq.cfg,
        text_encoder_bytes=text, dtype=dtype, cfg=bundle.sampling.use_cfg if cfg is None else cfg,
        tree_nodes=tree_nodes, depth=depth,
    )
